"""controller/coupling.py: each GPU KV share valued at the batch it runs, and the search over shares."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from tests.controller.loop_fixtures import KV_MAX, Windows, make_controller
from tierplan.controller.costmodel import ComputeParams
from tierplan.controller.coupling import (
    curves_at,
    running_batch,
    search_shares,
    served_share,
    share_grid,
    solve_coupled,
    value_share,
)
from tierplan.controller.demand import BucketCurves, DemandForecast, with_large_steps
from tierplan.controller.loop import Controller
from tierplan.controller.optimizer import solve
from tierplan.controller.optimizer.problem import InfeasibleError, SplitSolution, evaluate
from tierplan.controller.predictors.irm_lru import lru_curve
from tierplan.controller.protocol import Telemetry, parse, to_json
from tierplan.controller.valuation import Valuation, build_problem, kv_grid

E = 8  # the tiny model's experts per layer


def _decode_bound(load_ms: float = 2.0) -> Controller:
    """A step that costs about the same at any small batch (decode reads the weights once), and loads that cost
    `load_ms` each (a large expert over a slow link): the regime where batch and expert cache pull apart."""
    return make_controller(compute=ComputeParams(step_ms=10.0, moe_ms_per_token=0.01),
                           transfer_overhead_s=load_ms * 1e-3, calibrate=False)


def _solve(val: Valuation) -> SplitSolution:
    return solve(val.problem)


def _curve(union: float, hit_at_full: float = 1.0) -> tuple[float, ...]:
    """Loads per step with 0..E slots: `union` distinct experts a step, LRU keeping s/E of them."""
    return tuple(union * (1.0 - hit_at_full * s / E) if s < E else 0.0 for s in range(E + 1))


def _forecast(ctl: Controller, batch: float, used: float, live: float, obs: tuple[float, ...],
              buckets: dict[int, tuple[float, ...]]) -> DemandForecast:
    win = Windows()
    for _ in range(3):
        ctl.sync_from(win.next(batch=int(batch), kv_live=int(used)))
    fc = ctl.demand.forecast()
    return dataclasses.replace(fc, batch_tokens=batch, kv_gpu_used_blocks=used, kv_live_blocks=live,
                               misses_per_step=(obs, obs), reuse_per_step=0.0,
                               bucket_curves=tuple(BucketCurves(b, (c, c), (c[0], c[0])) for b, c in buckets.items()))


def _exhaustive(fc: DemandForecast, ctl: Controller, slots: tuple[int, ...] | None = None, kv: int | None = None,
                horizon: int = 32) -> tuple[int, float]:
    """(KV blocks, objective) of the best share over the whole grid, each share solved exactly."""
    space, best = ctl.config.space, (0, float("inf"))
    for g in share_grid(fc, space, kv):
        val, _, _, move_ms = value_share(fc, ctl.cost, space, slots, kv, horizon, g)
        try:
            ms = solve(val.problem).objective_ms + move_ms
        except InfeasibleError:  # a share with no split that fits is not a candidate
            continue
        best = min(best, (g, ms), key=lambda x: x[1])
    return best


def _largest_share(fc: DemandForecast, ctl: Controller, min_slots: int = 1) -> int:
    space = dataclasses.replace(ctl.config.space, min_slots_per_layer=min_slots)
    for g in reversed(share_grid(fc, space, None)):
        try:
            value_share(fc, ctl.cost, space, None, None, 32, g)[0].problem.check_feasible()
            return g
        except InfeasibleError:
            continue
    raise AssertionError("no share fits")


def test_the_kv_grid_is_dense_up_to_twice_the_demand_and_holds_the_current_share() -> None:
    space = dataclasses.replace(make_controller().config.space, kv_gpu_blocks_min=10, kv_gpu_blocks_max=14000)
    coarse = kv_grid(space)
    assert len(coarse) == space.kv_options and coarse[0] == 10 and coarse[-1] == 14000
    dense = kv_grid(space, demand_blocks=500.0, current=777)
    near = [g for g in dense if g <= 1000]
    assert len(near) >= space.kv_options and max(b - a for a, b in itertools.pairwise(near)) <= 17
    assert 777 in dense and set(coarse) <= set(dense)


def test_a_share_runs_the_batch_its_blocks_hold() -> None:
    ctl = make_controller()
    fc = _forecast(ctl, batch=2.0, used=16.0, live=64.0, obs=_curve(2.0), buckets={})
    assert served_share(fc, 16) == pytest.approx(0.25) and served_share(fc, 64) == served_share(fc, 90) == 1.0
    assert running_batch(fc, 16) == pytest.approx(2.0) and running_batch(fc, 32) == pytest.approx(4.0)
    assert running_batch(fc, 64) == pytest.approx(8.0) == running_batch(fc, 200)  # no more than all who want
    assert served_share(fc, 1) == pytest.approx(0.1)  # deferring more is priced as deferring 90%
    idle = dataclasses.replace(fc, kv_gpu_used_blocks=0.0)
    assert running_batch(idle, 40) == 2.0  # nothing in use to scale from


def test_blocks_past_what_the_engines_most_sequences_hold_run_no_larger_batch() -> None:
    """With the engine's max running sequences known (vLLM's max_num_seqs), a share holding more than they do
    serves no more of the demand: 2 tokens a step on 16 blocks, at most 4 sequences, so 32 blocks run them all."""
    ctl = make_controller()
    fc = _forecast(ctl, batch=2.0, used=16.0, live=64.0, obs=_curve(2.0), buckets={})
    assert served_share(fc, 64, 4) == pytest.approx(0.5) == served_share(fc, 32, 4)
    assert running_batch(fc, 64, 4) == pytest.approx(4.0) == running_batch(fc, 200, 4)
    assert running_batch(fc, 24, 4) == pytest.approx(3.0) and served_share(fc, 16, 4) == pytest.approx(0.25)
    assert served_share(fc, 64, None) == 1.0  # no cap known: the blocks alone
    over = dataclasses.replace(fc, batch_tokens=8.0)  # more tokens a step than sequences: prompt chunks
    assert served_share(over, 16, 4) == served_share(over, 16, None)  # the share in force defers nothing more


def test_the_coupled_split_spends_no_hbm_on_kv_the_engine_cannot_run() -> None:
    """Where admitting everyone pays (the experts of 8 tokens are nearly those of 2), the split takes the
    largest share that fits; at most 4 sequences a step, no share past the 32 blocks they hold is worth a slot."""
    ctl = _decode_bound(load_ms=2.0)
    fc = _forecast(ctl, batch=2.0, used=16.0, live=64.0, obs=_curve(2.0), buckets={4: _curve(2.4), 8: _curve(2.4)})
    space = ctl.config.space
    val, sol = solve_coupled(fc, ctl.cost, space, None, None, 32, _solve)
    assert val.kv_blocks[sol.choice[-1]] > 32
    capped = dataclasses.replace(space, max_running_seqs=4)
    val, sol = solve_coupled(fc, ctl.cost, capped, None, None, 32, _solve)
    assert val.kv_blocks[sol.choice[-1]] <= 32


def test_curves_come_from_the_batch_bucket_they_price() -> None:
    ctl = make_controller()
    measured = _curve(7.0)
    fc = _forecast(ctl, batch=2.0, used=16.0, live=64.0, obs=_curve(2.0), buckets={8: measured})
    assert curves_at(fc, 2.0)[0] == fc.misses_per_step  # the observed batch
    got, source = curves_at(fc, 8.0)
    assert got == (measured, measured) and "B~8" in source
    rescaled, source = curves_at(fc, 4.0)  # no bucket 4: frequencies at 4 tokens, corrected
    assert "frequency" in source and all(a >= b for a, b in zip(rescaled[0], fc.misses_per_step[0], strict=True))
    between, source = curves_at(fc, 2.8)  # between the observed batch and bucket 4, linear in log(batch)
    assert "between" in source
    assert all(min(a, b) <= x <= max(a, b) for x, a, b in zip(between[0], fc.misses_per_step[0], rescaled[0],
                                                               strict=True))
    assert between[0][0] == pytest.approx(fc.misses_per_step[0][0] + (rescaled[0][0] - fc.misses_per_step[0][0])
                                          * np.log(1.4) / np.log(2.0))
    no_probs = dataclasses.replace(fc, token_probs=())
    assert curves_at(no_probs, 4.0)[0] == fc.misses_per_step  # nothing to rescale with


@pytest.mark.parametrize("thrash", [True, False])
def test_the_share_follows_what_the_batch_does_to_the_expert_loads(thrash: bool) -> None:
    """Thrash: at 8 tokens a step the union misses almost whatever the slots (the cache only helped small
    batches), so per token, 2 sequences at a time with the experts' room beat 8: the coupled split keeps KV
    small. Shared: the experts of 8 tokens are nearly those of 2, so admitting everyone is cheaper per token."""
    ctl = _decode_bound(load_ms=4.0 if thrash else 2.0)
    big = _curve(8.0, hit_at_full=0.1) if thrash else _curve(2.4)
    fc = _forecast(ctl, batch=2.0, used=16.0, live=64.0, obs=_curve(2.0), buckets={4: big, 8: big})
    space = ctl.config.space
    val, sol = solve_coupled(fc, ctl.cost, space, None, None, 32, _solve)
    chosen = val.kv_blocks[sol.choice[-1]]
    best_g, best_ms = _exhaustive(fc, ctl)
    assert sol.objective_ms == pytest.approx(best_ms, rel=1e-9) and chosen == best_g
    separable = build_problem(fc, ctl.cost, space, None, None, 32, fc.kv_live_blocks)
    sep_g = separable.kv_blocks[solve(separable.problem).choice[-1]]
    if thrash:
        assert chosen < 32 <= sep_g  # the separable split admits the batch that thrashes
        at_sep = value_share(fc, ctl.cost, space, None, None, 32, sep_g)
        assert sol.objective_ms < 0.8 * (solve(at_sep[0].problem).objective_ms + at_sep[3])  # per token served
    else:
        # As many sequences as fit beside each layer's step union (3 slots for 2.4 experts): below it a layer
        # computes in chunks, its loads priced twice (valuation.option_stall_ms), and the floor's share is smaller.
        assert chosen == _largest_share(fc, ctl, min_slots=3) < _largest_share(fc, ctl)


@pytest.mark.parametrize("with_current", [False, True])
def test_the_search_finds_the_best_share_of_the_whole_grid(with_current: bool) -> None:
    """Random curves, demand and (with_current) a current split to migrate from, over short and long horizons:
    the screen and the few exact solves find what solving every share of the grid finds."""
    rng = np.random.default_rng(7)
    for _ in range(16):
        ctl = _decode_bound()
        obs = _curve(float(rng.uniform(1.0, 3.0)), float(rng.uniform(0.5, 1.0)))
        buckets = {b: _curve(float(rng.uniform(2.0, 8.0)), float(rng.uniform(0.05, 1.0))) for b in (4, 8)}
        fc = _forecast(ctl, batch=2.0, used=float(rng.integers(10, 30)), live=float(rng.integers(20, 120)),
                       obs=obs, buckets=buckets)
        grid = kv_grid(ctl.config.space)
        slots, kv = ((int(rng.integers(2, 9)), int(rng.integers(2, 9))), int(rng.choice(grid))) if with_current \
            else (None, None)
        horizon = int(rng.choice([1, 4, 32, 64]))
        _, sol = solve_coupled(fc, ctl.cost, ctl.config.space, slots, kv, horizon, _solve)
        assert sol.objective_ms == pytest.approx(_exhaustive(fc, ctl, slots, kv, horizon)[1], rel=1e-6)


def test_no_share_that_fits_is_an_infeasible_problem_naming_the_cause() -> None:
    ctl = _decode_bound()
    fc = _forecast(ctl, batch=2.0, used=16.0, live=64.0, obs=_curve(2.0), buckets={})
    space = dataclasses.replace(ctl.config.space, hbm_budget_bytes=4 * 12288 + 9 * 4096)  # under the floors
    with pytest.raises(InfeasibleError, match="capacity"):
        solve_coupled(fc, ctl.cost, space, None, None, 32, _solve)


def test_the_merged_valuation_prices_the_current_split_at_its_own_batch() -> None:
    ctl = make_controller()
    fc = _forecast(ctl, batch=2.0, used=16.0, live=64.0, obs=_curve(2.0), buckets={8: _curve(8.0, 0.1)})
    space = ctl.config.space
    cur_slots, cur_kv = (4, 4), 64
    val, sol = solve_coupled(fc, ctl.cost, space, cur_slots, cur_kv, 32, _solve)
    assert val.kv_blocks[0] != cur_kv and val.kv_blocks[1] == cur_kv  # the winner and the current share
    own, batch, _, _ = value_share(fc, ctl.cost, space, cur_slots, cur_kv, 32, cur_kv)
    own_choice = (*(own.slot_counts[m].index(s) for m, s in enumerate(cur_slots)), 0)
    here = (*(val.slot_counts[m].index(s) for m, s in enumerate(cur_slots)), 1)
    assert evaluate(val.problem, here)[0] == pytest.approx(evaluate(own.problem, own_choice)[0], rel=1e-12)
    assert val.predicted_step_ms(here) == pytest.approx(own.predicted_step_ms(own_choice))
    assert val.kv_batch[1] == pytest.approx(batch) == pytest.approx(8.0)
    assert evaluate(val.problem, sol.choice)[0] == pytest.approx(sol.objective_ms)
    assert "GPU KV shares" in sol.detail and sol.stats["kv_shares_valued"] >= 3
    shares = search_shares(fc, ctl.cost, space, cur_slots, cur_kv, 32, _solve)
    assert share_grid(fc, space, cur_kv).index(cur_kv) in shares and max(a.kv_blocks for a in shares.values()) == KV_MAX


def test_the_loop_holds_the_split_its_own_valuation_cannot_beat() -> None:
    """Hysteresis compares the current split at its own batch: the same forecast twice keeps the split."""
    ctl = make_controller()
    win = Windows()
    for _ in range(4):
        ctl.sync_from(win.next(batch=4, kv_live=40))
        plan = ctl.step_next()
        if plan is not None:
            from tests.controller.loop_fixtures import ack

            ctl.record_ack(ack(plan))
            win.applied = plan.version
    outcomes = [d.outcome.value for d in ctl.history]
    assert outcomes[0] == "issued" and outcomes[-1] == "held"


def test_the_forecast_batch_is_the_median_step_not_a_prefill_inflated_mean() -> None:
    """One prefill of 1000 tokens among four decode steps of 4: the step the split prices is the decode step."""
    ctl = make_controller()
    tel = Windows(steps=4).next(batch=4, kv_live=20)
    prefill = tuple(u.model_copy(update={"batch_tokens": (1000, *u.batch_tokens[1:])}) for u in tel.step_unions)
    ctl.sync_from(tel.model_copy(update={"step_unions": prefill}))
    assert ctl.demand.forecast().batch_tokens == pytest.approx(4.0)


def test_without_unions_the_forecast_batch_is_the_median_of_the_reported_step_tokens() -> None:
    """No local predictor, so no unions: the agent's per-step token counts give the median step. Without them
    the window's mean is all there is, and one prefill of 1000 tokens among three decode steps of 4 makes it 253
    (H200 phase run 22: the controller priced B=1 at 492 tokens a step and 66 experts a layer)."""
    tel = Windows(steps=4).next(batch=4, kv_live=20)
    layers = tuple(r.model_copy(update={"num_tokens": 1012}) for r in tel.layers)
    plain = tel.model_copy(update={"step_unions": (), "layers": layers})
    with_tokens = parse(Telemetry, to_json(plain.model_copy(update={"step_tokens": (1000, 4, 4, 4)})))
    ctl = make_controller()
    ctl.sync_from(with_tokens)
    assert ctl.demand.forecast().batch_tokens == pytest.approx(4.0)
    ctl = make_controller()
    ctl.sync_from(plain)
    assert ctl.demand.forecast().batch_tokens == pytest.approx(253.0)


def _with_prefill(tokens: tuple[int, ...]) -> Telemetry:
    """A window of the fixture's routes whose steps carried `tokens` (no unions): counts scaled to match."""
    tel = Windows(steps=len(tokens)).next(batch=4, kv_live=20)
    scale = sum(tokens) / (4 * len(tokens))
    layers = tuple(r.model_copy(update={"num_tokens": sum(tokens), "activation_counts": tuple(
        round(c * scale) for c in r.activation_counts)}) for r in tel.layers)
    return parse(Telemetry, to_json(tel.model_copy(update={"step_unions": (), "layers": layers,
                                                           "step_tokens": tokens})))


