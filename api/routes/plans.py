"""/v1/agents/{agent_id}/plan(s): the current plan, cheap to poll (ETag, since_version), and the history.

Service process; reads only. The current plan answers 200 with `ETag: "v<version>"`, 304 when the caller's
`If-None-Match` names that version or `since_version` is at or past it, 204 before any plan.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Response, status
from fastapi.responses import JSONResponse

from tierplan.api.deps import READS_GUARD, RepoDep
from tierplan.api.routes.common import AgentIdPath, errors
from tierplan.controller.protocol_service import PlanRecord

router = APIRouter(prefix="/v1/agents", tags=["plans"], dependencies=[READS_GUARD])


def _known(repo: RepoDep, agent_id: str) -> None:
    if repo.get_registration(agent_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"agent {agent_id!r} is not registered")


def _matches(if_none_match: str | None, etag: str) -> bool:
    if not if_none_match:
        return False
    tags = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return "*" in tags or etag in tags


@router.get("/{agent_id}/plan", response_model=PlanRecord,
            responses={204: {"description": "No plan issued yet"}, 304: {"description": "Not modified"},
                       **errors(404, 422)})
def current_plan(agent_id: AgentIdPath, repo: RepoDep,
                 since_version: Annotated[int | None, Query(ge=0, le=2**62)] = None,
                 if_none_match: Annotated[str | None, Header()] = None) -> Response:
    """The agent's newest plan with its state and ack."""
    _known(repo, agent_id)
    rec = repo.current_plan(agent_id)
    if rec is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    etag = f'"v{rec.plan.version}"'
    if _matches(if_none_match, etag) or (since_version is not None and since_version >= rec.plan.version):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers={"ETag": etag})
    return JSONResponse(rec.model_dump(mode="json"), headers={"ETag": etag})


@router.get("/{agent_id}/plans", response_model=list[PlanRecord], responses=errors(404, 422))
def plan_history(agent_id: AgentIdPath, repo: RepoDep, limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                 before_version: Annotated[int | None, Query(ge=1, le=2**62)] = None) -> list[PlanRecord]:
    """Plans issued to the agent, newest first (`before_version` pages back)."""
    _known(repo, agent_id)
    return repo.plan_history(agent_id, limit=limit, before_version=before_version)
