"""/v1/decisions: the planner's decisions, newest first, each with its reason, prediction and measured outcome."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from tierplan.api.deps import READS_GUARD, RepoDep
from tierplan.api.routes.common import AgentIdQuery, errors
from tierplan.controller.protocol_service import DecisionRecord

router = APIRouter(prefix="/v1/decisions", tags=["decisions"], dependencies=[READS_GUARD])


@router.get("", response_model=list[DecisionRecord], responses=errors(422))
def list_decisions(repo: RepoDep,
                   agent_id: AgentIdQuery = None,
                   since_s: Annotated[float | None, Query(ge=0, allow_inf_nan=False)] = None,
                   until_s: Annotated[float | None, Query(ge=0, allow_inf_nan=False)] = None,
                   limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[DecisionRecord]:
    """Filter by agent and by creation time (seconds since the epoch, inclusive)."""
    if since_s is not None and until_s is not None and until_s < since_s:
        raise HTTPException(422,
                            detail=f"query.until_s: {until_s} is before since_s={since_s}")
    return repo.decisions(agent_id=agent_id, since_s=since_s, until_s=until_s, limit=limit)
