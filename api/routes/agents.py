"""/v1/agents: register an agent (write), list agents, one agent's status (service process)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Response, status

from api.deps import READS_GUARD, HubDep, RepoDep, WriterDep
from api.routes.common import WRITE_ERRORS, AgentIdPath, errors
from controller.protocol_service import AgentRegistration, AgentStatus

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
