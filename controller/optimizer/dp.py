"""Exact dynamic-programming solver for the split MCKP (`problem.py`): the controller's fast path.

Runs inside the controller process; pure numpy. Never imports torch, runtime or agent; never mutates the problem.

How it is exact with two constraints (HBM units and the per-step link budget):
- The DP runs over capacity only (vectorised over 0..C, one table per group, kept for backtracking); the
  link budget enters as a Lagrangian price: option weight = cost_ms + lam * link_bytes.
- lam = 0 first in spirit: without a link budget, or when the lam that a cheap coarse DP finds is 0 and the
  answer streams within budget, one pass is optimal (the Lagrangian bound equals the answer).
- Otherwise lam comes from a secant search on the dual over a coarse copy (units rounded up to q, so its
  answers are feasible in the fine problem too), the fine tables are built once at that lam, and the
  duality gap is closed by a depth-first branch and bound whose bound at every node is
  (cost so far) + (fine Lagrangian table of the remaining groups) - lam * (link budget left): any lam >= 0
  gives a valid bound, so the search is exact whatever lam is. A node limit hands the rest to the MILP
  (recorded in the solution's `detail` and `stats`, never silent).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from controller.optimizer.problem import (
    GroupArrays,
    InfeasibleError,
    SplitProblem,
    SplitSolution,
    group_arrays,
    make_solution,
)

COARSE_STATES = 384  # capacity states of the coarse copy that prices the link budget
REL_TOL = 1e-9  # optimality tolerance (relative): well inside the 1e-6 the solvers must agree to
NODE_LIMIT = 20_000


class _NodeLimit(Exception):
    pass


def _group_step(prev: np.ndarray, units: np.ndarray, weight: np.ndarray, n: int) -> np.ndarray:
    """new[c] = min_j weight_j + prev[min(c - units_j, len(prev) - 1)] over units_j <= c, for c < n."""
    m = prev.size
    ext = prev if n <= m else np.concatenate([prev, np.full(n - m, prev[-1])])  # capacity beyond need: flat
    umin, umax = int(units.min()), int(units.max())
    span = umax - umin + 1
    new = np.full(n, np.inf)
    if umin >= n:
        return new
    if span <= 4 * units.size:  # dense (an MoE layer's 0..E slots): one sliding-window min
        dense = np.full(span, np.inf)
        np.minimum.at(dense, units - umin, weight)
        padded = np.concatenate([np.full(span - 1, np.inf), ext[: n - umin]])
        windows = sliding_window_view(padded, span)  # [n - umin, span]
        new[umin:] = (windows + dense[::-1]).min(axis=1)
        return new
    for u, w in zip(units.tolist(), weight.tolist(), strict=True):
        if u < n:
            np.minimum(new[u:], ext[: n - u] + w, out=new[u:])
    return new


def _tables(arrs: list[GroupArrays], units: list[np.ndarray], lam: float, capacity: int) -> list[np.ndarray]:
    """Backward tables: T[g][c] = min Lagrangian weight of groups g.. with <= c units (flat past len - 1)."""
    tables: list[np.ndarray] = [np.zeros(1)]
    need = 0
    for a, u in zip(reversed(arrs), reversed(units), strict=True):
        need += int(u.max())
        weight = a.cost_ms + lam * a.link_bytes if lam else a.cost_ms
        tables.append(_group_step(tables[-1], u, weight, min(capacity, need) + 1))
    tables.reverse()
    return tables


def _backtrack(arrs: list[GroupArrays], units: list[np.ndarray], tables: list[np.ndarray], lam: float,
               capacity: int) -> tuple[int, ...] | None:
    if not math.isfinite(tables[0][min(capacity, tables[0].size - 1)]):
        return None
    choice, c = [], capacity
    for g, (a, u) in enumerate(zip(arrs, units, strict=True)):
        prev = tables[g + 1]
        weight = a.cost_ms + lam * a.link_bytes if lam else a.cost_ms
        rem = c - u
        vals = np.where(rem >= 0, weight + prev[np.clip(rem, 0, prev.size - 1)], np.inf)
        j = int(np.argmin(vals))
        choice.append(j)
        c -= int(u[j])
    return tuple(choice)


@dataclass
class _Eval:
    lam: float
    choice: tuple[int, ...]
    cost_ms: float
    link_bytes: float


def _evaluate(arrs: list[GroupArrays], choice: tuple[int, ...]) -> tuple[float, float]:
    cost = sum(float(a.cost_ms[j]) for a, j in zip(arrs, choice, strict=True))
    link = sum(float(a.link_bytes[j]) for a, j in zip(arrs, choice, strict=True))
    return cost, link


def _price_link(arrs: list[GroupArrays], capacity: int, budget: float) -> tuple[float, list[_Eval], int]:
    """Secant search for the dual price of the link budget on a coarse copy; returns (lam, feasible, passes)."""
    q = max(1, math.ceil(capacity / COARSE_STATES))
    units = [-(-a.units // q) for a in arrs]
    cap = capacity // q
    passes = 0

    def at(lam: float) -> _Eval | None:
        nonlocal passes
        passes += 1
        tables = _tables(arrs, units, lam, cap)
        choice = _backtrack(arrs, units, tables, lam, cap)
        if choice is None:
            return None
        return _Eval(lam, choice, *_evaluate(arrs, choice))

    lo = at(0.0)
    if lo is None:  # rounding up made the coarse copy infeasible: price the link at 0 and let the search work
        return 0.0, [], passes
    if lo.link_bytes <= budget:
        return 0.0, [lo], passes
    spread = sum(float(a.cost_ms.max() - a.cost_ms.min()) for a in arrs) + 1e-12
    lam = spread / max(lo.link_bytes - budget, 1.0)
    hi = None
    for _ in range(64):
        e = at(lam)
        if e is not None and e.link_bytes <= budget:
            hi = e
            break
        if e is not None:
            lo = e
        lam *= 4.0
    if hi is None:
        return lam, [], passes
    for _ in range(24):
        lam = (hi.cost_ms - lo.cost_ms) / (lo.link_bytes - hi.link_bytes)
        line = lo.cost_ms + lam * lo.link_bytes
        e = at(lam)
        if e is None:
            break
        if e.cost_ms + lam * e.link_bytes >= line - REL_TOL * max(1.0, abs(line)):
            break  # no choice beats both ends at this price: lam maximises the coarse dual
        if e.link_bytes <= budget:
            hi = e
        else:
            lo = e
    return lam, [hi], passes


class _Search:
    """Depth-first branch and bound over groups, children in bound order, bounded by the Lagrangian tables."""

    def __init__(self, arrs: list[GroupArrays], tables: list[np.ndarray], lam: float, budget: float,
                 best: tuple[int, ...] | None, best_cost: float) -> None:
        self.arrs, self.tables, self.lam, self.budget = arrs, tables, lam, budget
        self.best, self.ub = best, best_cost
        self.min_link_after = np.concatenate([np.cumsum([a.link_bytes.min() for a in arrs][::-1])[::-1], [0.0]])
        self.nodes = 0
        self.path: list[int] = []

    def _cut(self) -> float:
        return self.ub - REL_TOL * max(1.0, abs(self.ub)) if math.isfinite(self.ub) else math.inf

    def run(self, capacity: int) -> None:
        self._node(0, capacity, 0.0, 0.0)

    def _node(self, g: int, c: int, link: float, cost: float) -> None:
        self.nodes += 1
        if self.nodes > NODE_LIMIT:
            raise _NodeLimit
        a = self.arrs[g]
        rem = c - a.units
        new_link = link + a.link_bytes
        ok = (rem >= 0) & (new_link + self.min_link_after[g + 1] <= self.budget)
        if g == len(self.arrs) - 1:
            total = np.where(ok, cost + a.cost_ms, np.inf)
            j = int(np.argmin(total))
            if total[j] < self._cut():
                self.ub, self.best = float(total[j]), (*self.path, j)
            return
        prev = self.tables[g + 1]
        bound = cost + a.cost_ms + prev[np.clip(rem, 0, prev.size - 1)] - self.lam * (self.budget - new_link)
        bound = np.where(ok, bound, np.inf)
        for j in np.argsort(bound, kind="stable").tolist():
            if not bound[j] < self._cut():
                break
            self.path.append(j)
            self._node(g + 1, c - int(a.units[j]), float(new_link[j]), cost + float(a.cost_ms[j]))
            self.path.pop()


def solve_dp(problem: SplitProblem) -> SplitSolution:
    """The exact optimum of `problem` (see the module docstring); raises InfeasibleError with the cause."""
    t0 = time.perf_counter()
    problem.check_feasible()
    arrs = group_arrays(problem)
    units = [a.units for a in arrs]
    capacity = problem.capacity_units
    budget = problem.link_budget_bytes_per_step
    stats: dict[str, float] = {}
    if budget is None:
        tables = _tables(arrs, units, 0.0, capacity)
        choice = _backtrack(arrs, units, tables, 0.0, capacity)
        assert choice is not None  # check_feasible guarantees a capacity-feasible choice
        return make_solution(problem, choice, "dp", _ms(t0), "one DP pass (no link budget)", {"passes": 1})

    lam, feasible, passes = _price_link(arrs, capacity, float(budget))
    tables = _tables(arrs, units, lam, capacity)
    stats.update(lam_ms_per_byte=lam, coarse_passes=passes, passes=1)
    lower = float(tables[0][min(capacity, tables[0].size - 1)]) - lam * budget
    candidates = [e.choice for e in feasible]
    choice = _backtrack(arrs, units, tables, lam, capacity)
    if choice is not None:
        candidates.append(choice)
    best, best_cost = None, math.inf
    for cand in candidates:
        cost, link = _evaluate(arrs, cand)
        if link <= budget and sum(int(u[j]) for u, j in zip(units, cand, strict=True)) <= capacity and \
                cost < best_cost:
            best, best_cost = cand, cost
    if best is not None and best_cost - lower <= REL_TOL * max(1.0, abs(best_cost)):
        detail = f"Lagrangian optimum at lam={lam:.3g} ms/byte (no duality gap)"
        return make_solution(problem, best, "dp", _ms(t0), detail, stats)
    search = _Search(arrs, tables, lam, float(budget), best, best_cost)
    try:
        search.run(capacity)
    except _NodeLimit:
        from controller.optimizer.milp import solve_milp

        sol = solve_milp(problem)
        stats.update(search_nodes=search.nodes, fallback_milp=1)
        detail = f"search passed {NODE_LIMIT} nodes; MILP finished it"
        return make_solution(problem, sol.choice, "dp+milp", _ms(t0), detail, stats)
    stats["search_nodes"] = search.nodes
    if search.best is None:
        raise InfeasibleError("no split fits both the HBM capacity and the link budget: every choice that fits "
                              f"{capacity} units streams more than {budget} bytes/step")
    gap = search.ub - lower
    detail = f"Lagrangian bound at lam={lam:.3g} ms/byte, gap {gap:.3g} ms closed by search ({search.nodes} nodes)"
    return make_solution(problem, search.best, "dp", _ms(t0), detail, stats)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
