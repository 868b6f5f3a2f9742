"""Schema migrations of the controller service's database (Alembic), without an alembic.ini.

Run by the controller service on start (`migrate_on_start`) and by `tierplan db upgrade|downgrade|current`.
The migration scripts live inside the package (api/db/migrations, found through importlib.resources), so an
installed wheel migrates like a checkout. Each call migrates in one transaction on a connection of ours
(SQLite and PostgreSQL both run DDL transactionally: a failed migration leaves the old schema). It never
creates tables any other way (no `create_all`) and never prints: callers report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from typing import TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import InterfaceError, OperationalError

from tierplan.api.db.engine import WRITE_OPTION, describe_failure, make_engine
from tierplan.api.db.errors import StoreError, Unavailable

T = TypeVar("T")


class MigrationError(StoreError):
    """Alembic refused: an unknown revision, or a database stamped with a revision this code does not have."""


@contextmanager
def _script_location() -> Iterator[str]:
    with resources.as_file(resources.files(__name__.rpartition(".")[0]) / "migrations") as path:
        yield str(path)


def _config(location: str, conn: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", location)
    cfg.attributes["connection"] = conn
    return cfg


def _run(target: str | Engine, work: Callable[[Connection, str], T], write: bool) -> T:
    """`work(connection, script_location)` in one transaction on `target` (a URL, or the service's engine)."""
    engine = make_engine(target) if isinstance(target, str) else target
    try:
        with _script_location() as location, engine.connect() as conn:
            if write:
                conn.execution_options(**{WRITE_OPTION: True})
            with _sqlite_foreign_keys_off(conn), conn.begin():
                done = work(conn, location)
                _check_foreign_keys(conn)
                return done
    except (OperationalError, InterfaceError) as exc:
        raise Unavailable(describe_failure(exc, engine.url)) from exc
    except CommandError as exc:
        raise MigrationError(f"migration refused: {exc}") from None
    finally:
        if isinstance(target, str):
            engine.dispose()


@contextmanager
def _sqlite_foreign_keys_off(conn: Connection) -> Iterator[None]:
    """SQLite batch mode rebuilds a table by copy, drop and rename; with foreign keys on, dropping `agents`
    would cascade-delete every window, plan and decision. The pragma only takes effect outside a transaction,
    so it is set on the raw connection before BEGIN and restored before the connection goes back to the pool."""
    if conn.dialect.name != "sqlite":
        yield
        return
    raw = conn.connection.dbapi_connection
    assert raw is not None
    raw.execute("PRAGMA foreign_keys = OFF")
    try:
        yield
    finally:
        raw.execute("PRAGMA foreign_keys = ON")


def _check_foreign_keys(conn: Connection) -> None:
    """Refuse (roll back) a SQLite migration that left rows pointing at nothing (checks were off during it)."""
    if conn.dialect.name == "sqlite":
        broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        if broken:
            raise MigrationError(f"migration left {len(broken)} rows whose foreign keys point at nothing, e.g. "
                                 f"{tuple(broken[0])}; rolled back")


def head() -> str:
    """The newest revision this code knows."""
    with _script_location() as location:
        found = ScriptDirectory.from_config(_config(location)).get_current_head()
    if found is None:
        raise MigrationError("api/db/migrations has no revisions")
    return found


def upgrade(target: str | Engine, revision: str = "head") -> None:
    _run(target, lambda conn, loc: command.upgrade(_config(loc, conn), revision), write=True)


def downgrade(target: str | Engine, revision: str) -> None:
    """Down to `revision` ("base": an empty database; "-1": one step)."""
    _run(target, lambda conn, loc: command.downgrade(_config(loc, conn), revision), write=True)


def current(target: str | Engine) -> str | None:
    """The revision the database is at (None: never migrated)."""
    return _run(target, lambda conn, _loc: MigrationContext.configure(conn).get_current_revision(), write=False)


def at_head(target: str | Engine) -> bool:
    return current(target) == head()
