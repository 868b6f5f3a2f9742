"""Each baseline's own rule, checked where it decides: LFRU's frequency-weighted recency, Belady's farthest next
use, FluxMoE's rho rule with its dead zone, WiSP's equal marginal benefit per byte, kv_tiering's static pins
and KV tiers, and the interface's guards (budget, recorded future)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.bench import baseline_point as bp
from tierplan.bench.baselines import make, oracle_splits
from tierplan.bench.baselines.base import (
    ExpertFuture,
    Split,
    fits,
    kv_demand_blocks,
    kv_floor_blocks,
    make_plan,
)
from tierplan.bench.baselines.kv_tiering import static_pins, union_first_slots, union_room
from tierplan.bench.baselines.lfru import LFRUOrder
from tierplan.bench.baselines.oracle import BeladyOrder
from tierplan.controller.optimizer.problem import Group, GroupKind, SplitProblem
from tierplan.controller.protocol import Tier
from tierplan.runtime.kv import Tier as KVTier


# ---- static_lfru -----------------------------------------------------------------------------------------
def test_lfru_evicts_by_frequency_weighted_recency_not_by_recency() -> None:
    order = LFRUOrder()
    hot, fresh, cold = (0, 1), (0, 2), (0, 3)
    for _ in range(5):
        order.observe((frozenset({1}), frozenset()))  # `hot`: five uses, ...
    for _ in range(3):
        order.observe((frozenset({3}), frozenset()))  # ... `cold` three uses, `hot` now 3 steps old
    order.observe((frozenset({2}), frozenset()))  # `fresh`: one use, just now
    # score = uses / (1 + age): hot 5/5 = 1.0, cold 3/2 = 1.5, fresh 1/1 = 1.0, never used 0.
    assert order.score(hot) == pytest.approx(1.0) and order.score(cold) == pytest.approx(1.5)
    lru_first = [hot, (0, 4), fresh, cold]  # candidates arrive least recently used first
    ranked = order(lru_first)
    assert ranked[0] == (0, 4)  # never used: first out
    assert ranked[-1] == cold  # plain LRU would keep `fresh` last; LFRU keeps the frequent-and-recent one
    assert ranked.index(hot) < ranked.index(fresh)  # equal scores: least recently used first (stable)


# ---- oracle ----------------------------------------------------------------------------------------------
def test_belady_evicts_the_farthest_next_use_first_and_the_soonest_last() -> None:
    steps = tuple((frozenset(s), frozenset()) for s in ({0, 1}, {2}, {1}, {0}))
    order = BeladyOrder(ExpertFuture(steps, kv_gpu_blocks=4))
    order.observe(steps[0])
    order.observe(steps[1])  # step 1 runs now
    assert order([(0, 0), (0, 1), (0, 3)]) == [(0, 3), (0, 0), (0, 1)]  # never again, step 3, step 2
    assert order.diverged_steps == 0
    order.observe((frozenset({5}), frozenset()))  # the run left its record: said, never hidden
    assert order.diverged_steps == 1


def test_belady_never_ranks_the_soonest_used_expert_before_another() -> None:
    rng = np.random.default_rng(7)
    steps = tuple((frozenset(rng.choice(8, 2, replace=False).tolist()),) for _ in range(40))
    fut = ExpertFuture(steps, kv_gpu_blocks=1)
    order = BeladyOrder(fut)
    for t in range(30):
        order.observe(steps[t])
        cands = [(0, int(e)) for e in rng.permutation(8)[:5]]
        ranked = order(cands)
        uses = [fut.next_use(0, e, t) for _, e in ranked]
        assert uses == sorted(uses, reverse=True), (t, ranked, uses)  # farthest first, soonest last


def test_the_oracle_refuses_a_future_recorded_under_another_kv_split(tmp_path: Path) -> None:
    eng, ctx = bp.context(tmp_path)
    try:
        split = oracle_splits(ctx)[0]
        with pytest.raises(ValueError, match="recorded under 3 GPU KV blocks"):
            make("oracle").start(eng, dataclasses.replace(ctx, split=split, future=ExpertFuture((), 3)))
        with pytest.raises(ValueError, match=r"ctx\.future is None"):
            make("oracle").start(eng, ctx)
    finally:
        eng.close()


def test_oracle_splits_are_distinct_fit_the_budget_and_span_kv_demand_to_most_experts(tmp_path: Path) -> None:
    eng, ctx = bp.context(tmp_path)
    eng.close()
    splits = oracle_splits(ctx)
    assert 1 < len(splits) <= 5 and len(set(splits)) == len(splits)
    assert all(fits(ctx, s) for s in splits)
    assert splits[0].expert_slots < splits[-1].expert_slots


# ---- fluxmoe ---------------------------------------------------------------------------------------------
LINK_BYTES_PER_MS = 2e6  # the tiny point's nominal 2 GB/s
SLOT_LINK_BYTES = 200_000  # each absent slot streams 0.1 ms a step


def _rho_problem() -> SplitProblem:
    experts = [Group.from_arrays(f"layer{m}", np.arange(9), 10.0 - np.arange(9),
                                 (8 - np.arange(9)) * SLOT_LINK_BYTES) for m in range(2)]
    kv = Group.from_arrays("kv", np.arange(17), 20.0 - np.arange(17), kind=GroupKind.KV)
    return SplitProblem((*experts, kv), capacity_units=16, unit_bytes=1)


def _in_process(name: str) -> Any:
    """A live baseline whose controller is built in this process (its allocator is called directly here)."""
    b = make(name)
    b.planner = "thread"  # type: ignore[attr-defined]
    return b


@pytest.fixture
def flux_controller(tmp_path: Path) -> object:
    eng, ctx = bp.context(tmp_path)
    try:
        run = _in_process("fluxmoe").start(eng, ctx)
        return run.source.source
    finally:
        eng.close()


@pytest.mark.parametrize(("compute_ms", "expert_units", "why"), [
    (0.75, 8, "half split: rho = 0.75 / 0.8 = 0.94, inside the dead zone: held"),
    (0.4, 12, "rho 0.5 < 0.9: KV -> experts until rho = 0.4 / 0.4 = 1.0"),
    (2.0, 0, "rho 2.5 > 1.0: experts -> KV while it stays above the zone"),
])
def test_fluxmoe_rho_rule_with_dead_zone(flux_controller: object, compute_ms: float, expert_units: int,
                                          why: str) -> None:
    problem = _rho_problem()
    sol = flux_controller._solve(SimpleNamespace(problem=problem, step_ms=compute_ms))  # type: ignore[attr-defined]
    assert sol.solver == "fluxmoe"
    units = sum(int(problem.groups[g].arrays.units[sol.choice[g]]) for g in range(2))
    assert units == expert_units, why
    assert problem.groups[0].arrays.units[sol.choice[0]] == problem.groups[1].arrays.units[sol.choice[1]]  # even


def _kv_demand_problem(capacity_units: int, kv_demand_units: int = 4) -> SplitProblem:
    """Two layers of 8 slots (each absent slot streams); KV's cost falls until its demand, then is flat."""
    experts = [Group.from_arrays(f"layer{m}", np.arange(9), 10.0 - np.arange(9),
                                 (8 - np.arange(9)) * SLOT_LINK_BYTES) for m in range(2)]
    units = np.arange(17)
    kv = Group.from_arrays("kv", units, 5.0 * np.maximum(0, kv_demand_units - units), kind=GroupKind.KV)
    return SplitProblem((*experts, kv), capacity_units=capacity_units, unit_bytes=1)


