"""The split optimizer: the HBM split between expert slots and KV blocks as a multiple-choice knapsack.

Runs inside the controller process; pure Python + numpy (+ cvxpy/HiGHS for the MILP, imported on use). Never
imports torch, runtime or agent. `solve(problem, solver=...)` is the entry point the loop uses; `reason` turns
a solution into words for Plan.reason; `SplitHysteresis` decides whether to apply it.
"""

from __future__ import annotations

from enum import StrEnum

from tierplan.controller.optimizer.explain import reason, top_factors
from tierplan.controller.optimizer.hysteresis import Action, HysteresisDecision, HysteresisPolicy, SplitHysteresis
from tierplan.controller.optimizer.problem import (
    Constraint,
    Group,
    GroupKind,
    InfeasibleError,
    Option,
    ProblemError,
    SplitProblem,
    SplitSolution,
    capacity_units_of,
    evaluate,
    units_for_bytes,
    violations,
)


class Solver(StrEnum):
    DP = "dp"
    MILP = "milp"
    GREEDY = "greedy"


def least_link_bytes(problem: SplitProblem) -> int:
    """The fewest link bytes per step any split within the capacity streams (see dp.least_link_bytes)."""
    from tierplan.controller.optimizer.dp import least_link_bytes as _least

    return _least(problem)


def solve(problem: SplitProblem, solver: Solver | str = Solver.DP, exact: bool = False) -> SplitSolution:
    """Solve `problem` with `solver`; raises InfeasibleError (with the cause) or ProblemError (bad solver name).

    `exact` only matters for the DP when the link budget binds with a duality gap (see dp.solve_dp)."""
    try:
        which = Solver(solver)
    except ValueError:
        raise ProblemError(f"solver={solver!r}; expected one of {', '.join(s.value for s in Solver)}") from None
    if which is Solver.DP:
        from tierplan.controller.optimizer.dp import solve_dp

        return solve_dp(problem, exact=exact)
    if which is Solver.MILP:
        from tierplan.controller.optimizer.milp import solve_milp

        return solve_milp(problem)
    from tierplan.controller.optimizer.greedy import solve_greedy

    return solve_greedy(problem)


__all__ = [
    "Action", "Constraint", "Group", "GroupKind", "HysteresisDecision", "HysteresisPolicy", "InfeasibleError",
    "Option", "ProblemError", "Solver", "SplitHysteresis", "SplitProblem", "SplitSolution", "capacity_units_of",
    "evaluate", "least_link_bytes", "reason", "solve", "top_factors", "units_for_bytes", "violations",
]
