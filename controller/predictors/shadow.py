"""Shadow evaluation: a candidate demand predictor runs beside the active one and is promoted only when better.

Runs in the controller. Both predictors see the same stream; before each position is observed, both score it
and their log-losses on the demanded set are accumulated per window of `window_steps` steps. When the
shadow predictor's loss beats the active one's by at least `min_gain` (relative) in each of the last
`windows_required` completed windows, the two swap roles (a promotion; a later regression swaps them back the
same way), so one lucky window never changes what the agents run. Only the active predictor's scores leave
this object. Never imports torch, runtime or agent.

Shape letters: E experts per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierplan.controller.predictors.base import DemandPredictor

_EPS = 1e-6


@dataclass(frozen=True)
class WindowScore:
    window: int
    active: str
    active_loss: float
    shadow: str
    shadow_loss: float


@dataclass(frozen=True)
class Promotion:
    window: int
    promoted: str
    demoted: str


def log_loss(probs: np.ndarray, demanded: np.ndarray) -> float:
    """Mean binary cross-entropy of [E] probabilities against the demanded ids."""
    y = np.zeros(probs.shape[0])
    y[demanded] = 1.0
    p = np.clip(probs, _EPS, 1.0 - _EPS)
    return float(-(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)).mean())


class ShadowEvaluator:
    """A DemandPredictor that serves `active`'s scores and promotes `shadow` when it wins recent windows."""

    name = "shadow"

    def __init__(self, active: DemandPredictor, shadow: DemandPredictor, window_steps: int = 64,
                 windows_required: int = 3, min_gain: float = 0.01) -> None:
        if window_steps < 1 or windows_required < 1 or min_gain < 0:
            raise ValueError(f"shadow: need window_steps, windows_required >= 1 and min_gain >= 0, got "
                             f"{window_steps}, {windows_required}, {min_gain}")
        self.active, self.shadow = active, shadow
        self.window_steps, self.windows_required, self.min_gain = window_steps, windows_required, min_gain
        self.version = 1

    def reset(self, num_layers: int, num_experts: int) -> None:
        self.active.reset(num_layers, num_experts)
        self.shadow.reset(num_layers, num_experts)
        self.history: list[WindowScore] = []
        self.promotions: list[Promotion] = []
        self._window = 0
        self._sums = [0.0, 0.0]  # active, shadow
        self._count = 0

    def _close_window(self) -> None:
        if self._count:
            a, s = (x / self._count for x in self._sums)
            self.history.append(WindowScore(self._window, self.active.name, a, self.shadow.name, s))
            recent = self.history[-self.windows_required:]
            if len(recent) == self.windows_required and all(
                    w.active == self.active.name and w.shadow_loss < w.active_loss * (1.0 - self.min_gain)
                    for w in recent):
                self.promotions.append(Promotion(self._window, self.shadow.name, self.active.name))
                self.active, self.shadow = self.shadow, self.active
                self.version += 1
        self._sums, self._count = [0.0, 0.0], 0

    def observe(self, step: int, layer: int, expert_ids: np.ndarray) -> None:
        window = step // self.window_steps
        if window != self._window:
            self._close_window()
            self._window = window
        ids = np.asarray(expert_ids, np.int64)
        ids = ids[ids >= 0]
        for i, model in enumerate((self.active, self.shadow)):
            self._sums[i] += log_loss(model.scores(step, layer), ids)
        self._count += 1
        self.active.observe(step, layer, ids)
        self.shadow.observe(step, layer, ids)

    def scores(self, step: int, layer: int) -> np.ndarray:
        return self.active.scores(step, layer)
