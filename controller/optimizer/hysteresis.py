"""Hysteresis for split plans: keep today's split unless a new one is clearly better, move in bounded steps.

Runs inside the controller process; pure Python. Never imports torch, runtime or agent. `SplitHysteresis`
keeps one number of state (the window of the last switch) and decides, in words, whether the loop should
apply a freshly solved split:
- no current split, or the current one no longer fits the (new) budgets: switch now (a budget is a promise);
  a link budget at its floor (no split meets the link) only ranks, so streaming over it forces nothing;
- inside the cooldown after a switch: keep;
- relative gain below the margin (MoE-Infinity uses 0.15): keep; noise in the curves moves the optimum around
  but rarely by 15%;
- more units to move than `max_units_per_plan`: step part of the way (every group moves the same fraction of
  its change, rounded so the partial split still fits), and say how far;
- otherwise switch.
Gains compare the current split's cost with the new split's objective, which already charges migration.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from tierplan.controller.optimizer.problem import SplitProblem, SplitSolution, evaluate, group_arrays, violations


class Action(StrEnum):
    KEEP = "keep"
    SWITCH = "switch"
    STEP = "step"  # move part of the way to the new split


@dataclass(frozen=True)
class HysteresisPolicy:
    rel_margin: float = 0.15
    max_units_per_plan: int | None = None
    cooldown_windows: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rel_margin < 1:
            raise ValueError(f"rel_margin={self.rel_margin}, expected 0 <= margin < 1")
        if self.max_units_per_plan is not None and self.max_units_per_plan < 1:
            raise ValueError(f"max_units_per_plan={self.max_units_per_plan}, expected >= 1 or None")
        if self.cooldown_windows < 0:
            raise ValueError(f"cooldown_windows={self.cooldown_windows}, expected >= 0")


@dataclass(frozen=True)
class HysteresisDecision:
    action: Action
    choice: tuple[int, ...]  # the split to apply (the current one on KEEP)
    reason: str
    gain_ms: float  # current cost - new objective (per step); 0 when there was no current split
    rel_gain: float
    # The switch is owed whatever it saves: no current split, or the current one breaks the problem's budgets
    # (a budget is a promise). A caller's own keep rule (a floor on the gain) must not hold such a split.
    forced: bool = False


class SplitHysteresis:
    """Decides whether to apply a new split (module docstring). One per controlled GPU budget."""

    def __init__(self, policy: HysteresisPolicy | None = None) -> None:
        self.policy = policy or HysteresisPolicy()
        self.last_switch_window: int | None = None

    def decide(self, problem: SplitProblem, current: tuple[int, ...] | None, proposed: SplitSolution,
               window: int) -> HysteresisDecision:
        p = self.policy
        if current is None:
            return self._switch(proposed.choice, window, "first plan", 0.0, 0.0, forced=True)
        # A flagged link budget only ranks (no split leaves the cap room, valuation.assemble, which then sets
        # none): the split in force over it is no broken promise, and forcing a switch there moved the split
        # every window (H200 phase run 37, b32 16K 24 GiB, 18 plans of one slot each). The gain decides.
        binding_link = not problem.link_budget_is_floor
        broken = violations(problem, current, link_budget=binding_link)
        if broken:
            return self._switch(proposed.choice, window, f"current split no longer fits ({'; '.join(broken)})",
                                0.0, 0.0, forced=True)
        current_ms = evaluate(problem, current)[0]
        gain = current_ms - proposed.objective_ms
        rel = gain / current_ms if current_ms > 0 else (0.0 if gain <= 0 else 1.0)
        since = None if self.last_switch_window is None else window - self.last_switch_window
        if since is not None and since < p.cooldown_windows:
            return HysteresisDecision(Action.KEEP, current, f"cooldown: last change {since} window(s) ago "
                                      f"(waits {p.cooldown_windows})", gain, rel)
        if rel < p.rel_margin or gain <= 0:
            return HysteresisDecision(Action.KEEP, current, f"new split saves {gain:.3g} ms/step ({100 * rel:.1f}%), "
                                      f"below the {100 * p.rel_margin:.0f}% margin", gain, rel)
        moved = _units_moved(problem, current, proposed.choice)
        if p.max_units_per_plan is not None and moved > p.max_units_per_plan:
            partial = _partial(problem, current, proposed.choice, p.max_units_per_plan / moved)
            if partial != current and not violations(problem, partial, link_budget=binding_link):
                part_moved = _units_moved(problem, current, partial)
                return self._switch(partial, window, f"new split saves {gain:.3g} ms/step ({100 * rel:.1f}%); "
                                    f"moving {part_moved} of {moved} units this plan (step limit "
                                    f"{p.max_units_per_plan})", gain, rel, Action.STEP)
        return self._switch(proposed.choice, window, f"new split saves {gain:.3g} ms/step ({100 * rel:.1f}%), "
                            f"above the {100 * p.rel_margin:.0f}% margin", gain, rel)

    def _switch(self, choice: tuple[int, ...], window: int, reason: str, gain: float, rel: float,
                action: Action = Action.SWITCH, forced: bool = False) -> HysteresisDecision:
        self.last_switch_window = window
        return HysteresisDecision(action, choice, reason, gain, rel, forced)


def _units_moved(problem: SplitProblem, a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return sum(abs(g.options[i].units - g.options[j].units) for g, i, j in zip(problem.groups, a, b, strict=True))


def _partial(problem: SplitProblem, current: tuple[int, ...], target: tuple[int, ...],
             frac: float) -> tuple[int, ...]:
    """Each group moves `frac` of its unit change, landing at or below its goal (growth rounded down, shrinking
    rounded past), so the total stays within the capacity both ends fit."""
    out = []
    for a, i, j in zip(group_arrays(problem), current, target, strict=True):
        u0, u1 = int(a.units[i]), int(a.units[j])
        if u0 == u1:
            out.append(i)
            continue
        goal = u0 + frac * (u1 - u0)
        ok = (a.units >= min(u0, u1)) & (a.units <= max(u0, u1)) & (a.units <= goal)  # u0 or u1 always qualifies
        ks = np.flatnonzero(ok)
        out.append(int(ks[np.lexsort((a.cost_ms[ks], -a.units[ks]))[0]]))  # most units, then cheapest
    return tuple(out)
