"""controller/valuation.py: what each option of the split is worth, and the problem's budgets."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from tests.controller.loop_fixtures import BUDGET_BYTES, KV_MAX, KV_MIN, Windows, make_controller
from tierplan.controller.optimizer import solve
from tierplan.controller.optimizer.problem import GroupKind, SplitProblem
from tierplan.controller.protocol import PrefetchCounts, ReuseEvent
from tierplan.controller.valuation import (
    build_problem,
    expert_groups,
    kv_cost_ms,
    layer_stall_ms,
    option_stall_ms,
    prefix_hit_share,
)


def _valuation(kv_demand: float, link_inf: bool = False, monkeypatch: pytest.MonkeyPatch | None = None):
    ctl, win = make_controller(), Windows()
    for _ in range(3):
        ctl.sync_from(win.next(batch=8, kv_live=20))
    if link_inf and monkeypatch is not None:
        monkeypatch.setattr(ctl.cost, "link_bytes_per_s", lambda link: math.inf)
    fc = ctl.demand.forecast()
    return build_problem(fc, ctl.cost, ctl.config.space, None, None, 32, kv_demand), fc


def test_options_cover_every_slot_count_and_the_kv_range() -> None:
    val, _ = _valuation(30.0)
    p = val.problem
    assert [g.kind for g in p.groups] == [GroupKind.EXPERTS, GroupKind.EXPERTS, GroupKind.KV]
    assert val.slot_counts[0] == tuple(range(2, 9)) and val.kv_blocks[0] == KV_MIN and val.kv_blocks[-1] == KV_MAX
    assert p.capacity_units == BUDGET_BYTES // p.unit_bytes
    for g in p.groups[:2]:  # more slots never cost more stall, nor stream more bytes
        costs = [o.cost_ms for o in g.options]
        assert all(a >= b - 1e-12 for a, b in itertools.pairwise(costs))
        assert g.options[-1].link_bytes == 0 and g.options[-1].cost_ms == pytest.approx(0.0, abs=1e-9)


def test_kv_costs_what_it_cannot_hold_and_nothing_above_demand() -> None:
    val, _ = _valuation(30.0)
    kv = val.problem.groups[-1]
    by_blocks = dict(zip(val.kv_blocks, (o.cost_ms for o in kv.options), strict=True))
    assert by_blocks[30] == 0.0 and by_blocks[KV_MAX] == 0.0 and by_blocks[KV_MIN] > by_blocks[20] > 0.0
    assert kv_cost_ms(30.0, 15, 2.0) == pytest.approx(2.0)  # half deferred: one lost step per step served
    assert kv_cost_ms(0.0, 1, 2.0) == 0.0


def test_the_link_budget_is_left_out_when_the_link_has_no_measured_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    val, _ = _valuation(30.0)
    assert val.problem.link_budget_bytes_per_step is not None and val.problem.link_budget_bytes_per_step > 0
    val, _ = _valuation(30.0, link_inf=True, monkeypatch=monkeypatch)
    assert val.problem.link_budget_bytes_per_step is None


def test_migration_is_priced_per_unit_over_the_horizon() -> None:
    val, fc = _valuation(30.0)
    assert val.problem.migration_ms_per_unit > 0
    assert np.isfinite(val.step_ms) and val.step_ms > 0 and fc.batch_tokens == pytest.approx(8.0)


def test_prefix_reuse_makes_a_larger_kv_share_worth_more() -> None:
    ctl, win = make_controller(), Windows()
    events = [{"prefix_hash": f"p{i}", "age_s": 0.001 * (i + 1), "tier": "cpu"} for i in range(40)]
    for _ in range(3):  # no sequence needs more KV (demand 0): only the reuses value it
        tel = win.next(batch=8, kv_live=0)
        ctl.sync_from(tel.model_copy(update={"kv": tel.kv.model_copy(update={"reuse_events": tuple(
            ReuseEvent(**e) for e in events)})}))
    fc = ctl.demand.forecast()
    assert fc.reuse_per_step == pytest.approx(10.0) and fc.touch_blocks_per_s > 0
    assert 0.0 < prefix_hit_share(fc, KV_MIN) < prefix_hit_share(fc, KV_MAX) <= 1.0
    val = build_problem(fc, ctl.cost, ctl.config.space, None, None, 32, 0.0)
    costs = [o.cost_ms for o in val.problem.groups[-1].options]
    assert costs[0] > costs[-1] == 0.0 and all(a >= b for a, b in itertools.pairwise(costs))


def test_measured_prefetch_recall_replaces_the_prior() -> None:
    ctl, win = make_controller(), Windows()
    counts = {"table_version": 2, "issued": 12, "useful": 9, "wasted": 3, "skipped_resident": 0,
              "skipped_budget": 0, "skipped_no_slot": 0, "failed": 0}
    for _ in range(4):
        tel = win.next(batch=8, kv_live=4)  # 2 expert misses per window on demand
        ctl.sync_from(tel.model_copy(update={"local_prefetch": PrefetchCounts(**counts)}))
    fc = ctl.demand.forecast()
    assert fc.prefetch_recall is not None and 0.8 < fc.prefetch_recall < 0.83  # 9 useful of 9 + 2 per window
    streamed = build_problem(fc, ctl.cost, ctl.config.space, None, None, 32, 0.0).problem.groups[0].options[0]
    prior = build_problem(dataclasses.replace(fc, prefetch_recall=None), ctl.cost, ctl.config.space, None, None,
                          32, 0.0).problem.groups[0].options[0]
    assert streamed.cost_ms < prior.cost_ms  # more of the misses hide behind the previous layer


def test_vectorised_layer_stall_is_the_cost_models() -> None:
    ctl = make_controller()
    cost, batch = ctl.cost, 8.0
    missed, streamed = np.array([0.0, 1.0, 3.5]), np.array([0.0, 2.0, 0.5])
    ours = layer_stall_ms(cost, missed, streamed, batch, cost.compute_ms(batch))
    theirs = [cost.layer_stall_ms(a, b, batch_tokens=batch, window_layers=1.0) for a, b in zip(missed, streamed,
                                                                                                strict=True)]
    assert ours == pytest.approx(theirs)


def test_a_link_budget_no_split_leaves_room_under_is_left_off_not_raised_to_the_least(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When the experts do not all fit (40 units: 16 slots of 3 units beside at least 10 KV blocks), every split
    streams some experts; a slow link's budget under that joint floor is met by no split: it is left off and
    flagged (the objective's stalls rank the splits), never left to make every split infeasible (each group's
    own least, all its slots, is 0), nor raised to the floor, which admits only the splits streaming least."""
    from tierplan.controller.optimizer import least_link_bytes, solve

    ctl, win = make_controller(), Windows()
    ctl.config = dataclasses.replace(ctl.config, space=dataclasses.replace(ctl.config.space,
                                                                          hbm_budget_bytes=40 * 4096))
    for _ in range(3):
        ctl.sync_from(win.next(batch=8, kv_live=20))
    monkeypatch.setattr(ctl.cost, "link_bytes_per_s", lambda link: 1e3)  # a budget of about a byte a step
    val = build_problem(ctl.demand.forecast(), ctl.cost, ctl.config.space, None, None, 32, 30.0)
    p = val.problem
    floor = least_link_bytes(dataclasses.replace(p, link_budget_bytes_per_step=None))
    assert floor > 0 and p.link_budget_bytes_per_step is None and p.link_budget_is_floor
    capped = dataclasses.replace(p, link_budget_bytes_per_step=floor)  # the old rule: only the least-streaming
    assert solve(p).objective_ms <= solve(capped).objective_ms and solve(capped).link_bytes_used <= floor