def test_large_steps_are_priced_at_their_own_size_beside_the_median_step() -> None:
    """Seven decode steps of 4 tokens and one prefill of 1000: the split is priced at the decode step, plus an
    eighth of the prefill's own curve (it needs every routed expert: an LRU cache short of them reloads nearly
    all), in the separable and the coupled valuation alike; without the prefill nothing is added."""
    ctl = make_controller()
    ctl.sync_from(_with_prefill((4,) * 7 + (1000,)))
    fc = ctl.demand.forecast()
    assert fc.batch_tokens == pytest.approx(4.0) and fc.large_step_share == pytest.approx(1 / 8)
    plain = dataclasses.replace(fc, large_step_share=0.0, large_step_misses=())
    for m, probs in enumerate(fc.token_probs):
        at_prefill = lru_curve(np.asarray(probs), 512)[0]  # the prefill's bucket
        assert fc.large_step_misses[m] == pytest.approx(tuple(at_prefill / 8))
        assert with_large_steps(fc.misses_per_step, fc)[m] == pytest.approx(
            tuple(7 / 8 * np.asarray(fc.misses_per_step[m]) + at_prefill / 8))
    space, cost = ctl.config.space, ctl.cost
    for value in (lambda f: build_problem(f, cost, space, None, None, 64, 20.0),
                  lambda f: value_share(f, cost, space, None, None, 64, 20)[0]):
        with_large, without = value(fc).stall_ms, value(plain).stall_ms
        assert all(a[0] > b[0] for a, b in zip(with_large, without, strict=True))  # fewest slots: more loads
    ctl = make_controller()
    ctl.sync_from(_with_prefill((4,) * 8))
    assert ctl.demand.forecast().large_step_share == 0.0


