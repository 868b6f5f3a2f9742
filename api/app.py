"""The controller service's FastAPI app factory: `create_app(settings)`, nothing built at import.

Runs in the service process (`tierplan serve` hands the app to uvicorn; tests build it in process). The
factory wires the repository (or the one given), the metrics registry, the token auth and the ControllerHub
onto `app.state`, one router per resource, the request size limit (413), the write-token gate (401/403
before a body is read), the HTTP metrics, and the error handlers that turn every client mistake into a 4xx
with a precise `detail` (pydantic errors: 422 with the field path; invalid JSON: 400; store errors:
404/409). The lifespan runs the migrations (when asked), stores the bootstrap token hashed, rebuilds the
hub from the database and starts its planner thread; on shutdown it stops the planner. It never plans on
a request.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tierplan.api.app_middleware import BodyLimit, HttpMetrics, IngestFirst, WriteGate
from tierplan.api.auth import TokenAuth
from tierplan.api.db.errors import Conflict, InvalidQuery, NotFound, StoreError, Unavailable
from tierplan.api.db.repo import Repository
from tierplan.api.hub import ControllerHub, KnobsMisfit
from tierplan.api.hub_wal import defer_checkpoints
from tierplan.api.service_metrics import ServiceMetrics
from tierplan.api.settings import Settings

log = logging.getLogger(__name__)
NUM_ERRORS_SHOWN = 5


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc) or "body"


def validation_detail(errors: list[dict[str, Any]]) -> str:
    """pydantic's errors as one line: '<field path>: <what> (got <input>)', the first few."""
    parts = []
    for err in errors[:NUM_ERRORS_SHOWN]:
        got = repr(err.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."
        parts.append(f"{_loc(tuple(err.get('loc', ())))}: {err.get('msg', 'invalid')} (got {got})")
    more = len(errors) - NUM_ERRORS_SHOWN
    return "; ".join(parts) + (f"; and {more} more error(s)" if more > 0 else "")


def _install_handlers(app: FastAPI) -> None:
    def detail(code: int, text: str) -> JSONResponse:
        return JSONResponse({"detail": text}, status_code=code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = list(exc.errors())
        bad_json = [e for e in errs if e.get("type") == "json_invalid"]
        if bad_json:
            ctx = bad_json[0].get("ctx") or {}
            return detail(status.HTTP_400_BAD_REQUEST, f"body: invalid JSON ({ctx.get('error', 'malformed')}); "
                                                       "expected a JSON document")
        raw_body = [e for e in errs if tuple(e.get("loc", ())) == ("body",) and isinstance(e.get("input"), bytes | str)]
        if raw_body:
            return detail(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, "body: sent without Content-Type: application/json; "
                                                                  "expected a JSON document with that header")
        return detail(422, validation_detail(errs))

    @app.exception_handler(NotFound)
    async def _not_found(_: Request, exc: NotFound) -> JSONResponse:
        return detail(status.HTTP_404_NOT_FOUND, str(exc))

    @app.exception_handler(Conflict)
    async def _conflict(_: Request, exc: Conflict) -> JSONResponse:
        return detail(status.HTTP_409_CONFLICT, str(exc))

    @app.exception_handler(InvalidQuery)
    async def _bad_query(_: Request, exc: InvalidQuery) -> JSONResponse:
        return detail(422, str(exc))

    @app.exception_handler(Unavailable)
    async def _unavailable(_: Request, exc: Unavailable) -> JSONResponse:
        return detail(status.HTTP_503_SERVICE_UNAVAILABLE, f"database unavailable: {exc}")

    @app.exception_handler(StoreError)
    async def _store(_: Request, exc: StoreError) -> JSONResponse:
        return detail(status.HTTP_409_CONFLICT, str(exc))

    @app.exception_handler(KnobsMisfit)
    async def _misfit(_: Request, exc: KnobsMisfit) -> JSONResponse:
        return detail(422, str(exc))


def _extend_openapi(app: FastAPI) -> None:
    """Add the schemas of bodies a route validates itself (the telemetry batch) to /openapi.json."""
    from tierplan.api.routes.telemetry import openapi_components

    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            found = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, body in openapi_components().items():
                found.setdefault(name, body)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: Settings, *, repository: Repository | None = None,
               clock: Callable[[], float] | None = None) -> FastAPI:
    """The service app. `repository` replaces the one built from `settings.db_url` (then no migrations run and
    /readyz checks only that it answers); `clock` (seconds) replaces time.time everywhere."""
    now = clock or time.time
    repo = repository
    if repo is None:
        from tierplan.api.db.engine import make_engine

        repo = Repository(make_engine(settings.db_url), clock=now, stale_after_s=settings.stale_after_s)
    metrics = ServiceMetrics()
    hub = ControllerHub(repo, metrics, now, plan_interval_s=settings.plan_interval_s, retention_s=settings.retention_s,
                        checkpoint=defer_checkpoints(repo.engine) if repository is None else None)
    schema_ok = {"ok": repository is not None}

    def schema_check() -> str | None:
        """None when the schema is at head (checked once, then remembered), else why not."""
        if schema_ok["ok"]:
            return None
        from tierplan.api.db.migrate import at_head

        try:
            schema_ok["ok"] = at_head(settings.db_url)
        except Exception as exc:  # an unreachable database is a readiness answer, not a crash
            return f"migrations: {type(exc).__name__}: {exc}"[:500]
        return None if schema_ok["ok"] else "migrations: the database is not at head (run `tierplan db upgrade`)"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if repository is None and settings.migrate_on_start:
            from tierplan.api.db.migrate import upgrade

            upgrade(settings.db_url)
            schema_ok["ok"] = True
        if settings.bootstrap_token is not None:
            app.state.auth.bootstrap(settings.bootstrap_token.get_secret_value())
        hub.load()
        hub.start()
        try:
            yield
        finally:
            hub.stop()

    app = FastAPI(title="tierplan controller service", version="1", lifespan=lifespan,
                  description="Placement decisions for one HBM budget shared by MoE experts and the KV cache.")
    app.state.settings, app.state.repo, app.state.metrics, app.state.hub = settings, repo, metrics, hub
    app.state.auth = TokenAuth(repo, now)
    app.state.schema_check = schema_check
    _install_handlers(app)
    from tierplan.api.routes import acks, agents, decisions, health, plans, policies, telemetry

    for r in (agents.router, agents.reads, telemetry.router, plans.router, acks.router, policies.reads,
              policies.router, decisions.router, health.router):
        app.include_router(r)
    if importlib.util.find_spec("tierplan.api.routes.ui") is not None:  # the decisions page (the ui helper's router)
        app.include_router(importlib.import_module("tierplan.api.routes.ui").router)
    _extend_openapi(app)
    app.add_middleware(IngestFirst, hub=hub)
    app.add_middleware(WriteGate, auth=app.state.auth)
    app.add_middleware(BodyLimit, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(HttpMetrics, metrics=metrics)  # outermost: counts the 413s too
    return app
