"""Migrations on SQLite and PostgreSQL: up to head, down to base (no table left) and up again; the models and
the migration scripts describe the same schema; and `tierplan db` does the same from the shell, refusing a
bad URL or an unreachable database with `error: ...` and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, inspect
from typer.testing import CliRunner

from tests.api.db.builders import plan, registration, windows
from tierplan.api.cli import app
from tierplan.api.db import migrate
from tierplan.api.db.engine import make_engine
from tierplan.api.db.errors import InvalidDatabaseURL, Unavailable
from tierplan.api.db.migrate import MigrationError
from tierplan.api.db.models import Base
from tierplan.api.db.repo import Repository

TABLES = {"agents", "telemetry_windows", "plans", "decisions", "policies", "policy_versions", "api_tokens"}


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_up_down_up(db_url: str) -> None:
    assert migrate.current(db_url) is None and not migrate.at_head(db_url)
    migrate.upgrade(db_url)
    assert migrate.current(db_url) == migrate.head() and migrate.at_head(db_url)
    assert _tables(db_url) == TABLES
    migrate.downgrade(db_url, "base")
    assert migrate.current(db_url) is None and _tables(db_url) == set()
    migrate.upgrade(db_url)
    assert _tables(db_url) == TABLES
    migrate.upgrade(db_url)  # at head already: nothing to do
    engine = make_engine(db_url)
    Repository(engine).register_agent(registration())  # the schema works after the round trip
    engine.dispose()


def test_models_and_migrations_agree(db_url: str) -> None:
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == []


def test_an_unknown_revision_is_refused(db_url: str) -> None:
    with pytest.raises(MigrationError, match="Can't locate revision identified by '0042'"):
        migrate.upgrade(db_url, "0042")
    assert migrate.current(db_url) is None


def test_the_service_engine_can_be_migrated_in_memory() -> None:
    engine = make_engine("sqlite://")  # one shared in-memory database: migrate the engine, not the URL
    migrate.upgrade(engine)
    assert migrate.at_head(engine)
    Repository(engine).register_agent(registration())
    assert Repository(engine).get_registration("agent-0") is not None


@pytest.mark.parametrize(("url", "match"), [
    ("mysql://u@h/db", "scheme 'mysql' is not supported"),
    ("", "database URL is empty"),
    (":::", "cannot be parsed"),
    ("sqlite://somehost/x.db", "names a host"),
])
def test_bad_urls_are_refused_before_connecting(url: str, match: str) -> None:
    with pytest.raises(InvalidDatabaseURL, match=match):
        make_engine(url)


def test_an_unreachable_database_is_unavailable() -> None:
    with pytest.raises(Unavailable, match=r"postgresql\+psycopg://u@127\.0\.0\.1:1/db is not reachable: .*refused"):
        migrate.current("postgresql://u@127.0.0.1:1/db")
    engine = make_engine("postgresql+psycopg://u:secret@127.0.0.1:1/db")
    with pytest.raises(Unavailable) as err:
        Repository(engine).ping()
    assert "secret" not in str(err.value) and "***" in str(err.value)


def test_cli_upgrade_current_downgrade(db_url: str) -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["db", "current", "--db", db_url])
    assert out.exit_code == 0 and "never migrated" in out.output and "behind head" in out.output
    out = runner.invoke(app, ["db", "upgrade", "--db", db_url])
    assert out.exit_code == 0 and f"at revision {migrate.head()}" in out.output
    out = runner.invoke(app, ["db", "current", "--db", db_url])
    assert out.exit_code == 0 and "(head)" in out.output
    out = runner.invoke(app, ["db", "downgrade", "--db", db_url, "--revision", "base"])
    assert out.exit_code == 0 and "base (no tables)" in out.output
    assert _tables(db_url) == set()


@pytest.mark.parametrize(("args", "match"), [
    (["upgrade", "--db", "mysql://u@h/db"], "error: database URL scheme 'mysql' is not supported"),
    (["current", "--db", "postgresql://u@127.0.0.1:1/db"], "error: database postgresql+psycopg://u@127.0.0.1:1/db "
                                                            "is not reachable"),
    (["upgrade", "--db", "sqlite:////nonexistent-dir/x.db"], "error: database sqlite:////nonexistent-dir/x.db is "
                                                             "not reachable: unable to open database file"),
    (["downgrade", "--db", "sqlite://", "--revision", "0042"], "error: migration refused: Can't locate revision"),
])
def test_cli_bad_input_is_an_error_line_and_exit_2(args: list[str], match: str) -> None:
    out = CliRunner().invoke(app, ["db", *args])
    assert out.exit_code == 2, out.output
    assert match in out.output and "Traceback" not in out.output


def test_one_step_at_a_time(db_url: str) -> None:
    migrate.upgrade(db_url, "0001")
    assert migrate.current(db_url) == "0001" and not migrate.at_head(db_url)
    migrate.upgrade(db_url)
    migrate.downgrade(db_url, "-1")
    assert migrate.current(db_url) == "0001" and _tables(db_url) == TABLES


def test_postgresql_bodies_are_lz4(fresh_pg_url: str) -> None:
    from sqlalchemy import text

    migrate.upgrade(fresh_pg_url)
    engine = make_engine(fresh_pg_url)
    with engine.connect() as conn:
        if "lz4" not in conn.execute(text("SELECT enumvals FROM pg_settings WHERE name = "
                                          "'default_toast_compression'")).scalar():
            pytest.skip("this PostgreSQL server is built without lz4")
        method = conn.execute(text("SELECT attcompression FROM pg_attribute WHERE attrelid = "
                                   "'telemetry_windows'::regclass AND attname = 'body'")).scalar()
    engine.dispose()
    assert method == "l"


def test_sqlite_batch_rebuild_of_agents_keeps_their_rows(tmp_path: Path) -> None:
    """A later migration that rebuilds `agents` in SQLite batch mode (copy, drop, rename) must not cascade-
    delete the windows and plans that point at it (foreign keys are off during migrations, checked after)."""
    import sqlalchemy as sa
    from alembic.operations import Operations

    engine = make_engine(f"sqlite:///{tmp_path / 'b.db'}")
    migrate.upgrade(engine)
    repo = Repository(engine)
    repo.register_agent(registration())
    repo.add_windows(windows(3))
    repo.insert_plan("agent-0", plan(1))

    def rebuild_agents(conn: Connection, _location: str) -> None:
        with Operations(MigrationContext.configure(conn)).batch_alter_table("agents", recreate="always") as batch:
            batch.add_column(sa.Column("note", sa.Text(), nullable=True))

    migrate._run(engine, rebuild_agents, write=True)
    assert len(repo.recent_windows("agent-0", 10)) == 3 and repo.newest_version("agent-0") == 1
    with engine.connect() as conn:  # the pooled connection has its foreign keys back on
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()
