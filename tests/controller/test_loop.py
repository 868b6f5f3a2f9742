"""controller/loop.py on telemetry made in the test: plans follow the workload's phases, stay within the
budget, hold under noise, wait for acks, agree across solvers, and refuse malformed windows without change."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tests.controller.loop_fixtures import (
    BLOCK_BYTES,
    BUDGET_BYTES,
    KV_MAX,
    KV_MIN,
    SLOT_BYTES,
    Windows,
    ack,
    drive,
    make_controller,
    plan_total_bytes,
)
from tierplan.controller.costmodel import ComputeParams
from tierplan.controller.demand import KV_SETTLE_WINDOWS
from tierplan.controller.loop import Controller, Outcome, Solver, num_pins
from tierplan.controller.protocol import AckStatus, Forecast, Plan, RejectReason, Tier, parse, to_json
from tierplan.controller.state import RejectCode, TelemetryRejected


def test_first_window_gives_a_valid_plan_with_a_reason_and_a_table() -> None:
    ctl, win = make_controller(), Windows()
    ctl.sync_from(win.next(batch=1, kv_live=2))
    plan = ctl.step_next()
    assert plan is not None and plan.version == 1 and plan.base_version == 0
    assert parse(Plan, to_json(plan)) == plan  # a valid v2 message
    assert plan_total_bytes(plan) <= plan.hbm_budget_bytes == BUDGET_BYTES
    assert "batch 1.0 tokens/step" in plan.reason and "KV demand 2 blocks" in plan.reason
    assert plan.local_predictor is not None and plan.local_predictor.rows
    # Little KV demand, and the curves value 3-5 slots a layer: the HBM no option valued goes to KV, none idles.
    assert plan.kv_blocks_per_tier[Tier.GPU] > KV_MIN and BUDGET_BYTES - plan_total_bytes(plan) < BLOCK_BYTES
    assert "more KV blocks from HBM no option valued" in plan.reason
    assert all(b % SLOT_BYTES == 0 for b in plan.expert_bytes_per_layer)


def test_split_moves_to_kv_when_context_grows_and_back_when_it_falls() -> None:
    ctl, win = make_controller(), Windows()
    plans = drive(ctl, win, [(4, 8, 3, 0), (8, 16, 40, 30), (8, 32, 5, 0)])
    kv = [p.kv_blocks_per_tier[Tier.GPU] for p in plans]
    experts = [sum(p.expert_bytes_per_layer) // SLOT_BYTES for p in plans]
    peak = int(np.argmax(kv))
    # Not all 70 wanted blocks: at 16 tokens a step a layer needs ~6 of its 8 experts, and below that it would
    # compute in chunks (valuation.option_stall_ms), so the experts keep 4 a layer.
    assert peak > 0 and kv[peak] > kv[0] and experts[peak] < experts[peak - 1]
    # The KV load fell while the steps need every expert (32 tokens a step): experts get the HBM back. (At 8 tokens a
    # step, 5.7 of 8 experts, the engine's cache misses next to nothing with 6-7 slots: the split is held.)
    assert kv[-1] < kv[peak] and experts[-1] > experts[peak]
    assert "KV GPU blocks" in plans[peak].reason and "HBM budget binding" in plans[peak].reason


@pytest.mark.parametrize("seed", range(5))
def test_plans_never_exceed_the_budget(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ctl, win = make_controller(), Windows(seed)
    phases = [(int(rng.integers(1, 4)), int(rng.integers(1, 33)), int(rng.integers(0, 200)),
               int(rng.integers(0, 100))) for _ in range(8)]
    plans = drive(ctl, win, phases)
    assert plans
    for p in plans:
        assert plan_total_bytes(p) <= BUDGET_BYTES
        assert KV_MIN <= p.kv_blocks_per_tier[Tier.GPU] <= KV_MAX


def test_hysteresis_holds_the_plan_under_noise() -> None:
    ctl, win = make_controller(hysteresis=0.2), Windows()
    plans = drive(ctl, win, [(3, 8, 20, 0)])
    rng = np.random.default_rng(1)
    for _ in range(10):  # the same workload, +-10% demand
        ctl.sync_from(win.next(8, int(20 * rng.uniform(0.9, 1.1))))
        plans += [p for p in [ctl.step_next()] if p is not None]
    assert len(plans) <= 2
    assert sum(d.outcome is Outcome.HELD for d in ctl.history) >= 8


def test_no_new_plan_while_one_is_in_flight_and_a_rejected_one_is_replaced() -> None:
    ctl, win = make_controller(), Windows()
    ctl.sync_from(win.next(1, 2))
    first = ctl.step_next()
    assert first is not None
    ctl.sync_from(win.next(16, 60, 20))
    assert ctl.step_next() is None  # v1 is in flight: neither applied nor rejected
    ctl.record_ack(ack(first, AckStatus.REJECTED))
    second = ctl.step_next()  # the refusal does not stop the controller: it plans again on what is applied
    assert second is not None and second.version == 2 and second.base_version == 0
    assert ctl.state.rejected == {1: RejectReason.OTHER} and ctl.stats()["plans_rejected"] == 1
    assert second.reason.startswith("replaces plan 1, rejected by an agent (other); ")
    ctl.sync_from(win.next(16, 60, 20))
    assert ctl.step_next() is None  # v2 is in flight
    ctl.record_ack(ack(second))
    win.applied = 2
    ctl.sync_from(win.next(1, 2))
    third = ctl.step_next()
    assert third is not None and third.base_version == 2 and third.version == 3
    assert "replaces plan" not in third.reason
    assert ctl.stats() == {"plans_issued": 3, "plans_rejected": 1, "stale_acks": 0, "applied_version": 2,
                           "windows_quiet": 0, "union_steps_skipped": 0, "kv_reuse_events_fed": 0,
                           "kv_reuse_events_over_cap": 0,
                           "kv_reuse_windows_clock_behind": 0, "kv_reuse_resolved_events": 0, "kv_reuse_fits": 0}


def test_a_late_ack_for_an_old_plan_does_not_roll_the_split_back() -> None:
    ctl, win = make_controller(), Windows()
    ctl.sync_from(win.next(1, 2))
    first = ctl.step_next()
    assert first is not None
    ctl.record_ack(ack(first))
    win.applied = 1
    # A large batch with little KV: the experts want the HBM the first plan gave KV (it had no other use then).
    ctl.sync_from(win.next(16, 2, 0))
    second = ctl.step_next()
    assert second is not None and second.kv_blocks_per_tier[Tier.GPU] != first.kv_blocks_per_tier[Tier.GPU]
    ctl.record_ack(ack(second))
    win.applied = 2
    ctl.record_ack(ack(first))  # a duplicate, late ack for v1
    ctl.sync_from(win.next(16, 2, 0))  # the same load as v2 was made for: v2's split is kept
    assert ctl.step_next() is None and ctl.history[-1].outcome is Outcome.HELD
    assert ctl.history[-1].version == 2 and ctl.history[-1].split.kv_blocks == second.kv_blocks_per_tier[Tier.GPU]
    assert ctl.stats()["stale_acks"] == 1 and ctl.state.issued_version == 2


def test_an_ack_from_an_agent_without_telemetry_is_refused_and_does_not_pin_the_controller() -> None:
    ctl, win = make_controller(), Windows()
    ctl.sync_from(win.next(1, 2))
    first = ctl.step_next()
    assert first is not None
    stray = ack(first).model_copy(update={"agent_id": "agent-9"})
    before = copy.deepcopy(vars(ctl.state))
    with pytest.raises(TelemetryRejected, match="agent-9 rank 0: ack for plan version 1 from an agent that sent "
                                                "no telemetry") as info:
        ctl.record_ack(stray)
    assert info.value.code is RejectCode.UNKNOWN_AGENT and vars(ctl.state) == before
    ctl.record_ack(ack(first))
    win.applied = 1
    ctl.sync_from(win.next(16, 2, 0))
    assert ctl.state.applied_version() == 1 and ctl.step_next() is not None


def test_dp_and_milp_give_the_same_plans() -> None:
    plans = {}
    for solver in Solver:
        ctl, win = make_controller(solver), Windows(3)
        plans[solver] = drive(ctl, win, [(3, 2, 4, 0), (3, 24, 50, 40), (3, 2, 6, 0)])
    dp, milp = plans[Solver.DP], plans[Solver.MILP]
    assert [(p.expert_bytes_per_layer, p.kv_blocks_per_tier) for p in dp] == \
        [(p.expert_bytes_per_layer, p.kv_blocks_per_tier) for p in milp]


def test_malformed_telemetry_is_refused_and_changes_nothing() -> None:
    ctl, win = make_controller(), Windows()
    ctl.sync_from(win.next(4, 8))
    def snapshot() -> tuple[object, ...]:
        d = ctl.demand
        return (copy.deepcopy(vars(ctl.state)), d.freq.copy(), d.pairs.copy(), d.src.copy(), d.num_windows,
                d.batch_tokens, d.kv_live, ctl.cost.compute, [ctl.demand.curves.num_steps(0, b) for b in (1, 4, 8)])

    before = snapshot()
    win.seq -= 1  # a repeat of the last window
    with pytest.raises(TelemetryRejected) as info:
        ctl.sync_from(win.next(4, 8))
    assert info.value.code is RejectCode.SEQ_NOT_INCREASING
    after = snapshot()
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(after, before,
                                                                                            strict=True))


def test_the_table_learns_which_expert_follows_which() -> None:
    ctl, win = make_controller(), Windows()
    ctl.sync_from(win.next(1, 2))
    ctl.step_next()
    rows = ctl.demand.transition_rows(top_m=4, min_prob=0.0)
    probs = ctl.demand.pairs[0] / np.maximum(ctl.demand.src[0][:, None], 1)
    for row in rows:
        best = int(np.argmax(probs[row.src]))
        assert probs[row.src, row.next[0].expert] == pytest.approx(probs[row.src, best])


def test_the_forecast_message_says_which_experts_the_horizon_needs() -> None:
    ctl, win = make_controller(), Windows()
    for _ in range(3):
        ctl.sync_from(win.next(batch=1, kv_live=2))
    msg = parse(Forecast, to_json(ctl.forecast_message()))
    assert [lf.layer for lf in msg.layers] == [0, 1] and msg.horizon_steps == ctl.config.horizon_steps
    freq = ctl.demand.freq[0]
    ranked = np.argsort(-np.asarray(msg.layers[0].probs), kind="stable")
    assert freq[ranked[0]] == freq.max() and all(0.0 <= p <= 1.0 for p in msg.layers[0].probs)


@pytest.mark.parametrize("useful", [3, 7])
def test_the_prefetch_table_is_withheld_while_most_prefetches_are_wasted(useful: int) -> None:
    """A wasted prefetch moves an expert and evicts a resident, about what a used one saves, so below
    `min_prefetch_precision` used no table goes out (nor is any load priced as streamed ahead); the evidence fades
    with every window, so a withheld table comes back and is measured again."""
    from tierplan.controller.protocol import PrefetchCounts

    ctl, win = make_controller(), Windows()
    counts = PrefetchCounts(table_version=1, issued=10, useful=useful, wasted=10 - useful, skipped_resident=0,
                            skipped_budget=0, skipped_no_slot=0, failed=0)
    for _ in range(4):
        ctl.sync_from(win.next(batch=8, kv_live=4).model_copy(update={"local_prefetch": counts}))
    assert ctl.demand.forecast().prefetch_precision == pytest.approx(useful / 10)
    plan = ctl.step_next()
    assert plan is not None
    if useful < 5:
        assert plan.local_predictor is None and plan.prefetch_budget_bytes_per_step == 0
        assert "prefetch table withheld: 30% of the agent's prefetches used (< 50%)" in plan.reason
    else:
        assert plan.local_predictor is not None  # (its byte budget is what the split leaves of the link)
    for _ in range(16):  # windows without a table: what condemned it fades below the evidence needed
        ctl.sync_from(win.next(batch=8, kv_live=4).model_copy(update={"local_prefetch": None}))
    assert ctl.demand.forecast().prefetch_precision is None


def test_a_held_split_is_reissued_to_withhold_the_table_once_prefetches_are_wasted() -> None:
    from tierplan.controller.protocol import PrefetchCounts

    def windows(useful: int, n: int) -> list[Plan]:
        counts = PrefetchCounts(table_version=1, issued=10, useful=useful, wasted=10 - useful, skipped_resident=0,
                                skipped_budget=0, skipped_no_slot=0, failed=0)
        plans = []
        for _ in range(n):
            ctl.sync_from(win.next(batch=8, kv_live=4).model_copy(update={"local_prefetch": counts}))
            if (plan := ctl.step_next()) is not None:
                plans.append(plan)
                ctl.record_ack(ack(plan))
                win.applied = plan.version
        return plans

    ctl, win = make_controller(hysteresis=0.5), Windows()
    first = windows(9, 4)
    assert first and first[-1].local_predictor is not None
    later = windows(1, 12)  # the same workload: the split holds, the precision falls below 0.5
    withheld = [p for p in later if p.local_predictor is None]
    assert withheld and "prefetch table withheld" in withheld[0].reason
    assert ctl._now.forecast.prefetch_recall == 0.0  # nothing priced as streamed ahead once withheld


def test_pins_leave_room_for_the_layers_step_union() -> None:
    """A step whose union does not fit its layer's slots less the unasked pins runs eagerly (num_pins)."""
    assert num_pins(40, 10.0, 8, 0.5) == 20  # a small union: pin_frac bounds it
    assert num_pins(40, 28.0, 8, 0.5) == 5  # 40 slots less 1.25 x 28
    assert num_pins(30, 28.0, 8, 0.5) == 0  # below the union: nothing pinned
    assert num_pins(30, 28.0, 8, 0.5, operator_pins=3) == 3  # the operator's pins stay
    ctl, win = make_controller(), Windows()
    # Twelve tokens a step: a union of ~6.2 of the 8 experts a layer, whose headroom (1.25x) takes all 8 slots.
    plans = drive(ctl, win, [(6, 12, 3, 0)])
    assert plans and all(not p.pinned_experts for p in plans)
    ctl, win = make_controller(), Windows()
    plans = drive(ctl, win, [(6, 1, 3, 0)])  # one token a step: two experts, the rest may be pinned
    assert any(p.pinned_experts for p in plans)


