"""Hysteresis: a plan holds under noisy curves, switches on a real change, and moves in bounded steps."""

from __future__ import annotations

import dataclasses

import numpy as np

from tests.controller.optimizer_cases import small_shape
from tierplan.controller.optimizer import (
    Action,
    Group,
    HysteresisPolicy,
    Option,
    SplitHysteresis,
    SplitProblem,
    reason,
    solve,
    violations,
)
from tierplan.controller.optimizer.synthetic import bench_problem


def _jittered(base: SplitProblem, rng: np.random.Generator, sigma: float) -> SplitProblem:
    groups = tuple(Group(g.name, tuple(Option(o.units, o.cost_ms * (1 + sigma * rng.standard_normal()),
                                              o.link_bytes, o.label) for o in g.options), g.current, g.kind)
                   for g in base.groups)
    return dataclasses.replace(base, groups=groups)


def test_a_plan_holds_under_noise() -> None:
    base = bench_problem(small_shape(), seed=2)
    rng = np.random.default_rng(0)
    hyst = SplitHysteresis(HysteresisPolicy(rel_margin=0.15))
    current, proposals = None, set()
    for window in range(60):
        problem = _jittered(base, rng, sigma=0.03)
        decision = hyst.decide(problem, current, solve(problem), window)
        proposals.add(solve(problem).choice)
        if window == 0:
            assert decision.action is Action.SWITCH and decision.reason == "first plan"
        else:
            assert decision.action is Action.KEEP, decision.reason
            assert "below the 15% margin" in decision.reason
        current = decision.choice
    assert len(proposals) > 1  # the noise did move the optimum: holding was a decision


def test_a_real_change_switches_and_says_why() -> None:
    small = bench_problem(small_shape(batch=1), seed=2)
    large = bench_problem(small_shape(batch=64), seed=2)
    hyst = SplitHysteresis()
    first = hyst.decide(small, None, solve(small), 0)
    decision = hyst.decide(large, first.choice, solve(large), 1)
    assert decision.action is Action.SWITCH
    assert "above the 15% margin" in decision.reason and decision.rel_gain >= 0.15


def test_cooldown_holds_then_releases() -> None:
    a = bench_problem(small_shape(batch=1), seed=1)
    b = bench_problem(small_shape(batch=64), seed=1)
    hyst = SplitHysteresis(HysteresisPolicy(cooldown_windows=3))
    current = hyst.decide(a, None, solve(a), 0).choice
    held = hyst.decide(b, current, solve(b), 2)
    assert held.action is Action.KEEP and "cooldown" in held.reason
    assert hyst.decide(b, current, solve(b), 3).action is Action.SWITCH


def test_bounded_steps_stay_within_budget_and_converge() -> None:
    a = bench_problem(small_shape(batch=1), seed=4)
    b = bench_problem(small_shape(batch=64), seed=4)
    hyst = SplitHysteresis(HysteresisPolicy(rel_margin=0.0, max_units_per_plan=8))
    current = solve(a).choice
    target = solve(b)
    steps = 0
    for window in range(1, 200):
        decision = hyst.decide(b, current, target, window)
        if decision.action is Action.KEEP:
            break
        assert not violations(b, decision.choice)
        current, steps = decision.choice, steps + 1
        if decision.action is Action.SWITCH:
            break
        assert "moving" in decision.reason and "step limit 8" in decision.reason
    assert steps > 1


def test_a_split_that_no_longer_fits_is_replaced_at_once() -> None:
    roomy = SplitProblem((Group("layer 0", tuple(Option(k, 5.0 - k) for k in range(5))),), 4, 1)
    tight = SplitProblem(roomy.groups, 2, 1)
    hyst = SplitHysteresis(HysteresisPolicy(cooldown_windows=10))
    current = hyst.decide(roomy, None, solve(roomy), 0).choice
    decision = hyst.decide(tight, current, solve(tight), 1)
    assert decision.action is Action.SWITCH and "no longer fits" in decision.reason
    assert not violations(tight, decision.choice)
    assert "expected stall" in reason(tight, solve(tight))


def test_a_link_budget_at_its_floor_ranks_but_forces_no_switch() -> None:
    """Where no split meets the link, the budget is the least any split streams: the split in force a hair over
    it (the floor follows the curves) is held unless the gain clears the margin; over a real budget, it goes."""
    group = Group("layer 0", (Option(1, 10.0, 100), Option(2, 9.9, 101), Option(3, 9.95, 99)))
    floor = SplitProblem((group,), 3, 1, link_budget_bytes_per_step=99, link_budget_is_floor=True)
    hyst = SplitHysteresis()
    current = (1,)  # streams 101 > 99
    decision = hyst.decide(floor, current, solve(floor), 1)
    assert decision.action is Action.KEEP and not decision.forced, decision.reason
    assert "below the 15% margin" in decision.reason
    real = SplitProblem((group,), 3, 1, link_budget_bytes_per_step=99)
    decision = SplitHysteresis().decide(real, current, solve(real), 1)
    assert decision.action is Action.SWITCH and decision.forced and "streams 101 bytes/step" in decision.reason
