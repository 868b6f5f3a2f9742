"""`tierplan db upgrade|downgrade|current`: migrate the controller service's database by hand.

Runs in the user's shell (the service also upgrades on start). Imports SQLAlchemy and Alembic only inside the
commands, so `tierplan --help` stays fast. A bad URL or a database that does not answer prints `error: ...`
(what, which database, what was expected) and exits 2; it never shows a traceback or changes anything then.
"""

from __future__ import annotations

from typing import Annotated

import typer

DEFAULT_DB_URL = "sqlite:///./tierplan.db"
DbUrl = Annotated[str, typer.Option("--db", envvar="TIERPLAN_DB_URL", show_default=True,
                                    help="Database URL: sqlite:///PATH or postgresql+psycopg://USER@HOST/DB.")]


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(2)


def _shown(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def upgrade_cmd(db: DbUrl = DEFAULT_DB_URL, revision: Annotated[str, typer.Option(
        help="Target revision (default: the newest this version knows).")] = "head") -> None:
    """Migrate the database up (creates the tables on a new database)."""
    from tierplan.api.db import migrate
    from tierplan.api.db.errors import StoreError

    try:
        migrate.upgrade(db, revision)
        now = migrate.current(db)
    except StoreError as exc:
        raise _fail(exc) from None
    typer.echo(f"db: {_shown(db)} at revision {now}")


def downgrade_cmd(db: DbUrl = DEFAULT_DB_URL, revision: Annotated[str, typer.Option(
        help='Target revision: "base" drops every table (and its data), "-1" goes one step down.')] = "-1") -> None:
    """Migrate the database down (data in dropped tables is lost)."""
    from tierplan.api.db import migrate
    from tierplan.api.db.errors import StoreError

    try:
        migrate.downgrade(db, revision)
        now = migrate.current(db)
    except StoreError as exc:
        raise _fail(exc) from None
    typer.echo(f"db: {_shown(db)} at revision {now or 'base (no tables)'}")


def current_cmd(db: DbUrl = DEFAULT_DB_URL) -> None:
    """Print the database's revision and whether it is the newest this version knows."""
    from tierplan.api.db import migrate
    from tierplan.api.db.errors import StoreError

    try:
        now, newest = migrate.current(db), migrate.head()
    except StoreError as exc:
        raise _fail(exc) from None
    where = "head" if now == newest else f"behind head {newest}: run `tierplan db upgrade`"
    typer.echo(f"db: {_shown(db)} at revision {now or 'base (never migrated)'} ({where})")


def register(app: typer.Typer) -> None:
    db_app = typer.Typer(no_args_is_help=True, help="The controller service's database (migrations).")
    db_app.command("upgrade")(upgrade_cmd)
    db_app.command("downgrade")(downgrade_cmd)
    db_app.command("current")(current_cmd)
    app.add_typer(db_app, name="db")
