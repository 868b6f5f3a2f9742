"""The exact DP against the HiGHS MILP, and both against the budgets; the greedy baseline's known failure."""

from __future__ import annotations

import numpy as np
import pytest

from tests.controller.optimizer_cases import cliff_problem, random_problem
from tierplan.controller.optimizer import (
    Group,
    GroupKind,
    InfeasibleError,
    Option,
    SplitProblem,
    evaluate,
    solve,
    violations,
)
from tierplan.controller.optimizer.dp import solve_dp
from tierplan.controller.optimizer.greedy import fluxmoe_split
from tierplan.controller.optimizer.problem import settle_ties
from tierplan.controller.optimizer.synthetic import BenchShape, bench_problem


def _optimum(problem: SplitProblem, solver: str, **kw: bool) -> float | None:
    try:
        sol = solve_dp(problem, **kw) if solver == "dp" else solve(problem, solver)
    except InfeasibleError:
        return None
    assert not violations(problem, sol.choice), (solver, violations(problem, sol.choice))
    assert evaluate(problem, sol.choice)[0] == pytest.approx(sol.objective_ms)
    if solver == "dp":
        assert sol.solver == "dp", sol.detail  # proven by the DP itself, not handed to the MILP
    return sol.objective_ms


def test_dp_and_milp_agree_on_random_instances() -> None:
    rng = np.random.default_rng(11)
    solved = 0
    for i in range(250):
        problem = random_problem(rng)
        dp, milp = _optimum(problem, "dp", exact=True), _optimum(problem, "milp")
        assert (dp is None) == (milp is None), f"instance {i}: dp={dp} milp={milp}"
        if dp is not None:
            solved += 1
            assert dp == pytest.approx(milp, rel=1e-6, abs=1e-9), f"instance {i}"
    assert solved >= 200


def test_default_dp_certifies_its_gap_when_the_link_binds() -> None:
    """Without exact=True a binding link budget may leave a gap; the bound it reports must hold."""
    rng = np.random.default_rng(5)
    for _ in range(60):
        problem = random_problem(rng)
        try:
            sol = solve_dp(problem)
        except InfeasibleError:
            continue
        best = solve(problem, "milp").objective_ms
        assert not violations(problem, sol.choice)
        assert sol.objective_ms >= best - 1e-9
        assert sol.objective_ms - sol.stats.get("gap_ms", 0.0) <= best + 1e-6 * max(1.0, abs(best))


def test_model_sized_plan_fits_its_budgets() -> None:
    problem = bench_problem(BenchShape(num_layers=6, num_experts=16, link_budget_bytes=None), seed=3)
    sol = solve(problem)
    assert sol.units_used <= problem.capacity_units
    assert sol.objective_ms == pytest.approx(solve(problem, "milp").objective_ms, rel=1e-6)
    tight = bench_problem(BenchShape(num_layers=6, num_experts=16, link_budget_bytes=int(0.9 * sol.link_bytes_used)),
                          seed=3)
    exact = solve_dp(tight, exact=True)
    assert exact.link_bytes_used <= tight.link_budget_bytes_per_step
    assert exact.objective_ms == pytest.approx(solve(tight, "milp").objective_ms, rel=1e-6)


def test_greedy_is_measurably_suboptimal_on_a_cliff() -> None:
    problem = cliff_problem()
    best = solve(problem, "dp")
    greedy = solve(problem, "greedy")
    assert best.choice == (2, 8)  # layer 1 gets past its cliff
    assert greedy.objective_ms >= best.objective_ms * 1.5  # 25 vs 10 ms/step
    assert solve(problem, "milp").objective_ms == pytest.approx(best.objective_ms)


def test_fluxmoe_moves_memory_to_experts_when_loads_dominate() -> None:
    problem = bench_problem(BenchShape(num_layers=4, num_experts=16, link_budget_bytes=None), seed=1)
    starved = fluxmoe_split(problem, compute_ms_per_step=0.01, link_bytes_per_ms=1e6)  # rho << 0.9
    relaxed = fluxmoe_split(problem, compute_ms_per_step=1e6, link_bytes_per_ms=1e6)  # rho >> 1.0
    kv = len(problem.groups) - 1
    assert problem.groups[kv].options[starved.choice[kv]].units <= problem.groups[kv].options[relaxed.choice[kv]].units
    for sol in (starved, relaxed):
        assert not violations(problem, sol.choice)
    assert solve(problem).objective_ms <= min(starved.objective_ms, relaxed.objective_ms) + 1e-9