def test_prefills_per_step_scale_with_the_batch_a_share_runs() -> None:
    """Every request prefills once, so a share running half the sequences runs half the prefills per step: the
    large steps' share follows the running batch (at most every step), and their loads per token stay put. (Up
    only once the KV demand has settled: a fill's prompts are arrivals, test_demand_decode_split.py.)"""
    ctl = make_controller()
    ctl.sync_from(_with_prefill((4,) * 7 + (1000,)))
    fc = dataclasses.replace(ctl.demand.forecast(), kv_rising=False)
    typical, large = np.asarray(fc.misses_per_step), np.asarray(fc.large_step_misses)  # large: times 1/8
    assert np.allclose(with_large_steps(fc.misses_per_step, fc, fc.batch_tokens), with_large_steps(
        fc.misses_per_step, fc))
    half = with_large_steps(fc.misses_per_step, fc, fc.batch_tokens / 2)
    assert np.allclose(half, (1 - 1 / 16) * typical + large / 2)
    assert np.allclose(with_large_steps(fc.misses_per_step, fc, 16 * fc.batch_tokens), 8 * large)  # all prefills


def test_measured_curves_are_anchored_at_their_bucket_not_at_the_observed_batch() -> None:
    """Observed 2.9 tokens a step, so the forecast's curves are bucket 4's measured ones: between buckets 2 and 4
    the curve follows log(batch), with no flat stretch from 2.9 to 4."""
    ctl = make_controller()
    two, four = _curve(2.0), _curve(4.0)
    fc = dataclasses.replace(_forecast(ctl, batch=2.9, used=16.0, live=64.0, obs=four, buckets={2: two, 4: four}),
                             curve_batch=4.0)
    for batch in (2.3, 2.9, 3.5):
        w = np.log(batch / 2.0) / np.log(2.0)
        assert curves_at(fc, batch)[0][0][0] == pytest.approx((1 - w) * two[0] + w * four[0])
    assert curves_at(fc, 4.0)[0][0] == four and curves_at(fc, 2.0)[0][0] == two