@pytest.mark.parametrize(("capacity", "compute_ms", "experts", "kv", "why"), [
    (24, 1e3, 16, 8, "everything fits, rho >> 1: every expert stays, KV takes the rest (nothing unused)"),
    (14, 1e3, 10, 4, "rho >> 1 and KV at its demand: experts keep what KV cannot use"),
    (14, 1e-3, 14, 0, "rho << 0.9: loads exposed, experts take KV down to its least"),
    (14, 0.75, 14 - 4, 4, "the start (KV at demand, experts the rest) has rho = 0.75/0.6 > 1: held at KV's cap"),
])
def test_fluxmoe_is_kv_first_and_never_gives_kv_memory_it_cannot_use(
        flux_controller: object, capacity: int, compute_ms: float, experts: int, kv: int, why: str) -> None:
    problem = _kv_demand_problem(capacity)
    sol = flux_controller._solve(SimpleNamespace(problem=problem, step_ms=compute_ms))  # type: ignore[attr-defined]
    units = [int(problem.groups[g].arrays.units[sol.choice[g]]) for g in range(3)]
    assert (units[0] + units[1], units[2]) == (experts, kv), why
    assert sol.units_used == capacity, why  # no budget left unused


def test_fluxmoe_streams_with_the_two_layer_window(tmp_path: Path) -> None:
    flux = _in_process("fluxmoe")
    eng, ctx = bp.context(tmp_path)
    try:
        assert flux.engine_options(ctx) == {"expert_lookahead_layers": 2}
        assert "no expert compression" in flux.start(eng, ctx).notes
    finally:
        eng.close()