def test_migration_cost_keeps_a_good_enough_placement() -> None:
    """Moving units costs ms per unit moved (amortised); with a high price, staying put wins."""
    from tierplan.controller.optimizer import Group, Option

    layers = (Group("layer 0", tuple(Option(k, 4.0 - k) for k in range(5)), current=1),
              Group("layer 1", tuple(Option(k, 4.0 - 1.2 * k) for k in range(5)), current=3))
    cheap = SplitProblem(layers, capacity_units=4, unit_bytes=1, migration_ms_per_unit=0.0)
    dear = SplitProblem(layers, capacity_units=4, unit_bytes=1, migration_ms_per_unit=5.0)
    assert solve(cheap).choice == (0, 4)
    assert solve(dear).choice == (1, 3)
    assert solve(dear, "milp").choice == (1, 3)


def test_exchange_polish_never_breaks_a_budget_or_costs_more() -> None:
    from dataclasses import replace

    from tests.controller.optimizer_cases import small_shape
    from tierplan.controller.optimizer.exchange import improve_by_exchange
    from tierplan.controller.optimizer.problem import group_arrays

    improved = 0
    for seed in range(12):
        base = bench_problem(small_shape(batch=8), seed)
        start = solve(base, "greedy")  # a feasible, usually poor split
        problem = replace(base, link_budget_bytes_per_step=start.link_bytes_used)
        choice, moves = improve_by_exchange(group_arrays(problem), start.choice, problem.capacity_units,
                                            float(start.link_bytes_used), lam=1e-8)
        assert not violations(problem, choice)
        objective = evaluate(problem, choice)[0]
        assert objective <= start.objective_ms + 1e-9
        improved += moves > 0 and objective < start.objective_ms - 1e-9
    assert improved >= 6


def test_exchange_refuses_a_cheaper_swap_that_streams_too_much() -> None:
    from tierplan.controller.optimizer import Group, Option
    from tierplan.controller.optimizer.exchange import improve_by_exchange
    from tierplan.controller.optimizer.problem import group_arrays

    hidden = Group("layer 0", tuple(Option(k, 5.0 if k == 0 else 0.0, 400 - 100 * k) for k in range(5)))
    exposed = Group("layer 1", tuple(Option(k, 4.0 - k, 0) for k in range(5)))
    problem = SplitProblem((hidden, exposed), capacity_units=4, unit_bytes=1, link_budget_bytes_per_step=100)
    choice, _ = improve_by_exchange(group_arrays(problem), (3, 1), 4, 100.0, lam=0.0)
    assert not violations(problem, choice)
    assert choice == (3, 1)  # giving layer 1 two of layer 0's slots would save 2 ms but stream 300 bytes
    assert solve(problem).choice == (3, 1) == solve(problem, "milp").choice


def test_milp_refuses_a_rounded_answer_that_breaks_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    import cvxpy as cp

    problem = cliff_problem()
    solve_orig = cp.Problem.solve

    def off_by_tolerance(self: cp.Problem, *args: object, **kwargs: object) -> float:
        out = solve_orig(self, *args, **kwargs)
        (x,) = self.variables()
        bad = np.zeros(x.size)  # every group's largest option: over the capacity, as a loose HiGHS might round
        end = 0
        for g in problem.groups:
            end += len(g.options)
            bad[end - 1] = 1.0
        x.value = bad
        return out

    monkeypatch.setattr(cp.Problem, "solve", off_by_tolerance)
    with pytest.raises(RuntimeError, match="rounded to one option per group, breaks a budget: uses 20 units of 10"):
        solve(problem, "milp")


def test_both_exact_solvers_take_the_fewest_units_among_options_of_one_cost() -> None:
    """A layer whose curve is flat past its union (the LRU fallback's ~1e-11 ms between 3 and 4 slots): the DP and
    the MILP issue the same split, the one that leaves the spare HBM to KV, and never past the link budget."""
    flat = tuple(Option(k, c, link) for k, c, link in ((0, 5.0, 900), (1, 2.0, 400), (2, 3e-11, 10), (3, 0.0, 0),
                                                       (4, 0.0, 0)))
    kv = tuple(Option(k, 4.0 - k, 0) for k in range(4))
    for budget, want in ((None, 2), (5, 3)):  # 10 link bytes of option 2 do not fit a budget of 5
        problem = SplitProblem((Group("layer 0", flat), Group("kv", kv, kind=GroupKind.KV)), capacity_units=6,
                               unit_bytes=1, link_budget_bytes_per_step=budget)
        for solver in ("dp", "milp"):
            sol = solve(problem, solver)
            assert sol.choice[0] == want, (solver, budget, sol.choice)
            assert not violations(problem, sol.choice)
    assert settle_ties(problem, (4, 2)) == (3, 2)  # equal cost, fewer units, the link budget kept