@pytest.mark.parametrize("cap", [1, 12])
def test_pins_leave_room_for_the_busiest_step_the_engine_may_run(cap: int) -> None:
    """One token a step now, but the engine runs up to `cap` sequences a step: the pins are sized for the union
    of `cap` tokens (~6.2 of 8 experts at 12, whose headroom takes every slot), not the batch seen so far, which
    a filling batch soon outgrows (H100 phase run 54, b8 16K 24 GiB: pinned for 1 token, chunked at 3)."""
    import dataclasses

    ctl, win = make_controller(), Windows()
    ctl.config = dataclasses.replace(ctl.config, space=dataclasses.replace(ctl.config.space, max_running_seqs=cap))
    plans = drive(ctl, win, [(6, 1, 3, 0)])
    assert plans and any(p.pinned_experts for p in plans) == (cap == 1)


def test_spare_hbm_goes_to_kv_within_the_tier() -> None:
    """What the split leaves of the capacity becomes GPU KV blocks, never past the tier's capacity; less than a
    block, or none, changes nothing."""
    import dataclasses

    from tierplan.controller.loop import with_spare_kv
    from tierplan.controller.plan_reason import Split

    space = make_controller().config.space
    full = Split((8, 8), (BUDGET_BYTES - 16 * SLOT_BYTES) // BLOCK_BYTES)
    assert with_spare_kv(full, space) == (full, 0)
    assert with_spare_kv(Split((8, 7), full.kv_blocks), space) == (Split((8, 7), full.kv_blocks + 3), 3)
    assert with_spare_kv(Split((1, 1), KV_MIN), space) == (Split((1, 1), 58), 48)  # the budget binds
    small = dataclasses.replace(space, kv_gpu_blocks_max=30)
    assert with_spare_kv(Split((1, 1), KV_MIN), small) == (Split((1, 1), 30), 20)  # the tier binds
    assert with_spare_kv(Split((0, 0), KV_MAX), space) == (Split((0, 0), KV_MAX), 0)


def test_spare_kv_is_counted_in_the_problems_units() -> None:
    """A unit coarser than a slot and a block (a large budget): the split with its spare KV must fit the
    capacity as the next window's problem counts it (each group rounded up to whole units), else the plan in
    force reads as "no longer fits" and a switch is forced every window."""
    import dataclasses

    from tierplan.controller.loop import with_spare_kv
    from tierplan.controller.optimizer.problem import capacity_units_of, units_for_bytes
    from tierplan.controller.plan_reason import Split

    space = dataclasses.replace(make_controller().config.space, max_units=10)
    unit = space.unit_bytes
    assert unit % SLOT_BYTES and unit % BLOCK_BYTES  # neither divides it: rounding is at stake
    capacity = capacity_units_of(space.hbm_budget_bytes, space.dense_bytes, space.workspace_bytes, unit)
    for slots in ((2, 2), (1, 3), (5, 4), (6, 6)):  # splits a solve may return (they fit in units)
        new, _ = with_spare_kv(Split(slots, KV_MIN), space)
        used = sum(units_for_bytes(s * SLOT_BYTES, unit) for s in slots) + units_for_bytes(
            new.kv_blocks * BLOCK_BYTES, unit)
        assert used <= capacity, (slots, new, used, capacity)
        one_more = units_for_bytes((new.kv_blocks + 1) * BLOCK_BYTES, unit) + used - units_for_bytes(
            new.kv_blocks * BLOCK_BYTES, unit)
        assert new.kv_blocks == KV_MAX or one_more > capacity, (slots, new)  # and none is left idle


def _filling(compute_load_ms: float | None, prefill_tokens: int = 0) -> tuple[list[Plan], Controller, Windows]:
    """A batch filling (12, 16, 20 blocks held) behind the 40-block GPU KV share the agent started with (a split
    this controller never issued). `compute_load_ms`: a decode-bound step (10 ms at any small batch, so a
    deferred sequence costs a step's worth) and loads of that many ms each; None: the fixture's free compute.
    `prefill_tokens`: the first step of every window is a prefill of that many tokens."""
    ctl = make_controller() if compute_load_ms is None else make_controller(
        compute=ComputeParams(step_ms=10.0, moe_ms_per_token=0.01), transfer_overhead_s=compute_load_ms * 1e-3,
        calibrate=False)
    win, plans = Windows(), []
    for live in (12, 16, 20):
        tel = win.next(4, live, kv_gpu_limit_blocks=40 if not plans else plans[0].kv_blocks_per_tier[Tier.GPU])
        if prefill_tokens:
            tel = tel.model_copy(update={"step_unions": tuple(u.model_copy(update={"batch_tokens": (
                prefill_tokens, *u.batch_tokens[1:])}) for u in tel.step_unions)})
        ctl.sync_from(tel)
        if (plan := ctl.step_next()) is not None:
            plans.append(plan)
            ctl.record_ack(ack(plan))
            win.applied = plan.version
    return plans, ctl, win


def test_a_filling_batch_prices_its_kv_demand_at_the_share_the_agent_started_with() -> None:
    """While KV demand rises, it is priced at no less than the share the agent started with (40 blocks; 12 seen):
    where a deferred sequence costs a decode step and loads are cheap, every plan keeps the 40 (priced at the 12
    seen, the first plan leaves 25 and the batch, once full, would wait for KV). Once the demand has stayed flat
    for KV_SETTLE_WINDOWS windows it is priced as seen, and a plan may take KV back. A share of this controller's
    own plans never moves the start (it holds spare HBM)."""
    ctl, win = make_controller(), Windows()
    ctl.sync_from(win.next(4, 12))
    blind = ctl.step_next()
    assert blind is not None and blind.kv_blocks_per_tier[Tier.GPU] < 40

    plans, ctl, win = _filling(compute_load_ms=0.3)
    assert plans and all(p.kv_blocks_per_tier[Tier.GPU] >= 40 for p in plans)
    assert "KV demand still rising: priced at no less than the 40 blocks the agent started with" in plans[0].reason
    assert ctl.demand.kv_start_blocks == 40  # reports under a plan of ours never move it
    assert ctl.demand.forecast().kv_live_blocks == 40
    later = []
    for _ in range(KV_SETTLE_WINDOWS + 2):  # the same 20 blocks every window: the demand has settled
        ctl.sync_from(win.next(4, 20))
        if (plan := ctl.step_next()) is not None:
            later.append(plan)
            ctl.record_ack(ack(plan))
            win.applied = plan.version
    assert ctl.demand.forecast().kv_live_blocks == 20
    assert later and later[-1].kv_blocks_per_tier[Tier.GPU] < 40 and "still rising" not in later[-1].reason


def test_the_start_share_is_a_price_not_a_floor_where_fewer_sequences_cost_less() -> None:
    """The same filling batch where each load costs 4 ms: more expert slots and fewer sequences at a time cost
    less per token than the start's 40 blocks, so the first plan leaves KV below them (a floor at the start share
    held the KV-first split at H200 phase run 26's b128 1K point, 0.59x of the best baseline). With a prefill in
    every window, whose loads grow with every slot short of the experts it routes to, at 1 ms a load too."""
    for load_ms, prefill in ((4.0, 0), (1.0, 1000)):
        plans, _, _ = _filling(compute_load_ms=load_ms, prefill_tokens=prefill)
        cheap, _, _ = _filling(compute_load_ms=0.3, prefill_tokens=prefill)
        assert plans[0].kv_blocks_per_tier[Tier.GPU] < 40 <= cheap[0].kv_blocks_per_tier[Tier.GPU]
        assert sum(plans[0].expert_bytes_per_layer) > sum(cheap[0].expert_bytes_per_layer)
        assert "priced at no less than the 40 blocks" in plans[0].reason


def test_a_start_share_larger_than_the_room_beside_the_least_slots_still_gives_a_plan_that_fits() -> None:
    """The agent reports the whole budget as its start share (no room for 2 slots a layer): the plan fits."""
    ctl, win = make_controller(), Windows()
    ctl.sync_from(win.next(4, 12, kv_gpu_limit_blocks=64))  # the whole budget as KV: no room for 2 slots a layer
    plan = ctl.step_next()
    assert plan is not None
    space = ctl.config.space
    assert all(b // space.slot_bytes >= space.min_slots_per_layer for b in plan.expert_bytes_per_layer)
    assert sum(plan.expert_bytes_per_layer) + plan.kv_blocks_per_tier[Tier.GPU] * space.kv_block_bytes \
        <= space.hbm_budget_bytes


def test_kv_demand_settles_after_flat_windows_and_rises_again_on_growth() -> None:
    from tierplan.controller.demand import KV_SETTLE_GROWTH, DemandModel

    ctl, win = make_controller(), Windows()
    model: DemandModel = ctl.demand
    for _ in range(KV_SETTLE_WINDOWS):
        assert model.kv_rising()  # fewer windows than it takes to settle
        model.observe(win.next(4, 20))
    assert not model.kv_rising()
    model.observe(win.next(4, int(20 * (1 + KV_SETTLE_GROWTH)) + 2))
    assert model.kv_rising()  # one window grew past the margin: rising again until it leaves the last windows
    for _ in range(KV_SETTLE_WINDOWS - 1):
        model.observe(win.next(4, 24))
    assert not model.kv_rising()


def test_a_split_that_breaks_the_budgets_is_replaced_whatever_the_gain_floor() -> None:
    # The hysteresis owes a switch when the current split no longer fits (here: it streams past a link budget
    # that shrank to nothing); its gain then reads 0, which the loop's floor (10% of the step) must not read as
    # "saves too little" and hold (phase run 30 held such a split for 25 windows).
    from dataclasses import replace

    ctl, win = make_controller(), Windows()
    first = drive(ctl, win, [(2, 4, 8, 0)])[-1]
    decide = ctl.hysteresis.decide
    ctl.hysteresis.decide = lambda problem, cur, sol, w: decide(  # type: ignore[method-assign]
        replace(problem, link_budget_bytes_per_step=0), cur, sol, w)
    ctl.sync_from(win.next(16, 40))  # the demand moved: the solve proposes another split
    plan = ctl.step_next()
    assert plan is not None and plan.version == first.version + 1, ctl.history[-1].reason
    assert "no longer fits" in plan.reason and "streams" in plan.reason
