"""The vLLM plugin's side of the KV retention chain, without vLLM: the connector's reuse events reach the
windows (bounded, a bad one counted rather than costing the window), and a plan's `kv_retention` becomes the
`KvLimits.retention` the connector evicts by, said in the ack."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from tierplan.agent.adapters.vllm.capture import InPlaceRouterTap, ModelShape, RouterCapture  # noqa: E402
from tierplan.agent.adapters.vllm.kv_limits import KvLimits  # noqa: E402
from tierplan.agent.adapters.vllm.link import VllmAgent  # noqa: E402
from tierplan.agent.adapters.vllm.settings import VllmPluginSettings  # noqa: E402
from tierplan.agent.adapters.vllm.windows import MAX_REUSE_EVENTS_PER_WINDOW, KvBook  # noqa: E402
from tierplan.controller.protocol import MAX_ITEMS, AckStatus, Plan, Telemetry, Tier, parse, to_json  # noqa: E402

SHAPE = ModelShape(num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2, expert_bytes=1024, dense_bytes=4096)


def make_agent(tmp_path: Path) -> tuple[VllmAgent, list[Telemetry]]:
    mc = SimpleNamespace(model="/models/tiny", dtype=torch.float32, get_num_kv_heads=lambda pc: 2,
                         get_head_size=lambda: 32, get_num_layers=lambda pc: 2)
    cfg = SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(rank=0),
                          cache_config=SimpleNamespace(block_size=32, num_gpu_blocks=100),
                          device_config=SimpleNamespace(device_type="cpu"))
    tap = InPlaceRouterTap(SHAPE.moe_layers, SHAPE.num_experts, SHAPE.top_k, torch.device("cpu"))
    s = VllmPluginSettings(socket=str(tmp_path / "nobody.sock"), window_steps=2, kv_cpu_blocks=64,
                           kv_nvme_blocks=256)
    agent = VllmAgent(RouterCapture(tap, SHAPE, 64, torch.device("cpu")), cfg, s)
    sent: list[Telemetry] = []
    agent.windows.outbox.sink = sent.append  # the windows as the link would get them (no sidecar here)
    return agent, sent


def plan(kv_retention: tuple[str, ...]) -> Plan:
    return Plan(plan_id="p1", version=1, base_version=0, created_s=0.0, hbm_budget_bytes=1 << 30,
                expert_bytes_per_layer=(4096, 4096), kv_blocks_per_tier={Tier.CPU: 32}, reason="test",
                kv_retention=kv_retention)


def test_the_plans_retention_becomes_the_connectors_keep_first_order(tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    try:
        agent.report_kv({}, {}, {})  # our connector runs in this process (it reports each step)
        ack = agent.apply(plan(("9f3a", "0c11", "77e0")))
        assert ack.status is AckStatus.APPLIED
        assert agent.kv_limits() == KvLimits(plan_version=1, cpu_blocks=32, nvme_blocks=256,
                                             retention=("9f3a", "0c11", "77e0"))
        assert "KV retention applied: the connector keeps 3 prefixes first" in ack.reason
        assert agent.counts["plan_kv_retention_applied"] == 1
    finally:
        agent.close()


def test_reuse_events_reach_the_window_in_order_and_bad_ones_are_counted(tmp_path: Path) -> None:
    agent, sent = make_agent(tmp_path)
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
