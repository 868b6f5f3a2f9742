"""The phase rows' prices: a step opening a telemetry window, and a run priced a window ahead (bench/phase_pricing)."""

from __future__ import annotations

import numpy as np
import pytest

from tierplan.bench.phase_predictor import Predictor, WindowPlaces
from tierplan.bench.phase_pricing import price_ahead
from tierplan.bench.phase_run import StepRecord
from tierplan.controller.model_shape import ModelShape

WINDOW = 8


def _predictor() -> Predictor:
    shape = ModelShape(name="t", num_layers=2, moe_layers=(0, 1), num_experts=8, top_k=2, expert_bytes=4096,
                       dense_bytes=0, kv_bytes_per_token=64, block_tokens=16)
    return Predictor.for_shape(shape, 1024, 1e9)


def _step(ms: float, tokens: int = 4, prefill: bool = False) -> StepRecord:
    return StepRecord(step_s=ms / 1e3, cycle_s=ms / 1e3, num_prefills=int(prefill), num_decodes=tokens,
                      tokens_out=tokens, batch_tokens=tokens, context_tokens=64 * tokens, expert_hits=4,
                      expert_misses=0, expert_stall_ms=0.0, kv_stall_ms=0.0, kv_gpu_hits=0, kv_fetch={},
                      link_bytes={})


def _run(n: int, ms: float, open_ms: float, rng: np.random.Generator) -> list[StepRecord]:
    """`n` decode steps of `ms` (+-2 %), each opening a window `open_ms` slower."""
    return [_step((ms + (open_ms if i and i % WINDOW == 0 else 0.0)) * float(rng.normal(1.0, 0.02)),
                  tokens=int(rng.choice([4, 8]))) for i in range(n)]


def test_window_places_name_the_first_step_after_each_close() -> None:
    places = WindowPlaces(start=6, window_steps=WINDOW)
    assert [j for j in range(20) if places.opens(j)] == [2, 10, 18]  # run steps 8, 16, 24
    assert not WindowPlaces(0, WINDOW).opens(0)  # the run's first step follows no close
    assert not any(WindowPlaces(0, 0).opens(j) for j in range(20))  # no windows, no opening step


def test_a_window_opening_step_is_priced_at_its_excess_and_kept_out_of_the_fit() -> None:
    """Decode steps of 3 ms, each window's first 8 ms (its telemetry built beside it): folded in at their places,
    the opening steps are priced ~8 ms and the others still ~3; without places (the fit's outlier cut alone) the
    opening steps are priced as the rest, and a step that holds a prefill never pays the window's excess."""
    rng = np.random.default_rng(0)
    seen = _run(400, 3.0, 5.0, rng)
    placed, blind = _predictor(), _predictor()
    placed.calibrate(seen, places=WindowPlaces(0, WINDOW))
    blind.calibrate(seen)
    probe = [_step(3.0), _step(3.0)]  # at places 7 and 8 of the run: the second opens a window
    at = WindowPlaces(7, WINDOW)
    got = placed.step_prices(probe, places=at)
    assert got[0] == pytest.approx(3.0, rel=0.05) and got[1] == pytest.approx(8.0, rel=0.05), got
    assert placed.window_open_ms() == pytest.approx(5.0, rel=0.1)
    assert blind.step_prices(probe, places=at)[1] < 4.0  # the term it never learned
    assert placed.step_prices([_step(3.0), _step(3.0, tokens=64, prefill=True)], places=at)[1] < 8.0


def test_each_window_is_priced_before_it_is_folded_in_and_the_prices_follow_the_run() -> None:
    """A run whose decode steps take 4 ms where the runs before took 3 (+-10 % each; another point, a slower host):
    priced a window ahead, its first window costs what the fit before the run says (never the steps it is about to
    see) and the run's mean price comes within 15 % of its 4 ms; priced a run ahead (the fit before it for every
    step, the rows to session 38) it stays near 3. The predictor ends with every step folded in."""
    rng = np.random.default_rng(1)
    history = [_step(3.0 * float(rng.normal(1.0, 0.1))) for _ in range(300)]
    run = [_step(4.0 * float(rng.normal(1.0, 0.1))) for _ in range(128)]
    ahead, fixed = _predictor(), _predictor()
    for p in (ahead, fixed):
        p.calibrate(history)
    first_window = ahead.step_prices(run[:WINDOW])
    run_ahead = float(np.mean(fixed.step_prices(run)))
    got = price_ahead(ahead, run, 0, WINDOW)
    assert got.ahead_steps == WINDOW and got.predicted is None and len(got.measured_misses) == len(run)
    assert got.measured_misses[:WINDOW] == pytest.approx(first_window)
    measured = float(np.mean([s.cycle_s for s in run])) * 1e3
    assert abs(float(np.mean(got.measured_misses)) / measured - 1) <= 0.15, (got.measured_misses, measured)
    assert run_ahead / measured < 0.85
    # every step folded in: the next run's first window is priced near the new level
    assert ahead.step_prices([_step(4.0)])[0] == pytest.approx(4.0, rel=0.15)


def test_warm_steps_are_folded_in_first_and_a_run_without_windows_is_priced_a_run_ahead() -> None:
    rng = np.random.default_rng(2)
    warm = [_step(9.0 * float(rng.normal(1.0, 0.05))) for _ in range(40)]
    timed = _run(24, 9.0, 0.0, rng)
    p, q, r = _predictor(), _predictor(), _predictor()
    got = price_ahead(p, [*warm, *timed], len(warm), WINDOW)
    assert len(got.measured_misses) == 24 and got.measured_misses[0] == pytest.approx(9.0, rel=0.1)
    whole = price_ahead(q, [*warm, *timed], len(warm), 0)
    r.calibrate(warm)
    assert whole.ahead_steps == 24 and whole.measured_misses == pytest.approx(r.step_prices(timed))
