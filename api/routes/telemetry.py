"""/v1/telemetry: a sidecar's batch of windows, checked, stored and queued for the planner (service process).

Never plans on the request path: the hub's planner thread does. Each refused window is reported in the
IngestResult with its code (controller.state.RejectCode values) and changes nothing.
"""

from __future__ import annotations

import time

from fastapi import APIRouter

from api.deps import HubDep, MetricsDep, WriterDep
from api.routes.common import WRITE_ERRORS, errors
from controller.protocol_service import IngestResult, TelemetryBatch

router = APIRouter(prefix="/v1/telemetry", tags=["telemetry"])


@router.post("", response_model=IngestResult, responses=errors(*WRITE_ERRORS))
def post_telemetry(batch: TelemetryBatch, hub: HubDep, metrics: MetricsDep, _: WriterDep) -> IngestResult:
    """Ingest up to 256 windows; per-window rejections name the rule broken."""
    start = time.perf_counter()
    try:
        return hub.ingest(batch)
    finally:
        metrics.ingest_s.observe(time.perf_counter() - start)
