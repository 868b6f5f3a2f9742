"""Repository, agents and telemetry: registration (identical again is fine, a different shape is refused),
status from the clock, bulk window ingest that is all or nothing, recent windows, retention."""

from __future__ import annotations

import pytest

from tests.api.db.builders import registration, windows
from tests.conftest import FakeClock
from tierplan.api.db.errors import Conflict, InvalidQuery, NotFound
from tierplan.api.db.repo import Repository
from tierplan.controller.protocol_service import AgentState


def test_register_once_then_identical_again_returns_the_first(repo: Repository, clock: FakeClock) -> None:
    first, created = repo.register_agent(registration(registered_s=1.0))
    assert created and first.registered_s == 1.0
    again, created = repo.register_agent(registration(registered_s=50.0))  # a sidecar restart re-registers
    assert not created and again == first
    assert repo.get_registration("agent-0") == first
    assert repo.get_registration("nobody") is None


def test_a_different_shape_is_refused_by_field(repo: Repository) -> None:
    repo.register_agent(registration())
    with pytest.raises(Conflict, match=r"different shape: split\.hbm_budget_bytes differ"):
        repo.register_agent(registration(hbm_budget_bytes=32 * 4096))
    with pytest.raises(Conflict, match="group"):
        repo.register_agent(registration(group="other"))
    # the compute prior too: a sidecar that now knows its chunked step is told, not handed the old prior back
    from tierplan.controller.protocol_service import ComputeSheet

    with pytest.raises(Conflict, match=r"different shape: compute differ"):
        repo.register_agent(registration().model_copy(update={"compute": ComputeSheet(chunked_step_ms=12.0)}))
    assert repo.get_registration("agent-0") == registration()  # nothing changed
    repo.register_agent(registration("agent-1").model_copy(update={"compute": ComputeSheet(step_ms=1.0)}))
    with pytest.raises(Conflict, match=r"compute\.chunked_step_ms differ"):
        repo.register_agent(registration("agent-1").model_copy(update={"compute": ComputeSheet(
            step_ms=1.0, chunked_step_ms=12.0)}))


def test_status_goes_new_active_stale(repo: Repository, clock: FakeClock) -> None:
    repo.register_agent(registration())
    status = repo.agent_status("agent-0")
    assert status is not None and status.state is AgentState.NEW and status.last_seen_s is None
    assert (status.windows, status.issued_version, status.applied_version) == (0, 0, 0)
    repo.add_windows(windows(3))
    status = repo.agent_status("agent-0")
    assert status is not None and status.state is AgentState.ACTIVE
    assert (status.windows, status.last_seen_s, status.model) == (3, 1000.0, "tiny")
    clock.now_s += 61.0
    assert repo.agent_status("agent-0").state is AgentState.STALE  # type: ignore[union-attr]
    assert repo.agent_status("nobody") is None


def test_list_agents_by_id(repo: Repository) -> None:
    for name in ("b", "a", "c"):
        repo.register_agent(registration(agent_id=name))
    assert [s.agent_id for s in repo.list_agents()] == ["a", "b", "c"]


def test_windows_round_trip_oldest_first(repo: Repository) -> None:
    repo.register_agent(registration())
    sent = windows(10)
    repo.add_windows(sent[:6])
    repo.add_windows(sent[6:])
    assert repo.recent_windows("agent-0", 4) == sent[6:]
    assert repo.recent_windows("agent-0", 100) == sent
    assert repo.recent_windows("nobody", 5) == []


def test_a_batch_is_stored_whole_or_not_at_all(repo: Repository) -> None:
    repo.register_agent(repo_reg := registration())
    assert repo_reg.agent_id == "agent-0"
    sent = windows(5)
    repo.add_windows(sent[:3])
    with pytest.raises(Conflict, match=r"windows\.1: agent 'agent-0' rank 0 window_seq 2 is stored already"):
        repo.add_windows(sent[3:4] + sent[2:3] + sent[4:5])
    assert repo.recent_windows("agent-0", 10) == sent[:3]  # the batch's new windows were not stored either
    assert repo.agent_status("agent-0").windows == 3  # type: ignore[union-attr]
    with pytest.raises(Conflict, match=r"windows\.1: .* repeats windows\.0 of the same batch"):
        repo.add_windows([sent[3], sent[3]])


def test_unregistered_agent_is_refused_and_nothing_is_stored(repo: Repository) -> None:
    repo.register_agent(registration())
    batch = windows(2) + windows(1, agent_id="ghost")
    with pytest.raises(NotFound, match=r"windows\.2: agent 'ghost' is not registered"):
        repo.add_windows(batch)
    assert repo.recent_windows("agent-0", 10) == []


def test_a_batch_of_two_agents_counts_each(repo: Repository) -> None:
    repo.register_agent(registration("a"))
    repo.register_agent(registration("b"))
    repo.add_windows(windows(3, agent_id="a") + windows(2, agent_id="b"))
    assert [(s.agent_id, s.windows) for s in repo.list_agents()] == [("a", 3), ("b", 2)]
    repo.add_windows([])  # nothing to do, no error


def test_retention_prunes_by_receive_time(repo: Repository, clock: FakeClock) -> None:
    repo.register_agent(registration())
    sent = windows(6)
    repo.add_windows(sent[:4])  # received at 1000
    clock.now_s = 2000.0
    repo.add_windows(sent[4:])  # received at 2000
    assert repo.prune_windows(older_than_s=1000.0) == 0  # strictly older only
    assert repo.prune_windows(older_than_s=1500.0) == 4
    assert repo.recent_windows("agent-0", 10) == sent[4:]
    assert repo.prune_windows(older_than_s=1500.0) == 0
    assert repo.agent_status("agent-0").windows == 6  # type: ignore[union-attr]  # accepted, not kept


@pytest.mark.parametrize("limit", [0, -1, 10_001, True])
def test_limits_out_of_range_are_refused(repo: Repository, limit: int) -> None:
    with pytest.raises(InvalidQuery, match="expected an integer from 1 to 10000"):
        repo.recent_windows("agent-0", limit)


def test_ping(repo: Repository) -> None:
    repo.ping()
