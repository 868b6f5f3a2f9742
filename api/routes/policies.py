"""/v1/policies: the tuning knobs per agent group, versioned, each change recorded with who and why.

Service process. A PUT is checked against every agent of the group (a knob an agent cannot run with is
refused, 422, naming it) and against `expected_version` (409); the group's controllers are rebuilt with the
new knobs on the planner's next pass. The author is the token's name.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from tierplan.api.deps import READS_GUARD, HubDep, RepoDep, WriterDep
from tierplan.api.routes.common import WRITE_ERRORS, GroupPath, errors
from tierplan.controller.protocol_service import PolicyRecord, PolicyUpdate

router = APIRouter(prefix="/v1/policies", tags=["policies"])
reads = APIRouter(prefix="/v1/policies", tags=["policies"], dependencies=[READS_GUARD])


@reads.get("", response_model=list[PolicyRecord])
def list_policies(repo: RepoDep) -> list[PolicyRecord]:
    """The current policy of every known group (groups with agents or a stored policy, and "default")."""
    found = {p.group: p for p in repo.list_policies()}
    found.setdefault("default", repo.get_policy("default"))
    return [found[g] for g in sorted(found)]


@reads.get("/{group}", response_model=PolicyRecord, responses=errors(422))
def get_policy(group: GroupPath, repo: RepoDep) -> PolicyRecord:
    """The group's current knobs (version 0: the built-in defaults, never changed)."""
    return repo.get_policy(group)


@router.put("/{group}", response_model=PolicyRecord, responses=errors(*WRITE_ERRORS, 409))
def put_policy(group: GroupPath, update: PolicyUpdate, hub: HubDep, who: WriterDep) -> PolicyRecord:
    """Replace the group's knobs; 409 unless the group is at `expected_version` (when given)."""
    return hub.put_policy(group, update, who.name)


@reads.get("/{group}/history", response_model=list[PolicyRecord], responses=errors(422))
def policy_history(group: GroupPath, repo: RepoDep,
                   limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> list[PolicyRecord]:
    """Every version of the group's knobs, newest first."""
    return repo.policy_history(group, limit=limit)
