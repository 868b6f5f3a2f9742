"""The simulator's parts as stories: routing rows, cache policies, continuous batching with swaps, the report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tierplan.controller.costmodel import ComputeParams, CostModel, HardwareSpec
from tierplan.controller.model_shape import ModelShape
from tierplan.controller.protocol import ExpertKey, Link, Plan, Tier
from tierplan.controller.sim import SimConfig, Simulator, expert_slots_for
from tierplan.controller.sim_policy import CallablePolicy, GlobalLRU, LayerCache, PlanPolicy, make_policy
from tierplan.controller.sim_traces import (
    RoutingTrace,
    SimRequest,
    TraceError,
    load_mooncake,
    load_routing,
    synthetic_requests,
)

SHAPE = ModelShape(name="s", num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2, expert_bytes=1 << 20,
                   dense_bytes=1 << 20, kv_bytes_per_token=1024, block_tokens=4)


def _trace(num_tokens: int = 64, seed: int = 0) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(num_tokens)])
    return RoutingTrace(ids.astype(np.int64), "made in the test")  # [T, M, k]


def _cost() -> CostModel:
    return CostModel(SHAPE, HardwareSpec({lk: 1e9 for lk in Link}, 1e-5, 1 << 30), ComputeParams(dense_ms=1.0))


def test_global_lru_is_a_cyclic_scan_when_layers_outnumber_its_slots() -> None:
    lru = GlobalLRU(num_slots=2)  # two layers, two experts each, two slots: every access misses
    for _ in range(3):
        out = lru.on_step([np.array([0, 1]), np.array([2, 3])])
    assert out.hits == (0, 0) and out.misses == (2, 2)
    per_layer = LayerCache(slots_per_layer=2, num_layers=2)
    per_layer.on_step([np.array([0, 1]), np.array([2, 3])])
    assert per_layer.on_step([np.array([0, 1]), np.array([2, 3])]).hits == (2, 2)


def test_lfu_keeps_the_frequent_expert_where_lru_drops_it() -> None:
    steps = [[0, 1], [0, 2], [0, 3], [4, 5], [0, 6]]
    lfu, lru = LayerCache(3, 1, frequency=True), LayerCache(3, 1)
    got = {p.name: [p.on_step([np.array(s)]).hits[0] for s in steps] for p in (lfu, lru)}
    assert got["lfu-layer"][-1] == 1 and got["lru-layer"][-1] == 0


def test_a_pluggable_policy_sets_misses_and_prefetches() -> None:
    seen: list[int] = []

    def fn(unions: list[np.ndarray]) -> tuple[list[int], list[int]]:
        seen.append(len(unions))
        return [0] * len(unions), [len(u) for u in unions]

    pol = CallablePolicy("always-prefetch", fn)
    out = pol.on_step([np.array([1, 2]), np.array([3])])
    assert out.misses == (0, 0) and out.prefetches == (2, 1) and out.hits == (2, 1) and seen == [2]
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("belady", 4, 2)


def test_rows_follow_the_engines_forced_router() -> None:
    tr = _trace(64)
    got = tr.rows([(0, 0), (0, 5), (3, 2)])
    want = tr.ids[[0, 5, (3 * 997 + 2) % 4096 % 64]]
    assert np.array_equal(got, want)


def test_routing_npz_is_fitted_and_bad_files_are_refused(tmp_path: Path) -> None:
    ids = np.array([[[0, 8, 3]], [[-1, -1, -1]]], np.int16)  # 8 % 8 collides with 0; a row with nothing
    np.savez(tmp_path / "r.npz", expert_ids=ids, weights=np.ones(ids.shape, np.float32))
    fitted = load_routing(tmp_path / "r.npz", num_moe_layers=3, top_k=2, num_experts=8).ids  # [T, 3, 2]
    assert fitted.shape == (2, 3, 2) and fitted[0, 0].tolist() == [0, 1]
    assert all(len(set(row)) == 2 for row in fitted.reshape(-1, 2).tolist())
    np.savez(tmp_path / "bad.npz", weights=np.ones(3))
    with pytest.raises(TraceError, match="missing array 'expert_ids'"):
        load_routing(tmp_path / "bad.npz", 1, 2, 8)
    with pytest.raises(TraceError, match="no such file"):
        load_routing(tmp_path / "none.npz", 1, 2, 8)


def test_mooncake_lines_are_checked_by_field(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"timestamp": 1000, "input_length": 5, "output_length": 2}) + "\n")
    assert load_mooncake(p, time_scale=0.5) == [SimRequest(0, 0.5, 5, 2)]
    p.write_text(json.dumps({"timestamp": 0, "input_length": 0, "output_length": 2}) + "\n")
    with pytest.raises(TraceError, match="line 1 field 'input_length'"):
        load_mooncake(p)


def test_swapped_sequences_cost_kv_fetches_and_spills() -> None:
    # Three 6-token prompts growing to 12 tokens in 3 GPU blocks of 4: preemptions must happen.
    reqs = [SimRequest(i, 0.0, 6, 6) for i in range(3)]
    sim = Simulator(SHAPE, _cost(), _trace(), make_policy("lru", 16, 2), SimConfig(kv_gpu_blocks=6, max_batch=3), 16)
    report = sim.run(reqs)
    s = report.summary()
    assert s["tokens_out"] == 18 and s["requests"] == 3 and s["preemptions"] > 0
    assert sum(r.kv_spill_blocks for r in report.steps) > 0
    assert sum(r.kv_fetch_blocks for r in report.steps) == sum(r.kv_spill_blocks for r in report.steps)
    assert s["kv_stall_ms_total"] + s["both_stall_ms_total"] > 0


def test_the_step_clock_paces_arrivals_and_the_predicted_clock_follows_the_cost() -> None:
    reqs = synthetic_requests(20, rate_per_s=200.0, prompt_len=4, output_len=4, seed=1)
    slow = CostModel(SHAPE, HardwareSpec({lk: 1e9 for lk in Link}, 0.0, 1 << 30), ComputeParams(dense_ms=50.0))
    fast = CostModel(SHAPE, HardwareSpec({lk: 1e9 for lk in Link}, 0.0, 1 << 30), ComputeParams(dense_ms=0.5))
    cfg = SimConfig(kv_gpu_blocks=64, max_batch=8)
    by_cost = [Simulator(SHAPE, c, _trace(), make_policy("lru", 16, 2), cfg, 16).run(reqs).summary()
               for c in (slow, fast)]
    assert by_cost[0]["steps"] < by_cost[1]["steps"]  # slow steps gather more arrivals per batch
    paced = SimConfig(kv_gpu_blocks=64, max_batch=8, virtual_step_s=0.005)
    by_clock = [Simulator(SHAPE, c, _trace(), make_policy("lru", 16, 2), paced, 16).run(reqs).summary()
                for c in (slow, fast)]
    assert by_clock[0]["steps"] == by_clock[1]["steps"]
    assert by_clock[0]["step_ms_mean"] > 10 * by_clock[1]["step_ms_mean"]


def test_hbm_left_for_experts() -> None:
    slots = expert_slots_for(SHAPE, hbm_bytes=10 << 20, kv_gpu_blocks=4, workspace_bytes=1 << 20)
    assert slots == (10 << 20) - (1 << 20) - 4 * 4096 - (1 << 20) >> 20
    assert expert_slots_for(SHAPE, hbm_bytes=1 << 40, kv_gpu_blocks=0) == 16  # never more than all experts
    with pytest.raises(ValueError, match="holds no expert slot"):
        expert_slots_for(SHAPE, hbm_bytes=1 << 20, kv_gpu_blocks=0)


def test_a_plan_replays_with_its_per_layer_slots_and_pins() -> None:
    mb = 1 << 20
    plan = Plan(plan_id="p1", version=1, base_version=0, created_s=0.0, hbm_budget_bytes=8 * mb,
                expert_bytes_per_layer=(3 * mb, 1 * mb), kv_blocks_per_tier={Tier.GPU: 4},
                pinned_experts=(ExpertKey(layer=0, expert=7),), reason="test")
    pol = PlanPolicy(plan, SHAPE.moe_layers, mb)
    first = pol.on_step([np.array([1, 2, 7]), np.array([1])])
    assert first.hits == (1, 0) and first.misses == (2, 1)  # the pinned expert hits from the start
    again = pol.on_step([np.array([1, 2, 7]), np.array([1])])
    assert again.hits == (3, 1) and again.misses == (0, 0)
    bad = plan.model_copy(update={"pinned_experts": (ExpertKey(layer=1, expert=0),)})
    assert PlanPolicy(bad, SHAPE.moe_layers, mb).on_step([np.array([0]), np.array([0])]).hits == (0, 1)
    with pytest.raises(ValueError, match="covers 2 layers"):
        PlanPolicy(plan, (0, 5), mb)
    with pytest.raises(ValueError, match="gives layer 1 1572864 expert bytes, not a whole number of"):
        PlanPolicy(plan.model_copy(update={"expert_bytes_per_layer": (3 * mb, mb + mb // 2)}), SHAPE.moe_layers, mb)
    over = plan.model_copy(update={"pinned_experts": (ExpertKey(layer=1, expert=0), ExpertKey(layer=1, expert=1))})
    with pytest.raises(ValueError, match="pins 2 experts of layer 1, more than its 1 slots"):
        PlanPolicy(over, SHAPE.moe_layers, mb)


def test_a_decode_step_whose_union_outruns_a_layers_slots_pays_the_chunked_step() -> None:
    """Each built-in policy says when a layer's union outran the slots it may hold at once (the engine then
    runs the step chunked, off its graphs); the simulator charges `chunked_step_ms` to such decode steps only
    (a prefill runs eagerly anyway), so a cache of a few slots costs more than its misses."""
    assert GlobalLRU(2).on_step([np.array([0, 1, 2]), np.array([3])]).chunked
    assert not GlobalLRU(3).on_step([np.array([0, 1, 2]), np.array([3])]).chunked
    assert LayerCache(2, 2).on_step([np.array([0]), np.array([1, 2, 3])]).chunked
    assert not LayerCache(3, 2).on_step([np.array([0]), np.array([1, 2, 3])]).chunked
    mb = 1 << 20
    plan = Plan(plan_id="p1", version=1, base_version=0, created_s=0.0, hbm_budget_bytes=8 * mb,
                expert_bytes_per_layer=(2 * mb, 2 * mb), kv_blocks_per_tier={Tier.GPU: 4},
                pinned_experts=(ExpertKey(layer=0, expert=7),), reason="test")
    assert not PlanPolicy(plan, SHAPE.moe_layers, mb).on_step([np.array([1, 7]), np.array([1, 2])]).chunked
    assert PlanPolicy(plan, SHAPE.moe_layers, mb).on_step([np.array([1, 2, 7]), np.array([1])]).chunked

    reqs = [SimRequest(i, 0.0, 4, 8) for i in range(4)]
    cfg = SimConfig(kv_gpu_blocks=64, max_batch=4, virtual_step_s=0.01)

    def run(charge: float) -> list:
        cost = CostModel(SHAPE, HardwareSpec({lk: 1e9 for lk in Link}, 0.0, 1 << 30),
                         ComputeParams(dense_ms=1.0, chunked_step_ms=charge))
        return Simulator(SHAPE, cost, _trace(), LayerCache(1, 2), cfg, 2).run(reqs).steps  # 1 slot a layer

    plain, charged = run(0.0), run(25.0)
    extra = [c.compute_ms - p.compute_ms for p, c in zip(plain, charged, strict=True)]
    assert [e == pytest.approx(25.0) for e in extra] == [s.num_prefills == 0 for s in plain]
    assert any(s.num_prefills == 0 for s in plain) and any(s.num_prefills for s in plain)
