"""/v1/agents: register an agent (write), list agents, one agent's status (service process)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response, status

from tierplan.api.deps import READS_GUARD, HubDep, RepoDep, WriterDep
from tierplan.api.routes.common import WRITE_ERRORS, AgentIdPath, errors
from tierplan.controller.protocol_service import AgentRegistration, AgentStatus, WindowSummary

router = APIRouter(prefix="/v1/agents", tags=["agents"])
reads = APIRouter(prefix="/v1/agents", tags=["agents"], dependencies=[READS_GUARD])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=AgentStatus,
             responses={200: {"model": AgentStatus, "description": "Identical re-registration"},
                        **errors(*WRITE_ERRORS, 409)})
def register_agent(reg: AgentRegistration, hub: HubDep, _: WriterDep, response: Response) -> AgentStatus:
    """Register an agent rank (201), or re-register it unchanged (200); 409 if known with another shape."""
    agent, created = hub.register(reg)
    if not created:
        response.status_code = status.HTTP_200_OK
    return agent


@reads.get("", response_model=list[AgentStatus])
def list_agents(repo: RepoDep) -> list[AgentStatus]:
    """Every registered agent with its last-seen time, state and plan versions."""
    return repo.list_agents()


@reads.get("/{agent_id}", response_model=AgentStatus, responses=errors(404, 422))
def get_agent(agent_id: AgentIdPath, repo: RepoDep) -> AgentStatus:
    found = repo.agent_status(agent_id)
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"agent {agent_id!r} is not registered")
    return found


@reads.get("/{agent_id}/windows", response_model=list[WindowSummary], responses=errors(404, 422))
def list_windows(agent_id: AgentIdPath, repo: RepoDep,
                 limit: Annotated[int, Query(ge=1, le=1000)] = 200) -> list[WindowSummary]:
    """The agent's newest `limit` stored telemetry windows, oldest first, as summaries (hits, stalls, step times)."""
    if repo.agent_status(agent_id) is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"agent {agent_id!r} is not registered")
    return [WindowSummary.of(w) for w in repo.recent_windows(agent_id, limit)]