@pytest.mark.parametrize("name", ["mv_wsa", "fluxmoe", "tierplan_kf"])
def test_live_baselines_start_kv_first(tmp_path: Path, name: str) -> None:
    """mv_wsa, fluxmoe (and tierplan's KV-first variant) start from one split whatever the batch, so only their
    allocators differ: the batch's whole KV demand, experts the rest (at batch 4, where tierplan starts
    resident)."""
    eng, ctx = bp.context(tmp_path)
    try:
        run = _in_process(name).start(eng, ctx)
    finally:
        eng.close()
    demand = kv_demand_blocks(ctx)
    assert demand < 32 and run.split.kv_gpu_blocks >= demand
    assert run.split.expert_slots == (ctx.hbm_budget_bytes - demand * ctx.kv_block_bytes) // ctx.expert_stride_bytes
    assert run.split.expert_slots < ctx.num_moe * ctx.num_experts  # the resident split would hold every expert
    assert f"KV first ({run.split.kv_gpu_blocks} GPU blocks" in run.initial_plan.reason


def test_tierplan_starts_kv_first_only_where_its_share_runs_twice_experts_over_top_k_sequences(
        tmp_path: Path) -> None:
    """tierplan's start: the resident split at batch 4 (KV first would run 4 sequences, under 2 x 8 / 2 = 8 of
    the tiny model), KV first at batch 12 (all 12 requests fit the GPU tier: 12 >= 8), whose reasons say why."""
    from tierplan.bench.baselines.base import kv_first_split
    from tierplan.bench.baselines.static import resident_split
    from tierplan.bench.baselines.tierplan_live import sequences_run

    runs = {}
    for batch in (4, 12):
        eng, ctx = bp.context(tmp_path / str(batch), batch=batch)
        try:
            assert 2 * ctx.num_experts / ctx.top_k == 8
            runs[batch] = (_in_process("tierplan").start(eng, ctx), resident_split(ctx, eng),
                           kv_first_split(ctx, eng), sequences_run(ctx, kv_first_split(ctx, eng).kv_gpu_blocks))
        finally:
            eng.close()
    small, resident, kv_first, held = runs[4]
    assert held == 4 and small.split == resident != kv_first
    assert "resident start (" in small.initial_plan.reason and "would run ~4 sequences at once, < 8" in \
        small.initial_plan.reason
    large, resident, kv_first, held = runs[12]
    assert held >= 8 and large.split == kv_first != resident
    assert f"KV first ({kv_first.kv_gpu_blocks} GPU blocks for the batch, ~{held} sequences at once, >= 8" in \
        large.initial_plan.reason


