"""A run's measured steps priced a window ahead: the horizon at which the controller uses its cost model.

Runs in the bench process (a row's `predicted_step_ms`: bench/phase_metrics.measured_row) and offline (the replay of
saved steps: bench/phase_cost_replay.py); pure Python + numpy, no torch.

The controller re-fits its cost model on each telemetry window it is sent and prices the next window's splits with
that fit; it never prices a whole run from the fit it had at the run's start. So each window of a run's measured
steps is priced here with the fit of every step before it (the earlier runs of the process, the point's warm-up
run, this run's warm-up steps and its earlier windows), then folded in, and a row's prediction is the mean of
those prices. Until session 38 a row priced all of its ~128 measured steps from the fit before the run; replayed
over the H100/H200 phase steps of runs 01-73 (this CPU box, session 39), at the measured misses 695 of 948 runs
came within 15 % a run ahead and 871 a window ahead (with the window-opening term, `phase_predictor.WINDOW_OPEN_RATE`;
811 without it; 16 steps ahead gave 803 without it: the gain is the fit following the run, not the shorter
horizon as such). Each price is still made before its step is measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tierplan.bench.phase_predictor import Predictor, WindowPlaces, plan_loads, plan_step_prices


@dataclass(frozen=True)
class RunPrices:
    """One run's measured steps, each priced before it was measured."""

    measured_misses: list[float]  # at the step's measured misses and executor
    predicted: list[float] | None  # at the misses the trace's curves predict at its plan's split (None: no plans)
    evicted_blocks: int  # GPU KV blocks the plans' shares evicted, priced in `predicted`
    ahead_steps: int  # the horizon: the run's telemetry window, or its measured steps where it had none


def fold_settled(predictor: Predictor, steps: list[Any], warm: int, window_steps: int) -> None:
    """Fold a run that makes no row (a calibration pass, a point's warm-up run) into `predictor`: its steps past its
    `warm` warm-up steps (the last one at least), each at its place in the run's telemetry windows. The process does
    this (bench/phase.py) and the replay of its steps after it (bench/phase_cost_replay.py)."""
    warm = min(warm, max(0, len(steps) - 1))
    predictor.calibrate(steps[warm:], places=WindowPlaces(warm, window_steps))


def price_ahead(predictor: Predictor, steps: list[Any], warm: int, window_steps: int,
                plans: Mapping[int, Any] | None = None, initial_plan: Any = None) -> RunPrices:
    """Fold a run's `warm` warm-up steps into `predictor`, then price its measured steps (`steps[warm:]`) window by
    window (the run's telemetry windows, `window_steps` long; the whole run at once where that is < 2), each
    window before it is folded in. With `plans` (version -> plan) and `initial_plan`, also at each plan's split
    (`plan_step_prices`, at the misses the engine's residency makes there: `plan_loads`). Leaves every step folded
    into `predictor`, as the runs after this one see it."""
    warm = min(warm, max(0, len(steps) - 1))
    predictor.calibrate(steps[:warm], places=WindowPlaces(0, window_steps))
    timed = steps[warm:]
    ahead = window_steps if window_steps > 1 else max(1, len(timed))
    measured: list[float] = []
    predicted: list[float] | None = [] if plans is not None and initial_plan is not None else None
    # the residency carries from step to step: replayed once over the whole run, warm-up steps included
    loads = plan_loads(predictor, plans or {}, initial_plan, steps) if predicted is not None else []
    evicted = 0
    start = 0
    while start < len(timed):
        # a chunk ends where the run's window closes, so each is one window the controller would price ahead
        end = min(len(timed), start + window_steps - (warm + start) % window_steps) if window_steps > 1 else len(timed)
        chunk, before = timed[start:end], steps[warm + start - 1] if warm + start else None
        places = WindowPlaces(warm + start, window_steps)
        measured += predictor.step_prices(chunk, before, places)
        if predicted is not None:
            prices, n = plan_step_prices(predictor, plans or {}, initial_plan, chunk, before, places,
                                         loads[warm + start : warm + end])
            predicted += prices
            evicted += n
        predictor.calibrate(chunk, before, places)
        start = end
    return RunPrices(measured, predicted, evicted, ahead)
