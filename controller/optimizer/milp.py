"""The split MCKP (`problem.py`) as a cvxpy MILP solved by HiGHS: the reference the exact DP is tested against.

Runs inside the controller process (cvxpy imported on first solve, not at import). Never imports torch, runtime or
agent. One boolean per option, exactly one per group; capacity and the link budget as linear constraints with the
problem's exact integers; HiGHS is asked for a zero relative gap so the optimum matches the DP's to 1e-6.
"""

from __future__ import annotations

import time

import numpy as np

from tierplan.controller.optimizer.pricing import link_price
from tierplan.controller.optimizer.problem import (
    InfeasibleError,
    SplitProblem,
    SplitSolution,
    group_arrays,
    make_solution,
    violations,
)


def solve_milp(problem: SplitProblem, time_limit_s: float = 60.0) -> SplitSolution:
    """The optimum by MILP; raises InfeasibleError with the cause, RuntimeError if HiGHS gives no optimum or
    its rounded answer breaks a budget."""
    import cvxpy as cp

    t0 = time.perf_counter()
    problem.check_feasible()
    arrs = group_arrays(problem)
    sizes = [a.units.size for a in arrs]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    units = np.concatenate([a.units for a in arrs]).astype(np.float64)
    cost = np.concatenate([a.cost_ms for a in arrs])
    link = np.concatenate([a.link_bytes for a in arrs])
    x = cp.Variable(int(offsets[-1]), boolean=True)
    rows = np.repeat(np.arange(len(arrs)), sizes)
    one_each = np.zeros((len(arrs), x.size))
    one_each[rows, np.arange(x.size)] = 1.0
    constraints = [one_each @ x == 1, units @ x <= problem.capacity_units]
    if problem.link_budget_bytes_per_step is not None:
        # Bytes are scaled to GB so HiGHS's feasibility tolerance (1e-7 absolute) is not a byte count.
        constraints.append((link / 1e9) @ x <= problem.link_budget_bytes_per_step / 1e9)
    shift = float(sum(a.cost_ms.min() for a in arrs))  # only relative costs matter; keeps the gap test honest
    objective = cp.Minimize(cost @ x - shift)
    prob = cp.Problem(objective, constraints)
    prob.solve(solver=cp.HIGHS, mip_rel_gap=0.0, mip_abs_gap=1e-12, time_limit=time_limit_s,
               mip_feasibility_tolerance=1e-9, primal_feasibility_tolerance=1e-9, output_flag=False)
    if prob.status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        raise InfeasibleError(f"no split fits both the HBM capacity ({problem.capacity_units} units) and the link "
                              f"budget ({problem.link_budget_bytes_per_step} bytes/step)")
    if prob.status != cp.OPTIMAL or x.value is None:
        raise RuntimeError(f"HiGHS returned {prob.status} for the split MILP")
    values = np.asarray(x.value)
    choice = tuple(int(np.argmax(values[offsets[g]:offsets[g + 1]])) for g in range(len(arrs)))
    # HiGHS answers within its tolerances; the rounded choice must keep the exact integer budgets.
    broken = violations(problem, choice)
    if broken:
        raise RuntimeError(f"HiGHS's split MILP answer, rounded to one option per group, breaks a budget: "
                           f"{'; '.join(broken)} (choice {choice})")
    binds = None if problem.link_budget_bytes_per_step is None else \
        link_price(arrs, problem.capacity_units, float(problem.link_budget_bytes_per_step)) > 0.0
    return make_solution(problem, choice, "milp", (time.perf_counter() - t0) * 1e3, "HiGHS MILP, zero gap",
                         link_binds=binds, settle=True)