@pytest.mark.parametrize(("kf_slots", "kf_held", "rs_slots", "rs_held", "kv_first"), [
    (611, 8, 623, 2, True),  # b8 1K 40 GiB (H100 run 62): 12 of 623 slots for all 8 sequences, 76 a layer
    (885, 8, 897, 2, True),  # b8 1K 56 GiB: 12 of 897
    (549, 8, 595, 2, True),  # b8 4K 40 GiB (H100 run 69): 46 of 595 (7.7 %), 68 a layer
    (822, 8, 868, 2, True),  # b8 4K 56 GiB (run 70): 46 of 868 (5.3 %)
    (528, 8, 600, 2, False),  # 72 of 600 slots (12 %): more than the share, though every layer holds the union
    (338, 8, 350, 2, False),  # b8 1K 24 GiB: 42 slots a layer, under a 51.6-expert step at 8 tokens
    (574, 8, 753, 2, False),  # b8 16K 56 GiB: 179 of 753 slots (24 %)
    (885, 2, 897, 2, False),  # no more sequences for the slots
])
def test_below_the_batch_rule_kv_first_starts_only_where_it_costs_next_to_no_experts(
        kf_slots: int, kf_held: int, rs_slots: int, rs_held: int, kv_first: bool) -> None:
    """qwen3's 8 MoE layers of 128 experts, top-8 (2 x 128 / 8 = 32 sequences for the batch rule), at the b8
    splits the H100 runs measured: KV first where it gives up at most 10 % of the resident split's slots for more
    sequences and each layer keeps a step's union; the reason says so."""
    from tierplan.bench.baselines.base import Split
    from tierplan.bench.baselines.tierplan_live import kv_first_pays

    def split(slots: int) -> Split:
        return Split(tuple(slots // 8 + (m < slots % 8) for m in range(8)), 0)

    why = kv_first_pays(split(kf_slots), kf_held, split(rs_slots), rs_held, 128, 8)
    assert (why is not None) == kv_first, why
    if kv_first:
        assert f"for {rs_slots - kf_slots} of the resident split's {rs_slots} slots" in why and "51.6-expert" in why
    assert kv_first_pays(split(kf_slots), 32, split(rs_slots), rs_held, 128, 8) == ">= 32 = 2 x experts / top-k"


def test_the_resident_start_variant_runs_tierplans_controller_from_the_resident_split(tmp_path: Path) -> None:
    """tierplan_rs: the same live controller as tierplan, started from the split `resident` applies."""
    eng, ctx = bp.context(tmp_path)
    try:
        run, resident = _in_process("tierplan_rs").start(eng, ctx), make("resident").start(eng, ctx)
    finally:
        eng.close()
    assert run.split == resident.split and run.source is not None
    assert run.initial_plan.reason.startswith(f"tierplan_rs: resident start ({run.split.expert_slots} expert slots")


def test_kv_first_keeps_a_tokens_experts_per_layer_when_the_demand_outgrows_the_budget(tmp_path: Path) -> None:
    from tierplan.bench.baselines.base import kv_first_split

    eng, ctx = bp.context(tmp_path)
    try:
        floor_bytes = ctx.top_k * ctx.num_moe * ctx.expert_stride_bytes
        half_kv_bytes = (kv_demand_blocks(ctx) // 2) * ctx.kv_block_bytes
        tight = dataclasses.replace(ctx, hbm_budget_bytes=floor_bytes + half_kv_bytes)
        split = kv_first_split(tight, eng)
    finally:
        eng.close()
    assert ctx.top_k > 1 and split.expert_slots_per_layer == (ctx.top_k,) * ctx.num_moe  # not one slot a layer
    assert split.kv_gpu_blocks == kv_demand_blocks(ctx) // 2 and fits(tight, split)  # KV takes the rest


# ---- mv_wsa ----------------------------------------------------------------------------------------------
def test_mv_wsa_equalises_marginal_benefit_per_byte(tmp_path: Path) -> None:
    eng, ctx = bp.context(tmp_path)
    try:
        ctl = _in_process("mv_wsa").start(eng, ctx).source.source
    finally:
        eng.close()
    u = np.arange(11)
    groups = (Group.from_arrays("layer0", u[:7], 10 * 0.5 ** u[:7]),
              Group.from_arrays("layer1", u[:7], 6 * 0.6 ** u[:7]), Group.from_arrays("kv", u, 8 * 0.7 ** u,
                                                                                      kind=GroupKind.KV))
    problem = SplitProblem(groups, capacity_units=10, unit_bytes=4096)
    sol = ctl._solve(SimpleNamespace(problem=problem, step_ms=1.0))
    assert sol.solver == "greedy" and sol.units_used == 10
    cost = [g.arrays.cost_ms for g in groups]
    pos = list(sol.choice)
    last_taken = [cost[g][pos[g] - 1] - cost[g][pos[g]] for g in range(3) if pos[g] > 0]
    next_step = [cost[g][pos[g]] - cost[g][pos[g] + 1] for g in range(3) if pos[g] + 1 < len(cost[g])]
    assert len(last_taken) == 3  # every group got bytes: no side starved
    # Equal marginal benefit per byte: no untaken step is worth more than the least valuable step taken.
    assert min(last_taken) >= max(next_step)


# ---- kv_tiering ------------------------------------------------------------------------------------------
def test_kv_tiering_pins_the_hottest_experts_beyond_each_layers_union_room() -> None:
    counts = np.array([[5, 9, 1, 9], [0, 0, 3, 2]])
    # Layer 0: 3 slots, union room 2 -> one pin (the hottest, lower id on ties); layer 1 holds all 4: all pinned.
    assert static_pins(counts, (3, 4), (2, 2), 4) == [(0, 1), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert static_pins(counts, (2, 2), (2, 2), 4) == []  # no slot beyond the room: nothing pinned
    assert static_pins(None, (3, 4), (2, 2), 4) == []
    assert union_first_slots(10, (3, 2), 4) == (4, 4)  # the rooms first, then the rest evenly, at most E each
    assert union_first_slots(9, (3, 2), 8) == (5, 4)
    assert union_first_slots(4, (3, 2), 8) is None  # the rooms alone do not fit


def test_union_room_is_the_largest_batch_union_plus_a_token_capped_at_top_k_times_batch() -> None:
    ids = np.zeros((64, 2, 2), dtype=np.int64)
    ids[:, 0] = [0, 1]  # layer 0: every token routes to experts 0 and 1
    ids[:, 1, 0], ids[:, 1, 1] = np.arange(64) % 16, 16 + np.arange(64) % 16  # layer 1: 2 distinct per token
    room = union_room(ids, batch=3, top_k=2, num_experts=32)
    assert room == (4, 6)  # layer 0: union 2 + top_k; layer 1: 3 tokens x 2 = 6, the top_k x batch cap
    assert union_room(ids, batch=1, top_k=2, num_experts=32) == (2, 2)
    assert union_room(None, 3, 2, 32) is None


def test_kv_tiering_fits_every_decode_union_beside_its_pins_and_swaps_kv_to_the_cpu(tmp_path: Path) -> None:
    long_outputs = [dataclasses.replace(r, arrival_s=0.0, output_len=40) for r in bp.requests(6)]
    tiering = bp.CheckedKVTiering()
    r = bp.run(tiering, tmp_path / "t", long_outputs, batch=2)
    plan, split = r.run.initial_plan, r.run.split
    eng, ctx = bp.context(tmp_path / "c", long_outputs, batch=2)
    eng.close()
    assert split.kv_gpu_blocks == kv_floor_blocks(ctx)  # a small GPU share: HBM goes to experts
    assert plan.pinned_experts and r.stats["policy"]["num_pinned"] == len(plan.pinned_experts)
    pins = Counter(k.layer for k in plan.pinned_experts)
    for m, layer in enumerate(ctx.moe_layers):  # room for a step's union (2 sequences x top-2) beside the pins
        assert split.expert_slots_per_layer[m] - pins[layer] >= 4
    assert tiering.over == []  # no decode step's experts over a layer's slots: never the chunked eager path
    assert plan.kv_blocks_per_tier[Tier.CPU] == bp.POINT["kv_cpu_blocks"]
    assert plan.kv_blocks_per_tier[Tier.NVME] == bp.POINT["kv_nvme_blocks"]
    assert r.report.kv_peak_blocks["cpu"] > 0  # sequences beyond the GPU share were kept on the CPU tier ...
    assert tiering.engine.cache.misses_by_tier[KVTier.CPU] > 0  # ... and fetched back to run again
    assert r.over_budget_steps == 0
    resident = bp.run(make("resident"), tmp_path / "r", long_outputs, batch=2)
    assert resident.run.initial_plan.pinned_experts == ()  # the same bytes, but resident's LRU pins nothing
    assert resident.outputs == r.outputs


def test_kv_tiering_gives_kv_the_rest_only_where_every_expert_is_resident(tmp_path: Path) -> None:
    from tierplan.runtime.engine.runner import ForcedRouter

    eng, ctx = bp.context(tmp_path)
    try:
        eng.set_hooks(forced_routes=ForcedRouter(bp.trace(), eng))  # the warm-up window the pins are read from
        roomy = dataclasses.replace(ctx, hbm_budget_bytes=64 * bp.UNIT_BYTES)
        run = make("kv_tiering").start(eng, roomy)
    finally:
        eng.close()
    assert run.split.expert_slots_per_layer == (8, 8) and len(run.initial_plan.pinned_experts) == 16
    assert run.split.kv_gpu_blocks == 64 - 48  # nothing left unused: no expert could take it


# ---- the interface's guards ------------------------------------------------------------------------------
def test_make_plan_refuses_a_split_over_the_budget(tmp_path: Path) -> None:
    eng, ctx = bp.context(tmp_path)
    eng.close()
    with pytest.raises(ValueError, match="over the point's hbm_budget_bytes"):
        make_plan(ctx, Split((8, 8), 1), "x", "too many experts")


# ---- resident and static_lru -----------------------------------------------------------------------------
def test_resident_holds_every_expert_when_they_fit_and_static_lru_its_fixed_share(tmp_path: Path) -> None:
    eng, ctx = bp.context(tmp_path)
    try:
        roomy = dataclasses.replace(ctx, hbm_budget_bytes=64 * bp.UNIT_BYTES)
        res = make("resident").start(eng, roomy).split
        assert res.expert_slots_per_layer == (8, 8) and res.kv_gpu_blocks == 64 - 48  # KV takes the rest
        tight = make("resident").start(eng, ctx).split  # 40 units: the experts do not all fit beside the KV
        assert tight.expert_slots < 16  # as many as fit beside the KV floor: what is left is under a slot
        assert kv_floor_blocks(ctx) <= tight.kv_gpu_blocks < kv_floor_blocks(ctx) + 3
        lru = make("static_lru").start(eng, ctx).split
    finally:
        eng.close()
    share = 0.75 * ctx.hbm_budget_bytes
    assert share - ctx.num_moe * ctx.expert_stride_bytes < lru.expert_slots * ctx.expert_stride_bytes <= share
    assert max(lru.expert_slots_per_layer) - min(lru.expert_slots_per_layer) <= 1  # an even share per layer


# ---- the live policies' version shift ----------------------------------------------------------------------
def test_after_initial_plan_shifts_versions_between_agent_and_controller() -> None:
    from tierplan.bench.baselines.tierplan_live import AfterInitialPlan
    from tierplan.controller.protocol import AckStatus, Footprint, Plan, PlanAck

    issued = Plan(plan_id="c-1", version=1, base_version=0, created_s=0.0, hbm_budget_bytes=10,
                  expert_bytes_per_layer=(0,), kv_blocks_per_tier={Tier.GPU: 1}, reason="r")
    seen: list[object] = []
    ctl = SimpleNamespace(step_next=lambda: issued, record_ack=seen.append, sync_from=seen.append)
    src = AfterInitialPlan(ctl)
    out = src.step_next()
    assert (out.version, out.base_version) == (2, 1)  # on top of the starting plan the agent applied (v1)
    fp = Footprint(expert_bytes_per_layer=(0,), kv_blocks_per_tier={Tier.GPU: 1}, total_hbm_bytes=0)
    src.record_ack(PlanAck(agent_id="a", rank=0, plan_id="c-1", version=2, status=AckStatus.APPLIED, applied_s=0.0,
                           footprint=fp))
    assert seen[-1].version == 1
    src.record_ack(PlanAck(agent_id="a", rank=0, plan_id="x", version=1, status=AckStatus.APPLIED, applied_s=0.0,
                           footprint=fp))
    assert src.unshiftable_acks == 1 and len(seen) == 1  # the starting plan's ack: counted, not forwarded
