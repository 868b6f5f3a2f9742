"""The rank's agent without vLLM: the plan's KV part binds only where our connector runs in the process (said
in the ack otherwise), the connector's failures reach the windows' fallbacks, two agents of one process leave
each other's connector slot alone, and what is left at exit is sent instead of lost."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.agent.vllm.agent_fixtures import make_agent, plan, sent_windows
from tierplan.agent.adapters.vllm.kv_limits import current_source
from tierplan.controller.protocol import AckStatus


def test_without_our_connector_in_the_process_the_kv_part_is_advisory_and_said(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    try:
        ack = agent.apply(plan(kv_retention=("9f3a",)))
        assert ack.status is AckStatus.APPLIED  # the plan is taken (versions move on) ...
        assert "KV part advisory: tierplan's connector has not read the limits in this process" in ack.reason
        assert "KV retention applied" not in ack.reason  # ... but nothing claims the KV part binds
        assert agent._fallbacks()["plan_kv_advisory"] == 1
        assert agent.kv_limits() is not None  # a connector that starts later still gets the plan's limits
        second = agent.apply(plan(2, 1, kv_retention=("9f3a",)))
        assert "KV part advisory" not in second.reason and "KV retention applied" in second.reason
    finally:
        agent.close()


def test_the_connectors_failures_are_fallbacks_of_the_next_window(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    sent = sent_windows(agent)
    try:
        agent.report_failures({"failed_loads": 2, "corrupt_loads": 1, "failed_stores": 0})
        agent.report_failures({"failed_loads": 1})
        for _ in range(2):
            agent.on_step(0.001, False)
        agent.windows.flush()
        assert sent and sent[-1].fallbacks["kv_connector_failed_loads"] == 3
        assert sent[-1].fallbacks["kv_connector_corrupt_loads"] == 1
        assert "kv_connector_failed_stores" not in sent[-1].fallbacks  # zero counts are not invented
    finally:
        agent.close()


def test_an_agent_closing_leaves_another_agents_connector_slot_alone(tmp_path: Path) -> None:
    a = make_agent(tmp_path / "a")
    b = make_agent(tmp_path / "b")
    try:
        assert current_source() is b
        a.close()
        assert current_source() is b
    finally:
        a.close()
        b.close()
    assert current_source() is None


def test_at_exit_the_partial_window_is_sent_and_a_closed_agent_is_left_alone(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    sent = sent_windows(agent)
    agent.on_step(0.001, False)  # one step of a two-step window
    agent.shutdown(timeout_s=0.5)
    assert len(sent) == 1 and agent.closed
    agent.shutdown(timeout_s=0.5)  # the atexit hook after a test's close: nothing happens, nothing hangs
    assert len(sent) == 1


def test_connector_report_entries_under_unknown_tier_names_are_counted(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    sent = sent_windows(agent)
    try:
        agent.report_kv({"cpu": 1, "ssd": 2}, {}, {"gpu": 3})
        for _ in range(2):
            agent.on_step(0.001, False)
        agent.windows.flush()
        assert sent[-1].fallbacks["kv_entries_unknown_tier"] == 1
    finally:
        agent.close()


def test_a_link_that_cannot_open_is_counted_logged_once_and_retried_with_back_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    agent = make_agent(tmp_path)
    sent = sent_windows(agent)
    now = [100.0]
    attempts = []

    def refuse(path: str, registration: object) -> None:
        attempts.append(now[0])
        raise OSError("no sidecar here")

    agent._make_link, agent.clock = refuse, lambda: now[0]  # type: ignore[assignment]
    try:
        with caplog.at_level("WARNING", logger="vllm.tierplan"):
            for _ in range(6):  # six steps within the first back-off: one attempt
                agent.on_step(0.001, False)
            now[0] += 1.5  # past the first back-off (1 s)
            for _ in range(2):
                agent.on_step(0.001, False)
        agent.windows.flush()
        assert attempts == [100.0, 101.5]
        assert sum("cannot open the link" in r.getMessage() for r in caplog.records) == 1
        assert len(sent) == 4  # the windows went on closing while the link was refused (two steps each)
        assert sent[-1].fallbacks["link_open_failures"] == 2 and agent.counts["agent_errors"] == 0
    finally:
        agent.close()


def test_each_data_parallel_engine_is_its_own_agent_through_the_one_sidecar() -> None:
    from tierplan.agent.adapters.vllm.settings import SettingsError, VllmPluginSettings

    s = VllmPluginSettings(agent_id="vllm-a")
    assert s.for_engine(0, 1, "/run/tierplan/vllm-a.sock") is s  # one engine: nothing changes
    engines = [s.for_engine(r, 2, "/run/tierplan/vllm-a.sock") for r in range(2)]
    assert [e.agent_id for e in engines] == ["vllm-a-dp0", "vllm-a-dp1"]  # windows never share a sequence
    assert {e.socket_path("unused") for e in engines} == {"/run/tierplan/vllm-a.sock"}  # the sidecar of vllm-a
    stats = [e.stats_socket_path(e.socket_path("unused")) for e in engines]
    assert stats == ["/run/tierplan/vllm-a.sock.stats.dp0", "/run/tierplan/vllm-a.sock.stats.dp1"]
    with pytest.raises(SettingsError, match=r"TIERPLAN_VLLM_AGENT_ID=.*with data parallel engine 1"):
        VllmPluginSettings(agent_id="a" * 127).for_engine(1, 2, "/tmp/x.sock")
