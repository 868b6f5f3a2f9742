"""Shadow evaluation of the forecast's curve source: the policy's `shadow_predictor` scored beside `predictor`.

Runs in the controller process, fed by `Controller.sync_from` before each window is learned from. Both curve
sources (`CurveSource`) forecast the expert loads per step the applied split will see; the window then says
how many it saw (its misses plus the useful local prefetches, per step). Each source's absolute error is kept
per window. With `auto_promote`, the shadow replaces the active source once it beats it by `min_gain`
(relative) in each of the last `windows_required` scored windows (a later regression swaps them back the same
way), so one lucky window never changes the plans; without it the scores are only reported (in the plan's
reason and the controller's stats). Never imports torch, runtime or agent.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierplan.controller.demand import CurveSource, DemandModel
from tierplan.controller.protocol import Telemetry


@dataclass(frozen=True)
class ShadowScore:
    window: int
    active: CurveSource
    active_error: float  # |predicted - measured| expert loads per step at the applied split
    shadow: CurveSource
    shadow_error: float


class CurveShadow:
    """See the module docstring; `active` is the source the controller plans with."""

    def __init__(self, active: CurveSource, shadow: CurveSource, auto_promote: bool, windows_required: int = 3,
                 min_gain: float = 0.05, max_history: int = 64) -> None:
        if active is shadow:
            raise ValueError(f"CurveShadow: the shadow source {shadow.value!r} is already the active one")
        if windows_required < 1 or min_gain < 0:
            raise ValueError(f"CurveShadow: need windows_required >= 1 and min_gain >= 0, got {windows_required}, "
                             f"{min_gain}")
        self.active, self.shadow, self.auto_promote = active, shadow, auto_promote
        self.windows_required, self.min_gain, self.max_history = windows_required, min_gain, max_history
        self.history: list[ShadowScore] = []
        self.promotions: list[tuple[int, CurveSource]] = []  # (window, promoted source)

    @staticmethod
    def _predicted(demand: DemandModel, source: CurveSource, slots: tuple[int, ...]) -> float:
        fc = demand.forecast(source)
        return sum(fc.misses_per_step[m][s] for m, s in enumerate(slots))

    def score(self, demand: DemandModel, slots: tuple[int, ...] | None, tel: Telemetry) -> ShadowScore | None:
        """Score both sources on `tel` before `demand` learns from it; None without an applied split or steps."""
        num_steps = tel.step_timings_ms.num_steps
        if slots is None or num_steps == 0:
            return None
        useful = tel.local_prefetch.useful if tel.local_prefetch is not None else 0
        measured = (tel.expert_misses + useful) / num_steps
        rec = ShadowScore(demand.num_windows, self.active, abs(self._predicted(demand, self.active, slots) - measured),
                          self.shadow, abs(self._predicted(demand, self.shadow, slots) - measured))
        self.history = [*self.history[-(self.max_history - 1):], rec]
        recent = self.history[-self.windows_required:]
        wins = len(recent) == self.windows_required and all(
            w.active is self.active and w.shadow_error < w.active_error * (1.0 - self.min_gain) for w in recent)
        if wins and self.auto_promote:
            self.active, self.shadow = self.shadow, self.active
            self.promotions.append((rec.window, self.active))
        return rec

    def describe(self) -> str:
        """The scores in words, for a plan's reason."""
        recent = self.history[-self.windows_required:]
        if not recent:
            return f"shadow {self.shadow.value}: not scored yet"
        act = sum(w.active_error for w in recent) / len(recent)
        sha = sum(w.shadow_error for w in recent) / len(recent)
        mode = "auto-promote" if self.auto_promote else "report only"
        return (f"shadow {self.shadow.value} vs active {self.active.value}: {sha:.3g} vs {act:.3g} loads/step error "
                f"over {len(recent)} window(s) ({mode}, {len(self.promotions)} promotion(s))")
