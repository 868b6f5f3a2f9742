"""/v1/acks: an agent's answer to a plan (applied or rejected), stored once (service process)."""

from __future__ import annotations

from fastapi import APIRouter

from tierplan.api.deps import HubDep, WriterDep
from tierplan.api.routes.common import WRITE_ERRORS, errors
from tierplan.controller.protocol import PlanAck
from tierplan.controller.protocol_service import PlanRecord

router = APIRouter(prefix="/v1/acks", tags=["acks"])


@router.post("", response_model=PlanRecord, responses=errors(*WRITE_ERRORS, 404, 409))
def post_ack(ack: PlanAck, hub: HubDep, _: WriterDep) -> PlanRecord:
    """Record the ack; 404 for a plan never issued, 409 for a second ack of the same version."""
    return hub.ack(ack)