def _at_share(kv_blocks: int, budget: int | None, floor: bool) -> object:
    """A one-layer share, hand-made: 1 slot streams 100 bytes a step, 2 slots none; its own link budget."""
    from tierplan.controller.coupling import AtShare
    from tierplan.controller.optimizer.problem import Group, GroupKind, Option, SplitProblem

    layer = Group("MoE layer 0", (Option(1, 2.0, 100, "1 slots"), Option(2, 1.0, 0, "2 slots")), 0,
                  GroupKind.EXPERTS)
    kv = Group("GPU KV", (Option(1, 0.5, 0, f"{kv_blocks} KV blocks"),), None, GroupKind.KV)
    problem = SplitProblem((layer, kv), 5, 1, link_budget_bytes_per_step=budget, link_budget_is_floor=floor)
    val = Valuation(problem, ((1, 2),), (kv_blocks,), 1.0, ((2.0, 1.0),), (4.0,), ((1.0, ((2.0, 1.0),)),))
    return AtShare(kv_blocks, 4.0, 1.0, val, None, 0.0)


def test_the_merged_split_keeps_the_current_shares_own_link_verdict() -> None:
    """The winner's share and the current one each have their link budget. The split in force (1 slot, 100
    bytes a step) is judged by its own: over a floor (no split of its share meets the link) it breaks nothing,
    though the winner's real budget is lower; over a real budget it is broken, though the winner's is a floor."""
    from tierplan.controller.coupling import _merged
    from tierplan.controller.optimizer import SplitHysteresis
    from tierplan.controller.optimizer.problem import make_solution

    def decide(best: object, cur: object) -> object:
        merged = _merged(best, cur, (1,)).problem
        proposed = make_solution(merged, (1, 0), "dp", 0.0, "")
        return SplitHysteresis().decide(merged, (0, 1), proposed, 1)

    held = decide(_at_share(20, budget=80, floor=False), _at_share(10, budget=50, floor=True))
    assert not held.forced, held.reason
    owed = decide(_at_share(20, budget=80, floor=True), _at_share(10, budget=50, floor=False))
    assert owed.forced and "no longer fits" in owed.reason
    owed = decide(_at_share(20, budget=None, floor=True), _at_share(10, budget=50, floor=False))  # no cap left
    assert owed.forced and "no longer fits" in owed.reason, owed.reason
    held = decide(_at_share(20, budget=80, floor=False), _at_share(10, budget=None, floor=True))
    assert not held.forced, held.reason


