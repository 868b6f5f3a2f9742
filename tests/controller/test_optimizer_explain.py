"""Plan reasons name the factors a user would check: who got the slots, cliffs, KV, binding budgets."""

from __future__ import annotations

from dataclasses import replace

from tests.controller.optimizer_cases import cliff_problem, small_shape
from tierplan.controller.optimizer import reason, solve, top_factors
from tierplan.controller.optimizer.synthetic import bench_problem


def test_a_cliff_is_named() -> None:
    problem = cliff_problem()
    sol = solve(problem)
    factors = top_factors(problem, sol)
    assert factors[0].startswith("layer 1 gets 8 slots (saves 19 ms/step vs none resident")
    assert "drops 19 ms at 8 slots: a cliff" in factors[0]


def test_budgets_and_kv_appear_in_the_reason() -> None:
    problem = bench_problem(small_shape(), seed=0)
    loose = solve(problem)
    tight = replace(problem, link_budget_bytes_per_step=int(0.8 * loose.link_bytes_used))
    text = reason(tight, solve(tight, exact=True))
    assert "link budget binding" in text
    assert "kv keeps" in reason(problem, loose)
    assert "HBM full" in reason(problem, loose)
