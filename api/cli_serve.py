"""`tierplan serve` (the controller service under uvicorn) and `tierplan token create` (a bearer token).

Runs in the user's shell / the service process. Settings come from the flags over `TIERPLAN_*` variables
(api/settings.py), built here in the command, never at import. A bad flag, an unreachable database or a
failed migration prints `error: ...` and exits 2 before uvicorn starts. The raw token is printed once and
only its hash is stored.
"""

from __future__ import annotations

import gc
import os
import sys
from enum import StrEnum
from typing import Annotated

import typer

DbOpt = Annotated[str | None, typer.Option("--db", help="Database URL: sqlite:///path.db (default "
                                                        "./tierplan.db) or postgresql+psycopg://user@host/db; "
                                                        "env TIERPLAN_DB_URL.")]


GC_GEN0_THRESHOLD = 50_000  # allocations between young-generation collections (CPython's default: 700)
GIL_SWITCH_S = 0.0005  # CPython's default: 0.005


class ScopeOpt(StrEnum):
    read = "read"
    write = "write"


def _fail(message: str) -> typer.Exit:
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(2)


def _settings(**flags: object):  # -> Settings (imported lazily: pydantic only when a command runs)
    from pydantic import ValidationError

    from tierplan.api.app import validation_detail
    from tierplan.api.settings import Settings

    try:
        return Settings.from_env(os.environ, **flags)
    except ValidationError as exc:
        raise _fail(f"settings: {validation_detail(list(exc.errors()))}") from None


def _migrate(url: str) -> None:
    from tierplan.api.db.migrate import upgrade

    try:
        upgrade(url)
    except Exception as exc:  # an unreachable or foreign database is the user's to fix: say which and why
        raise _fail(f"--db {url!r}: cannot bring the schema to head: {type(exc).__name__}: {exc}") from None


def serve(
    db: DbOpt = None,
    host: Annotated[str | None, typer.Option(help="Interface to listen on (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(min=0, max=65535, help="TCP port (default 8321).")] = None,
    token: Annotated[str | None, typer.Option(help="A write token to accept (stored hashed as 'bootstrap'); "
                                                   "env TIERPLAN_TOKEN.")] = None,
    plan_interval_s: Annotated[float | None, typer.Option(help="Planner poll period, seconds (default 0.2).")]
        = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
) -> None:
    """Run the controller service (FastAPI under uvicorn) on one database."""
    import uvicorn

    from tierplan.api.app import create_app

    settings = _settings(db_url=db, host=host, port=port, bootstrap_token=token, plan_interval_s=plan_interval_s)
    if settings.migrate_on_start:
        _migrate(settings.db_url)
    try:
        app = create_app(settings)
    except Exception as exc:  # e.g. SQLAlchemy refusing a malformed URL
        raise _fail(f"--db {settings.db_url!r}: {type(exc).__name__}: {exc}") from None
    # Each telemetry batch allocates ~10^4 small objects; with the default thresholds the collector's full
    # passes over the long-lived heap (controllers, queues) showed up as 100-200 ms stalls in the ingest p99.
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 50)
    # The planner thread computes while requests wait on sockets and SQLite, each return to Python waiting up to
    # the switch interval for the GIL (a convoy: ~10 waits a request); a shorter one keeps the request p99 down.
    sys.setswitchinterval(GIL_SWITCH_S)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level, access_log=False)


def token_create(
    name: Annotated[str, typer.Option(help="Who the token is for (recorded as the author of policy changes).")],
    scope: Annotated[ScopeOpt, typer.Option(help="read: GET only; write: every endpoint.")] = ScopeOpt.write,
    db: DbOpt = None,
) -> None:
    """Make a bearer token and print it once (only its SHA-256 is stored)."""
    from tierplan.api.auth import Scope, hash_token, new_token
    from tierplan.api.db.engine import make_engine
    from tierplan.api.db.repo import Repository

    if not name.strip() or any(ch.isspace() for ch in name):
        raise _fail(f"--name {name!r}: expected a non-empty name without whitespace")
    settings = _settings(db_url=db)
    _migrate(settings.db_url)
    raw = new_token()
    Repository(make_engine(settings.db_url)).add_token(name, Scope(scope.value), hash_token(raw))
    print(raw)


def register(app: typer.Typer) -> None:
    """Add `serve` and `token create` to `app` (called at the bottom of api/cli.py)."""
    app.command("serve")(serve)
    token_app = typer.Typer(no_args_is_help=True, help="Bearer tokens of the controller service.")
    token_app.command("create")(token_create)
    app.add_typer(token_app, name="token")