def test_the_valuation_keeps_every_share_it_solved_term_by_term() -> None:
    """A plan's record names what each share weighed cost (coupling.ShareTerms): the terms add up to the objective
    the shares were ranked by, the lowest is the winner's, whose step is the plan's predicted step."""
    ctl = make_controller()
    fc = _forecast(ctl, batch=2.0, used=16.0, live=64.0, obs=_curve(2.0), buckets={8: _curve(8.0, 0.1)})
    val, sol = solve_coupled(fc, ctl.cost, ctl.config.space, (4, 4), 64, 32, _solve)
    assert len(val.shares) == sol.stats["kv_shares_valued"] >= 3
    assert {s.kv_blocks for s in val.shares} >= {val.kv_blocks[0], 64}
    for s in val.shares:
        if s.expert_slots == 0:  # no split fits beside this share (the current one here): last, and the row says so
            assert s.objective_ms == float("inf") and s.as_row()["objective_ms"] is None
            continue
        assert np.isfinite(s.screened_ms)
        assert s.experts_ms + s.kv_ms + s.kv_move_ms + s.chunk_mend_ms == pytest.approx(s.objective_ms, rel=1e-12)
    won = min(val.shares, key=lambda s: s.objective_ms)
    assert won.kv_blocks == val.kv_blocks[0] and won.batch_tokens == pytest.approx(val.kv_batch[0])
    assert won.step_ms == pytest.approx(val.predicted_step_ms(sol.choice), rel=1e-12)
    assert won.expert_slots == sum(val.slot_counts[m][j] for m, j in enumerate(sol.choice[:-1]))
    row = won.as_row()
    assert row["kv_blocks"] == won.kv_blocks and row["objective_ms"] == round(won.objective_ms, 3)
    loop = make_controller()  # the loop's decision carries them to the phase rows (bench/phase_run.py)
    loop.sync_from(Windows().next(batch=2, kv_live=16))
    assert loop.step_next() is not None and loop.history[-1].shares
    assert min(s.objective_ms for s in loop.history[-1].shares) < float("inf")
