"""/v1/telemetry: a sidecar's batch of windows, checked, stored and queued for the planner (service process).

The body is validated straight from its bytes (`TelemetryBatch.model_validate_json`, in the threadpool):
FastAPI's own path would decode the JSON into Python objects first and validate those, a fifth slower on
the hottest endpoint; the schema is still in /openapi.json (`openapi_components`). Never plans on the
request path: the hub's planner thread does. Each refused window is reported in the IngestResult with its
code (controller.state.RejectCode values) and changes nothing.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tierplan.api.deps import HubDep, MetricsDep, WriterDep
from tierplan.api.hub import ControllerHub
from tierplan.api.routes.common import WRITE_ERRORS, errors
from tierplan.api.service_metrics import ServiceMetrics
from tierplan.controller.protocol_service import IngestResult, TelemetryBatch

router = APIRouter(prefix="/v1/telemetry", tags=["telemetry"])
REF = "#/components/schemas/{model}"


def openapi_components() -> dict[str, Any]:
    """TelemetryBatch and the schemas it refers to, for /openapi.json's components."""
    schema = TelemetryBatch.model_json_schema(ref_template=REF)
    found = schema.pop("$defs", {})
    return {**found, "TelemetryBatch": schema}


def _ingest(body: bytes, hub: ControllerHub, metrics: ServiceMetrics) -> IngestResult:
    start = time.perf_counter()
    try:
        try:
            batch = TelemetryBatch.model_validate_json(body)
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        return hub.ingest(batch)
    finally:
        metrics.ingest_s.observe(time.perf_counter() - start)


@router.post("", response_model=IngestResult, responses=errors(*WRITE_ERRORS, 415),
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": {"$ref": REF.format(model="TelemetryBatch")}}}}})
async def post_telemetry(request: Request, hub: HubDep, metrics: MetricsDep, _: WriterDep) -> IngestResult:
    """Ingest up to 256 windows (a TelemetryBatch); per-window rejections name the rule broken."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json" and not kind.endswith("+json"):
        raise HTTPException(415, detail=f"Content-Type: {kind or 'missing'}; expected application/json")
    return await run_in_threadpool(_ingest, await request.body(), hub, metrics)
