"""Repository, plans and decisions: versions advance one at a time (anything else is a PlanConflict naming the
stored version), an unacked plan is superseded by the next, one ack per plan, decisions filtered newest first
with the measured outcome filled in later."""

from __future__ import annotations

import pytest

from tests.api.db.builders import ack, decision, plan, registration
from tests.conftest import FakeClock
from tierplan.api.db.errors import Conflict, InvalidQuery, NotFound, PlanConflict
from tierplan.api.db.repo import Repository
from tierplan.controller.protocol import AckStatus
from tierplan.controller.protocol_service import DecisionOutcome, PlanState


@pytest.fixture
def agent(repo: Repository) -> str:
    repo.register_agent(registration())
    return "agent-0"


def test_versions_advance_one_at_a_time(repo: Repository, agent: str, clock: FakeClock) -> None:
    assert repo.newest_version(agent) == 0 and repo.current_plan(agent) is None
    repo.insert_plan(agent, plan(1))
    clock.now_s = 1001.0
    repo.insert_plan(agent, plan(2))
    assert repo.newest_version(agent) == 2
    current = repo.current_plan(agent)
    assert current is not None and current.plan == plan(2) and current.issued_s == 1001.0
    assert current.state is PlanState.ISSUED and current.ack is None
    assert repo.agent_status(agent).issued_version == 2  # type: ignore[union-attr]


@pytest.mark.parametrize("version", [1, 2, 4])
def test_any_version_but_the_next_is_a_conflict_naming_the_stored_one(repo: Repository, agent: str,
                                                                     version: int) -> None:
    repo.insert_plan(agent, plan(1))
    repo.insert_plan(agent, plan(2))
    with pytest.raises(PlanConflict, match="newest stored version is 2, expected version 3") as err:
        repo.insert_plan(agent, plan(version, reason="late"))
    assert err.value.current_version == 2 and err.value.attempted_version == version
    assert [r.plan.reason for r in repo.plan_history(agent)] == ["test plan", "test plan"]  # nothing stored


def test_a_plan_for_an_unregistered_agent_is_not_found(repo: Repository) -> None:
    with pytest.raises(NotFound, match="'ghost' is not registered"):
        repo.insert_plan("ghost", plan(1))
    assert repo.newest_version("ghost") == 0


def test_unacked_plan_is_superseded_acked_one_keeps_its_state(repo: Repository, agent: str) -> None:
    repo.insert_plan(agent, plan(1))
    repo.record_ack(ack(plan(1)))
    repo.insert_plan(agent, plan(2))
    repo.insert_plan(agent, plan(3))
    states = [(r.plan.version, r.state) for r in repo.plan_history(agent)]
    assert states == [(3, PlanState.ISSUED), (2, PlanState.SUPERSEDED), (1, PlanState.APPLIED)]


def test_history_pages_newest_first(repo: Repository, agent: str) -> None:
    for v in range(1, 8):
        repo.insert_plan(agent, plan(v))
    assert [r.plan.version for r in repo.plan_history(agent, limit=3)] == [7, 6, 5]
    assert [r.plan.version for r in repo.plan_history(agent, limit=3, before_version=5)] == [4, 3, 2]
    assert [r.plan.version for r in repo.plan_history(agent, before_version=2)] == [1]
    assert repo.plan_history("ghost") == []
    with pytest.raises(InvalidQuery):
        repo.plan_history(agent, limit=0)


def test_ack_applies_once(repo: Repository, agent: str, clock: FakeClock) -> None:
    repo.insert_plan(agent, plan(1))
    rec = repo.record_ack(ack(plan(1)))
    assert rec.state is PlanState.APPLIED and rec.ack == ack(plan(1)) and rec.plan == plan(1)
    assert repo.current_plan(agent) == rec
    assert repo.agent_status(agent).applied_version == 1  # type: ignore[union-attr]
    with pytest.raises(Conflict, match="acked already"):
        repo.record_ack(ack(plan(1), status=AckStatus.REJECTED))
    assert repo.current_plan(agent) == rec  # the second ack changed nothing


def test_rejected_ack_keeps_the_applied_version(repo: Repository, agent: str) -> None:
    repo.insert_plan(agent, plan(1))
    repo.record_ack(ack(plan(1)))
    repo.insert_plan(agent, plan(2))
    rec = repo.record_ack(ack(plan(2), status=AckStatus.REJECTED))
    assert rec.state is PlanState.REJECTED and rec.ack is not None and rec.ack.reason == "test refusal"
    assert repo.agent_status(agent).applied_version == 1  # type: ignore[union-attr]


def test_a_late_ack_does_not_move_the_applied_version_back(repo: Repository, agent: str) -> None:
    repo.insert_plan(agent, plan(1))
    repo.insert_plan(agent, plan(2))
    repo.record_ack(ack(plan(2)))
    repo.record_ack(ack(plan(1)))  # the agent had applied 1 before 2 reached it
    assert repo.agent_status(agent).applied_version == 2  # type: ignore[union-attr]


def test_ack_for_an_unknown_plan(repo: Repository, agent: str) -> None:
    with pytest.raises(NotFound, match="has no plan version 1"):
        repo.record_ack(ack(plan(1)))
    repo.insert_plan(agent, plan(1))
    wrong = ack(plan(1)).model_copy(update={"plan_id": "p-other"})
    with pytest.raises(Conflict, match="plan_id 'p-other' is not plan version 1"):
        repo.record_ack(wrong)


def test_decisions_newest_first_filtered_and_measured_later(repo: Repository, agent: str) -> None:
    repo.register_agent(registration("agent-1"))
    stored = [repo.add_decision(decision(v, created_s=10.0 * v)) for v in (1, 2, 3)]
    other = repo.add_decision(decision(1, created_s=25.0, agent_id="agent-1", outcome=DecisionOutcome.HELD))
    assert len({d.id for d in [*stored, other]}) == 4 and all(d.id > 0 for d in stored)
    assert repo.decisions() == [stored[2], other, stored[1], stored[0]]
    assert repo.decisions(agent_id=agent) == stored[::-1]
    assert repo.decisions(since_s=20.0, until_s=25.0) == [other, stored[1]]
    assert repo.decisions(limit=1) == [stored[2]]
    assert repo.set_measured(agent, 2, 4.25) == 1
    got = repo.decisions(agent_id=agent, since_s=20.0, until_s=20.0)
    assert [(d.version, d.measured_step_ms) for d in got] == [(2, 4.25)]
    assert repo.set_measured(agent, 9, 1.0) == 0
    with pytest.raises(InvalidQuery, match="finite number"):
        repo.set_measured(agent, 2, float("nan"))
    with pytest.raises(NotFound):
        repo.add_decision(decision(1, created_s=1.0, agent_id="ghost"))
