"""The vLLM plugin's side of the KV retention chain, without vLLM: the connector's reuse events reach the
windows (bounded, a bad one counted rather than costing the window), and a plan's `kv_retention` becomes the
`KvLimits.retention` the connector evicts by, said in the ack."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.agent.vllm.agent_fixtures import make_agent, plan, sent_windows  # noqa: E402
from tierplan.agent.adapters.vllm.kv_limits import KvLimits  # noqa: E402
from tierplan.agent.adapters.vllm.windows import MAX_REUSE_EVENTS_PER_WINDOW, KvBook  # noqa: E402
from tierplan.controller.protocol import MAX_ITEMS, AckStatus, Telemetry, Tier, parse, to_json  # noqa: E402


def test_the_plans_retention_becomes_the_connectors_keep_first_order(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    try:
        agent.report_kv({}, {}, {})  # our connector runs in this process (it reports each step)
        ack = agent.apply(plan(kv_retention=("9f3a", "0c11", "77e0")))
        assert ack.status is AckStatus.APPLIED
        assert agent.kv_limits() == KvLimits(plan_version=1, cpu_blocks=32, nvme_blocks=256,
                                             retention=("9f3a", "0c11", "77e0"))
        assert "KV retention applied: the connector keeps 3 prefixes first" in ack.reason
        assert agent.counts["plan_kv_retention_applied"] == 1
    finally:
        agent.close()


def test_reuse_events_reach_the_window_in_order_and_bad_ones_are_counted(tmp_path: Path) -> None:
    agent = make_agent(tmp_path)
    sent = sent_windows(agent)
    try:
        agent.report_reuse([("9f3a", 1.5, "cpu"), ("0c11", 0.25, "nvme")])
        agent.report_reuse([("has space", 1.0, "cpu"), ("77e0", -1.0, "cpu"), ("77e0", 1.0, "disk"), ("x",)])
        agent.report_reuse([("9f3a", 0.5, "cpu")])
        agent.windows.close()
        agent.windows.outbox.join()
        agent.report_reuse([("0c11", 2.0, "cpu")])
        agent.windows.close()
        agent.windows.outbox.join()
    finally:
        agent.close()
    first, second = sent
    assert parse(Telemetry, to_json(first)) == first
    events = [(e.prefix_hash, e.age_s, e.tier) for e in first.kv.reuse_events]
    assert events == [("9f3a", 1.5, Tier.CPU), ("0c11", 0.25, Tier.NVME), ("9f3a", 0.5, Tier.CPU)]
    assert first.fallbacks["reuse_events_bad"] == 4
    assert [e.prefix_hash for e in second.kv.reuse_events] == ["0c11"]  # a window carries only its own


def test_a_window_keeps_at_most_its_bound_and_counts_the_rest() -> None:
    book = KvBook()
    assert book.max_reuse_events == MAX_REUSE_EVENTS_PER_WINDOW <= MAX_ITEMS  # a window the service accepts
    book.add_reuse([(f"h{i}", 1.0, "cpu") for i in range(MAX_REUSE_EVENTS_PER_WINDOW - 1)])
    book.add_reuse([("a", 1.0, "cpu"), ("b", 1.0, "cpu"), ("c", 1.0, "cpu")])
    events = book.take_reuse()
    assert len(events) == MAX_REUSE_EVENTS_PER_WINDOW and events[-1][0] == "a" and book.reuse_events_over_cap == 2
    assert book.take_reuse() == ()
    with pytest.raises(ValueError, match=r"max_reuse_events must be in 0\.\.65536, got 65537"):
        KvBook(MAX_ITEMS + 1)
