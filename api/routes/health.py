"""/healthz (the process answers), /readyz (the database answers, migrations at head), /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tierplan.api.deps import MetricsDep, RepoDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "The database or its schema is not ready"}})
def readyz(request: Request, repo: RepoDep) -> JSONResponse:
    try:
        repo.ping()
    except Exception as exc:  # any driver error means not ready; the reason goes to the caller
        return JSONResponse({"status": "not ready", "detail": f"database: {type(exc).__name__}: {exc}"[:500]},
                            status_code=status.HTTP_503_SERVICE_UNAVAILABLE)
    why = request.app.state.schema_check()
    if why is not None:
        return JSONResponse({"status": "not ready", "detail": why}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=Response)
def metrics(m: MetricsDep) -> Response:
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)
