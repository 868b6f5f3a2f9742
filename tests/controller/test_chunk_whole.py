"""controller/chunk_whole.py: the chunked decode step priced on the whole split, over the batch's swing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.controller.loop_fixtures import KV_MIN, Windows, make_controller
from tests.controller.test_demand_decode_split import _window
from tierplan.controller.chunk_whole import ChunkPrice, Swing, swing_at
from tierplan.controller.costmodel import ComputeParams
from tierplan.controller.coupling import search_shares, slots_of, solve_coupled, value_share
from tierplan.controller.demand import DemandForecast, swing_ratios, union_sd
from tierplan.controller.optimizer import solve
from tierplan.controller.valuation import Decode, option_stall_ms, over_slots_prob


def test_the_swing_is_kept_as_equally_likely_quantiles_of_pure_decode_steps_over_their_median() -> None:
    """A step carrying a prompt chunk runs off the graphs anyway, so only pure decode steps tell the swing: here
    decode batches 2, 4, 6 around a median of 4, the chunk steps left out; fewer than 16 steps tell none."""
    assert swing_ratios([1.0] * 15) == ()
    ratios = swing_ratios(list(np.linspace(0.5, 1.5, 101)))
    assert len(ratios) == 8 and ratios == tuple(sorted(ratios)) and np.mean(ratios) == pytest.approx(1.0)
    win = Windows(steps=6)
    ctl = make_controller()
    ctl.sync_from(_window((2, 4, 6, 4, 1028, 1030), (2, 4, 6, 4, 4, 6), win))
    assert list(ctl.demand.decode_ratios) == pytest.approx([0.5, 1.0, 1.5, 1.0])
    assert ctl.demand.forecast().decode_batch_ratios == ()
    for _ in range(4):
        ctl.sync_from(_window((2, 4, 6, 4, 1028, 1030), (2, 4, 6, 4, 4, 6), win))
    assert set(ctl.demand.forecast().decode_batch_ratios) <= {0.5, 1.0, 1.5}
    assert len(ctl.demand.forecast().decode_batch_ratios) == 8


def test_a_split_is_charged_once_for_any_of_its_layers_and_not_once_a_layer() -> None:
    """Layers independent at a batch: P(any over its slots) = 1 - prod(1 - p), where the knapsack's per-layer
    charges sum the p (three layers at a 50 % chance: 0.875 against 1.5 of a step)."""
    e = 16
    swing = Swing(np.full((1, 3), 8.0), np.full((1, 3), 2.0), share=1.0)
    p = float(over_slots_prob(np.array([8]), 8.0, 2.0, e)[0])
    assert swing.p_any([8, 8, 8], e) == pytest.approx(1 - (1 - p) ** 3)
    assert swing.p_any([16, 16, 16], e) == 0.0  # every expert resident: never over
    assert swing.p_any([8, 16, 16], e) == pytest.approx(p)


def _forecast(ratios: tuple[float, ...], batch: float = 4.0) -> tuple[DemandForecast, object]:
    ctl = make_controller(compute=ComputeParams(chunked_step_ms=20.0), calibrate=False)
    win = Windows()
    for _ in range(3):
        ctl.sync_from(win.next(batch=int(batch), kv_live=20))
    return dataclasses.replace(ctl.demand.forecast(), decode_batch_ratios=ratios), ctl


def test_the_swing_reads_the_unions_at_each_batch_it_swings_to() -> None:
    """At one ratio of 1 the swing is the batch's own unions and independent-token spread; a swing to twice the
    batch asks for more experts, so slots just clear of the mean batch's union chunk more over the swing than at
    its mean (b8 16K 24 GiB: 22 slots about held the mean batch's union, 52 of 128 decode steps chunked)."""
    fc, _ = _forecast(())
    union = np.array([3.0, 3.5])
    flat = swing_at(fc, 4.0, union, 0.5)
    assert flat.union == pytest.approx(union[None, :]) and flat.union_sd == pytest.approx(union_sd(fc, 4.0)[None, :])
    swung = swing_at(dataclasses.replace(fc, decode_batch_ratios=(0.5, 2.0)), 4.0, union, 0.5)
    assert (swung.union[0] < union).all() and (union < swung.union[1]).all()
    slots = [5, 5]
    assert swung.p_any(slots, 8) > flat.p_any(slots, 8)
    no_probs = swing_at(dataclasses.replace(fc, token_probs=()), 4.0, union, 0.5)
    assert no_probs.union == pytest.approx(union[None, :]) and not no_probs.union_sd.any()


def test_the_mend_replaces_what_the_knapsack_charged_with_the_whole_splits_price() -> None:
    """`charged_ms` is exactly the per-layer charge `option_stall_ms` adds to the chosen options; where the share
    priced the step flat (no room to clear the unions), it is that flat price."""
    fc, ctl = _forecast((0.5, 1.0, 1.0, 2.0))
    u, sd, e = np.array([3.0, 3.5]), np.array([1.0, 1.2]), 8
    decode = Decode(tuple(u), tuple(sd), 0.5)
    price = ChunkPrice(20.0, decode, 0.0, swing_at(fc, 4.0, u, 0.5), e)
    slots = np.array([3, 5])
    misses = np.array([1.0, 0.5])
    priced = option_stall_ms(ctl.cost, misses, u, slots, 0.0, 10.0, u, sd, 0.5, e)
    plain = option_stall_ms(ctl.cost, misses, u, slots, 0.0, 10.0)
    assert price.charged_ms(slots) == pytest.approx(float((priced - plain).sum()))
    assert price.mend_ms(slots) == pytest.approx(price.whole_ms(slots) - price.charged_ms(slots))
    flat = dataclasses.replace(price, charged=None, flat_step_ms=10.0)
    assert flat.charged_ms(slots) == 10.0
    assert dataclasses.replace(price, chunked_step_ms=0.0).whole_ms(slots) == 0.0


def test_shares_are_ranked_and_predicted_with_their_solved_splits_chunked_step_priced_whole() -> None:
    """Each solved share's objective carries its split's mend (weighted per step served), and the plan's
    predicted step prices the chunked step on the winner's split as a whole."""
    fc, ctl = _forecast((0.5, 0.75, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0))
    space = ctl.config.space
    done = search_shares(fc, ctl.cost, space, None, None, 32, lambda v: solve(v.problem))
    assert done
    for at in done.values():
        if at.sol is None:
            continue
        slots = slots_of(at.val, at.sol.choice)
        mend = at.val.chunk_price.mend_ms(slots)
        assert at.chunk_mend_ms == pytest.approx(space.stall_weight * mend / at.served)
        assert at.objective_ms == pytest.approx(at.sol.objective_ms + at.kv_move_ms + at.chunk_mend_ms)
    val, sol = solve_coupled(fc, ctl.cost, space, None, None, 32, lambda v: solve(v.problem))
    slots = slots_of(val, sol.choice)
    best = next(a for a in done.values() if a.kv_blocks == val.kv_blocks[0])
    own, *_ = value_share(fc, ctl.cost, space, None, None, 32, best.kv_blocks)
    charged = own.kv_steps[0][0] + sum(own.kv_steps[0][1][m][j] for m, j in enumerate(sol.choice[:-1]))
    assert val.predicted_step_ms(sol.choice) == pytest.approx(charged + own.chunk_price.mend_ms(slots))
    assert val.kv_blocks[0] >= KV_MIN


def test_a_swing_that_chunks_the_kv_heavier_split_moves_the_split_to_the_experts() -> None:
    """Two tokens a step on average, 16 of the 40 KV blocks the sequences want in use: without a swing the best
    share holds 28 blocks and 6 slots a layer; with the batch swinging between half and three times its median,
    those 6 slots chunk the larger steps, and the split takes fewer blocks and more slots (b8 16K 24 GiB's
    KV-heavy plans, bench/results/phase_h200.md session 30)."""
    ctl = make_controller(compute=ComputeParams(step_ms=10.0, moe_ms_per_token=0.01, chunked_step_ms=30.0),
                          transfer_overhead_s=2e-3, calibrate=False)
    win = Windows()
    for _ in range(3):
        ctl.sync_from(win.next(batch=2, kv_live=16))
    fc = dataclasses.replace(ctl.demand.forecast(), kv_live_blocks=40.0, kv_gpu_used_blocks=16.0)
    chosen = {}
    for ratios in ((), (0.5, 0.5, 1.0, 1.0, 1.0, 1.5, 2.0, 3.0)):
        val, sol = solve_coupled(dataclasses.replace(fc, decode_batch_ratios=ratios), ctl.cost, ctl.config.space,
                                 None, None, 32, lambda v: solve(v.problem))
        chosen[ratios != ()] = (val.kv_blocks[sol.choice[-1]], sum(slots_of(val, sol.choice)))
    assert chosen[False] == (28, 12)
    assert chosen[True][0] < 28 and chosen[True][1] > 12


def test_the_reason_prices_a_kv_move_against_the_option_the_plan_stands_on_and_names_its_chunked_part() -> None:
    """A plan's spare HBM goes to KV past the option the solve chose (`with_spare_kv`): the reason's KV factor is
    still the difference between the current share's option and that one (not the current option's whole cost,
    as read against no option at all), with its running batches, and says how much of it comes from pricing the
    chunked decode step on each whole split rather than per layer."""
    import re

    from tierplan.controller.plan_reason import Split, explain

    ctl = make_controller(compute=ComputeParams(step_ms=10.0, moe_ms_per_token=0.01, chunked_step_ms=30.0),
                          transfer_overhead_s=2e-3, calibrate=False)
    win = Windows()
    for _ in range(3):
        ctl.sync_from(win.next(batch=2, kv_live=16))
    fc = dataclasses.replace(ctl.demand.forecast(), kv_live_blocks=40.0, kv_gpu_used_blocks=16.0,
                             decode_batch_ratios=(0.5, 0.5, 1.0, 1.0, 1.0, 1.5, 2.0, 3.0))
    cur = Split((6, 6), 28)
    val, sol = solve_coupled(fc, ctl.cost, ctl.config.space, cur.slots, cur.kv_blocks, 32,
                             lambda v: solve(v.problem))
    assert val.kv_blocks[1] == 28 and val.kv_blocks[0] < 28 and len(val.kv_chunk_mend_ms) == 2
    won = slots_of(val, sol.choice)
    new = Split(won, val.kv_blocks[0] + 3)  # three spare blocks past the option
    text = explain(cur, new, None, fc, val, sol, None, 40.0, val.kv_blocks[0])
    kv = val.problem.groups[-1].options
    gain = kv[1].cost_ms - kv[0].cost_ms
    factor = re.search(r"KV GPU blocks 28 -> \d+ \(runs [\d.]+ -> [\d.]+ tokens/step; (saves|costs) ([\d.]+)", text)
    assert factor is not None and float(factor.group(2)) == pytest.approx(abs(gain), abs=0.01)
    part = val.kv_chunk_mend_ms[1] - val.kv_chunk_mend_ms[0]
    assert abs(part) >= 0.005 and f"{part:+.2f} of it from pricing the decode steps run chunked" in text
