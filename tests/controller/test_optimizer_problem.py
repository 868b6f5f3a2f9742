"""Malformed and infeasible split problems are refused with a reason that names the cause."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from tierplan.controller.optimizer import (
    Group,
    InfeasibleError,
    Option,
    ProblemError,
    SplitProblem,
    capacity_units_of,
    solve,
    units_for_bytes,
)

SOLVERS = ["dp", "milp", "greedy"]


def _group(name: str = "layer 0", n: int = 3) -> Group:
    return Group(name, tuple(Option(k, 3.0 - k, 100 * (n - k)) for k in range(n)))


@pytest.mark.parametrize(("make", "words"), [
    (lambda: SplitProblem((), 4, 1), "no groups"),
    (lambda: Group("layer 0", ()), "no options"),
    (lambda: Group("layer 0", (Option(-1, 1.0),)), "units=-1"),
    (lambda: Group("layer 0", (Option(1, math.nan),)), "cost_ms=nan"),
    (lambda: Group("layer 0", (Option(1, math.inf),)), "cost_ms=inf"),
    (lambda: Group("layer 0", (Option(1, 1.0, -5),)), "link_bytes=-5"),
    (lambda: Group("layer 0", (Option(1, 1.0),), current=3), "current=3"),
    (lambda: Group("", (Option(1, 1.0),)), "name"),
    (lambda: SplitProblem((_group("a"), _group("a")), 4, 1), "repeat"),
    (lambda: SplitProblem((_group(),), -1, 1), "capacity_units=-1"),
    (lambda: SplitProblem((_group(),), 4, 0), "unit_bytes=0"),
    (lambda: SplitProblem((_group(),), 4, 1, -3), "link_budget_bytes_per_step=-3"),
    (lambda: SplitProblem((_group(),), 4, 1, None, math.nan), "migration_ms_per_unit"),
    (lambda: Group.from_arrays("layer 0", np.arange(3), np.zeros(2)), "one length"),
])
def test_malformed_problems_are_refused(make: Callable[[], object], words: str) -> None:
    with pytest.raises(ProblemError, match=words):
        make()


@pytest.mark.parametrize("solver", SOLVERS)
def test_capacity_below_the_smallest_options_is_infeasible(solver: str) -> None:
    big = Group("kv", (Option(5, 1.0), Option(7, 0.5)))
    problem = SplitProblem((_group(), big), capacity_units=4, unit_bytes=1)
    with pytest.raises(InfeasibleError, match=r"capacity 4 units .* 5 units .* group 'kv'"):
        solve(problem, solver)


@pytest.mark.parametrize("solver", ["dp", "milp"])
def test_link_budget_below_what_must_stream_is_infeasible(solver: str) -> None:
    problem = SplitProblem((_group(n=3),), capacity_units=10, unit_bytes=1, link_budget_bytes_per_step=50)
    with pytest.raises(InfeasibleError, match="link budget 50 bytes/step"):
        solve(problem, solver)


def test_the_greedy_keeps_its_split_over_a_link_budget_and_names_the_overage() -> None:
    # WiSP's allocator has no link budget: ours only ranks its steps by it. Unreachable (50 < 100 even with
    # every slot) or reachable only by a split the greedy does not find (A's 3 units, not B's 2), the greedy
    # answers its split within the HBM capacity and says by how much it streams over the budget.
    unreachable = SplitProblem((_group(n=3),), capacity_units=10, unit_bytes=1, link_budget_bytes_per_step=50)
    sol = solve(unreachable, "greedy")
    assert sol.units_used <= 10 and sol.link_bytes_used == 100
    assert "50 over the link budget of 50" in sol.detail
    a = Group("A", (Option(0, 2.0, 100), Option(3, 1.0, 0)))
    b = Group("B", (Option(0, 2.0, 100), Option(1, 1.5, 60), Option(2, 1.2, 30)))
    missed = SplitProblem((a, b), capacity_units=3, unit_bytes=1, link_budget_bytes_per_step=100)
    assert solve(missed, "dp").link_bytes_used == 100  # the budget is reachable ...
    greedy = solve(missed, "greedy")  # ... but not by the greedy's link-per-unit ranking
    assert greedy.units_used <= 3 and greedy.link_bytes_used == 130
    assert "30 over the link budget of 100" in greedy.detail


@pytest.mark.parametrize("solver", ["dp", "milp"])
def test_constraints_that_only_clash_together_are_infeasible(solver: str) -> None:
    # Each group alone can meet either budget, but cutting its streaming costs HBM the other one needs.
    g = tuple(Group(f"layer {i}", (Option(0, 2.0, 100), Option(3, 1.0, 0))) for i in range(2))
    problem = SplitProblem(g, capacity_units=3, unit_bytes=1, link_budget_bytes_per_step=50)
    with pytest.raises(InfeasibleError, match="link budget"):
        solve(problem, solver)


def test_unknown_solver_is_refused_by_name() -> None:
    with pytest.raises(ProblemError, match="'simplex'"):
        solve(SplitProblem((_group(),), 4, 1), "simplex")


def test_byte_budgets_round_toward_safety() -> None:
    assert units_for_bytes(10, 4) == 3  # KV options round UP: never more bytes than the units say
    assert capacity_units_of(100, 30, 10, 7) == 8  # capacity rounds DOWN: 60 bytes hold 8 whole units
    with pytest.raises(InfeasibleError, match="dense weights"):
        capacity_units_of(100, 90, 20, 1)


def test_least_link_is_the_exact_floor_of_the_link_budget() -> None:
    from tierplan.controller.optimizer import least_link_bytes

    g = tuple(Group(f"layer {i}", (Option(0, 2.0, 100), Option(3, 1.0, 0))) for i in range(2))
    problem = SplitProblem(g, capacity_units=3, unit_bytes=1, link_budget_bytes_per_step=100)
    assert least_link_bytes(problem) == 100  # only one layer can be made resident
    assert solve(problem).link_bytes_used == 100
    with pytest.raises(InfeasibleError):
        solve(SplitProblem(g, 3, 1, link_budget_bytes_per_step=99))


def test_the_least_link_shortcut_equals_the_dp_pass() -> None:
    """Where every group's own least fits the capacity together, `least_link_bytes` sums them; elsewhere it runs
    the DP. On random problems on both sides of that line, it equals the DP pass alone."""
    from tierplan.controller.optimizer import least_link_bytes
    from tierplan.controller.optimizer.dp import least_link_bytes_dp

    rng = np.random.default_rng(7)
    summed = 0
    for _ in range(60):
        groups = []
        for i in range(int(rng.integers(1, 5))):
            units = sorted({int(u) for u in rng.integers(0, 6, size=int(rng.integers(1, 5)))})
            groups.append(Group(f"g{i}", tuple(Option(u, float(rng.random()), int(rng.integers(0, 50)))
                                               for u in units)))
        capacity = int(rng.integers(sum(min(o.units for o in g.options) for g in groups), 20))
        problem = SplitProblem(tuple(groups), capacity_units=capacity, unit_bytes=1)
        least = [min(g.options, key=lambda o: (o.link_bytes, o.units)) for g in groups]
        summed += sum(o.units for o in least) <= capacity
        assert least_link_bytes(problem) == least_link_bytes_dp(problem), problem
    assert 0 < summed < 60  # both branches were taken