def test_the_link_floor_is_the_exact_least_whether_or_not_the_experts_all_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Budgets from 'every expert fits beside the KV floor' (the floor is each group's least summed, no DP pass)
    down to 'they do not' (the exact DP pass): the link's own budget where the exact least is within
    LINK_CAP_ROOM of it, else none (flagged)."""
    from tierplan.controller.optimizer import least_link_bytes
    from tierplan.controller.valuation import LINK_CAP_ROOM

    floors = []
    for units in (64, 56, 48, 40):
        ctl, win = make_controller(), Windows()
        ctl.config = dataclasses.replace(ctl.config, space=dataclasses.replace(ctl.config.space,
                                                                              hbm_budget_bytes=units * 4096))
        for _ in range(3):
            ctl.sync_from(win.next(batch=8, kv_live=20))
        monkeypatch.setattr(ctl.cost, "link_bytes_per_s", lambda link: 1e3)  # a budget of a few bytes a step
        val = build_problem(ctl.demand.forecast(), ctl.cost, ctl.config.space, None, None, 32, 30.0)
        exact = least_link_bytes(dataclasses.replace(val.problem, link_budget_bytes_per_step=None))
        own = int(ctl.config.space.link_share * 1e3 * max(val.step_ms, 1e-3) / 1e3)
        unmet = exact > LINK_CAP_ROOM * own
        assert val.problem.link_budget_bytes_per_step == (None if unmet else own), units
        assert val.problem.link_budget_is_floor == unmet, units
        floors.append(exact)
    assert floors[0] == 0 < floors[-1], floors  # both paths were taken


def test_a_layer_below_its_step_union_pays_for_its_chunks_and_is_not_starved() -> None:
    """Below the union u of experts a step needs, a layer computes in chunks of s slots, each waiting for its own
    loads: 1 - s/u of them are priced once more. An LRU curve is nearly flat below u, so without that price
    the solver starves one layer to the floor to give the other all it wants (H200 phase run 05: three of
    eight layers at 8 slots against a ~22-expert union)."""

    ctl = make_controller()
    cost, step_ms = ctl.cost, 10.0
    e, u = 64, 20.0
    # LRU-like: nearly flat below the union, then falling linearly to no load with every expert resident.
    curve = np.array([u - 0.1 * s if s < u else (u - 2.0) * (e - s) / (e - u) for s in range(e + 1)])
    counts = np.arange(e + 1)
    plain = layer_stall_ms(cost, curve, np.zeros(e + 1), 0.0, step_ms)
    priced = option_stall_ms(cost, curve, u, counts, 0.0, step_ms)
    assert priced[20:] == pytest.approx(plain[20:])  # at or above the union: no chunk
    assert priced[5] == pytest.approx(plain[5] * (1.0 + 0.75))  # four chunks: three quarters of the loads again
    space = dataclasses.replace(ctl.config.space, min_slots_per_layer=4, slot_bytes=ctl.config.space.unit_bytes)
    groups, slot_counts, _ = expert_groups((tuple(curve), tuple(curve)), cost, space, None, step_ms, 0.0)
    problem = SplitProblem(tuple(groups), capacity_units=64, unit_bytes=space.unit_bytes)  # 64 slots for both
    chosen = sorted(slot_counts[m][i] for m, i in enumerate(solve(problem).choice))
    assert chosen[0] >= u  # each layer holds its union (without the price: [4, 60], 21.2 loads a step vs 26.2)


def test_a_decode_union_that_may_outrun_a_layers_slots_is_charged_the_chunked_step() -> None:
    """A decode step whose union outruns any layer's slots leaves the graphs and pays `chunked_step_ms` once
    (H100 phase run 35, b8 1K 24 GiB: plans of 8 slots in three layers against a ~40-expert union ran every decode
    step chunked, 34-39 ms against 13-17). Each layer is charged that times its own chance of it, so a curve
    that rewards piling slots on one layer no longer starves the other to its union's edge."""
    from tierplan.controller.costmodel import ComputeParams
    from tierplan.controller.valuation import Decode, over_slots_prob

    e, u, sd = 64, 20.0, 3.0
    curve = np.array([u - 0.01 * s if s < u else (u - 2.0) * ((e - s) / (e - u)) ** 0.8 for s in range(e + 1)])
    counts = np.arange(e + 1)
    assert over_slots_prob(counts, u, sd, e)[[10, 20, 30, 64]] == pytest.approx([1.0, 0.43, 0.0, 0.0], abs=0.01)
    chosen = {}
    for charge in (0.0, 20.0):
        ctl = make_controller(compute=ComputeParams(chunked_step_ms=charge))
        cost, step_ms = ctl.cost, 10.0
        priced = option_stall_ms(cost, curve, u, counts, 0.0, step_ms, u, sd, 0.5, e)
        plain = option_stall_ms(cost, curve, u, counts, 0.0, step_ms)
        # Half the steps decode: the charge is half the chance times the chunked step.
        assert priced - plain == pytest.approx(0.5 * charge * over_slots_prob(counts, u, sd, e))
        space = dataclasses.replace(ctl.config.space, min_slots_per_layer=4, slot_bytes=ctl.config.space.unit_bytes)
        decode = Decode((u, u), (sd, sd), 1.0)
        groups, slot_counts, _ = expert_groups((tuple(curve), tuple(curve)), cost, space, None, step_ms, 0.0,
                                               decode=decode)
        problem = SplitProblem(tuple(groups), capacity_units=64, unit_bytes=space.unit_bytes)
        chosen[charge] = sorted(slot_counts[m][i] for m, i in enumerate(solve(problem).choice))
    assert chosen[0.0][0] < u + sd  # the loads alone pile slots on one layer, the other at its union's edge
    assert chosen[20.0][0] >= u + 2 * sd  # charged: both layers clear of their unions


def test_a_share_that_leaves_no_room_to_clear_the_unions_pays_the_chunked_step_once() -> None:
    """Where the experts' room holds every layer's decode union clear (its mean plus two spreads), each layer is
    charged its own chance of chunking the step; where it cannot (the largest KV share here), the step chunks
    whatever the split: it pays `chunked_step_ms` once, on the share, and no layer is charged (charged once a
    layer, four layers short of room bought slots that spared nothing and claimed the step four times over).
    The separable valuation judges at the least KV share; with no chunked step learned nothing is charged."""
    from tierplan.controller.costmodel import ComputeParams
    from tierplan.controller.coupling import value_share

    def valued(charge: float):
        ctl = make_controller(compute=ComputeParams(chunked_step_ms=charge), calibrate=False)
        win = Windows()
        for _ in range(3):
            ctl.sync_from(win.next(batch=4, kv_live=20))
        fc, space = ctl.demand.forecast(), ctl.config.space
        shares = {g: value_share(fc, ctl.cost, space, None, None, 64, g) for g in (KV_MIN, KV_MAX)}
        return shares, build_problem(fc, ctl.cost, space, None, None, 64, 20.0)

    plain, plain_sep = valued(0.0)
    charged, charged_sep = valued(20.0)
    room, full = KV_MIN, KV_MAX  # 54 of 64 units left to the experts; none
    assert charged[room][0].stall_ms[0][0] > plain[room][0].stall_ms[0][0] + 10  # fewest slots: nearly sure
    assert charged[room][0].stall_ms[0][-1] == pytest.approx(plain[room][0].stall_ms[0][-1])  # every expert: never
    assert charged[room][0].problem.groups[-1].options[0].cost_ms == pytest.approx(
        plain[room][0].problem.groups[-1].options[0].cost_ms)
    assert charged[full][0].stall_ms == plain[full][0].stall_ms  # no layer charged
    served = charged[full][2]
    assert charged[full][0].problem.groups[-1].options[0].cost_ms == pytest.approx(
        plain[full][0].problem.groups[-1].options[0].cost_ms + 20.0 / served)
    assert charged_sep.stall_ms[0][0] > plain_sep.stall_ms[0][0] + 10  # the separable split: room at the least KV
    # Each valuation says which way it priced the chunked step, for the plan's reason (`plan_reason.explain`).
    assert (charged[room][0].chunk_charged_per_layer, charged[room][0].chunk_flat_ms) == (True, 0.0)
    assert not charged[full][0].chunk_charged_per_layer
    assert charged[full][0].chunk_flat_ms == pytest.approx(20.0 / served)
    assert charged_sep.chunk_charged_per_layer and not plain_sep.chunk_charged_per_layer
    assert plain[full][0].chunk_flat_ms == plain_sep.chunk_flat_ms == 0.0
    # and the step the share predicts pays it (unweighted), where the split has no say in it
    extra = charged[full][0].kv_steps[0][0] - plain[full][0].kv_steps[0][0]
    assert charged[full][0].chunk_flat_step_ms > 0 and extra == pytest.approx(charged[full][0].chunk_flat_step_ms)


def test_the_chunked_steps_flat_price_is_weighted_and_named_in_the_plans_reason() -> None:
    """Where even the least KV share leaves the experts no room to clear the decode unions, the separable
    valuation puts the chunked step on every KV option, weighted as the stalls are (`stall_weight`); the reason
    says the steps run chunked whatever the split, and a layer's effect names the chunked steps where it is
    charged them."""
    from tierplan.controller.costmodel import ComputeParams
    from tierplan.controller.demand import decode_share
    from tierplan.controller.plan_reason import Split, explain

    def valued(weight: float, kv_min: int):
        ctl = make_controller(compute=ComputeParams(chunked_step_ms=20.0), calibrate=False)
        win = Windows()
        for _ in range(3):
            ctl.sync_from(win.next(batch=4, kv_live=20))
        space = dataclasses.replace(ctl.config.space, stall_weight=weight, kv_gpu_blocks_min=kv_min)
        return ctl.demand.forecast(), build_problem(ctl.demand.forecast(), ctl.cost, space, None, None, 64, 20.0)

    fc, one = valued(1.0, KV_MAX - 18)  # the least share leaves the experts no room to clear the unions
    _, two = valued(2.0, KV_MAX - 18)
    assert not one.chunk_charged_per_layer and one.chunk_flat_ms == pytest.approx(20.0 * decode_share(fc, 4.0))
    assert two.chunk_flat_ms == pytest.approx(2 * one.chunk_flat_ms)
    kv = two.problem.groups[-1].options
    assert kv[0].cost_ms - one.problem.groups[-1].options[0].cost_ms == pytest.approx(one.chunk_flat_ms)
    sol = solve(one.problem)
    new = Split(tuple(one.slot_counts[m][j] for m, j in enumerate(sol.choice[:-1])), one.kv_blocks[sol.choice[-1]])
    assert "decode steps run chunked off their graphs whatever the expert split" in explain(
        None, new, None, fc, one, sol, None, 20.0)
    assert one.predicted_step_ms(sol.choice) == pytest.approx(  # the step itself pays it, unweighted
        one.step_ms + one.chunk_flat_step_ms + sum(one.stall_ms[m][j] for m, j in enumerate(sol.choice[:-1])))
    assert one.chunk_flat_ms > 0 and one.chunk_flat_step_ms == pytest.approx(one.chunk_flat_ms)  # stall_weight 1
    _, roomy = valued(1.0, KV_MIN)
    sol = solve(roomy.problem)
    new = Split(tuple(roomy.slot_counts[m][j] for m, j in enumerate(sol.choice[:-1])), roomy.kv_blocks[sol.choice[-1]])
    cur = Split(tuple(max(2, s - 3) for s in new.slots), new.kv_blocks)
    reason = explain(cur, new, fc, fc, roomy, sol, None, 20.0)
    assert "of expert loads and decode steps run chunked" in reason and "whatever the split" not in reason, reason


def test_a_kv_share_below_the_blocks_in_use_pays_to_swap_them_out_and_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A share under the GPU blocks the running sequences hold swaps the excess out and back in: both transfers,
    block by block, over the plan's horizon, on every KV option below what is in use and none at or above it, in
    the separable and the coupled valuation alike, first plan or not (H200 run 37: a first plan cut the start's
    share under the blocks in use, and the fetches back took 3.2 s of the 10.2 s measured)."""
    import tierplan.controller.coupling as coupling
    import tierplan.controller.valuation as valuation
    from tierplan.controller.protocol import Link

    ctl = make_controller(calibrate=False)
    win = Windows()
    for _ in range(3):
        ctl.sync_from(win.next(batch=4, kv_live=40))  # 40 blocks on the GPU
    fc, space, cost, horizon = ctl.demand.forecast(), ctl.config.space, ctl.cost, 64
    assert fc.kv_gpu_used_blocks == 40
    assert valuation.swap_ms(cost, space, 40, 40, horizon) == 0.0 == valuation.swap_ms(cost, space, 40, 64, horizon)
    block = space.kv_block_bytes
    both = cost.transfer_ms(Link.D2H, 10 * block, 10) + cost.transfer_ms(Link.H2D, 10 * block, 10)
    assert both > 0 and valuation.swap_ms(cost, space, 40, 30, horizon) == pytest.approx(both / horizon)

    def kv_costs(swapping: bool) -> tuple[dict[int, float], dict[int, float]]:
        with monkeypatch.context() as mp:
            if not swapping:
                mp.setattr(valuation, "swap_ms", lambda *a: 0.0)
                mp.setattr(coupling, "swap_ms", lambda *a: 0.0)
            val = build_problem(fc, cost, space, None, None, horizon, 40.0)
            sep = {g: o.cost_ms for g, o in zip(val.kv_blocks, val.problem.groups[-1].options, strict=True)}
            coupled = {g: coupling.value_share(fc, cost, space, None, None, horizon, g)[0].problem.groups[-1]
                       .options[0].cost_ms for g in (KV_MIN, 30, 40, KV_MAX)}
        return sep, coupled

    (sep, coupled), (sep0, coupled0) = kv_costs(True), kv_costs(False)
    for with_swap, without in ((sep, sep0), (coupled, coupled0)):
        for g in with_swap:
            owed = space.kv_weight * valuation.swap_ms(cost, space, 40, g, horizon)
            assert with_swap[g] - without[g] == pytest.approx(owed), g
        assert with_swap[KV_MIN] > without[KV_MIN] and with_swap[KV_MAX] == without[KV_MAX]


def test_while_the_demand_rises_the_blocks_a_plan_lands_on_are_those_a_window_more_admits() -> None:
    """A plan made now lands a window on, and while the KV demand still rises the share in force keeps admitting:
    the swap is priced at the blocks held now plus what a window writes (its tokens over the block size), up to
    that share (the agent's start share before a plan of ours, ours after) and the demand; once the demand
    settles, at the blocks held."""
    from tierplan.controller.valuation import landing_blocks

    def forecast(windows: int, gpu: int, limit: int | None = None):
        ctl = make_controller(calibrate=False)
        win = Windows()
        for _ in range(windows):  # 4 steps of 40 tokens: 160 tokens, 10 blocks of 16 a window
            ctl.sync_from(win.next(batch=4, kv_live=gpu, queued=200, kv_gpu_limit_blocks=60,
                                   step_tokens=[40] * 4, schema_version=2))
        if limit is not None:
            ctl.demand.kv_gpu_limit = limit  # a plan of ours in force
        return ctl.demand.forecast()

    rising = forecast(2, 20)
    assert rising.kv_rising and rising.kv_gpu_used_blocks == 20 and landing_blocks(rising) == pytest.approx(30)
    assert landing_blocks(forecast(2, 55)) == pytest.approx(60)  # no more than the start share admits
    assert landing_blocks(forecast(2, 20, limit=25)) == pytest.approx(25)  # ours, in force, admits to 25
    settled = forecast(8, 20)
    assert not settled.kv_rising and landing_blocks(settled) == 20
