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


@dataclass(frozen=True)
class _Layout:
    """A group's options grouped by (possibly rounded) unit count, for building its dense weight vector."""

    units: np.ndarray  # [J] int64, per option
    order: np.ndarray  # [J] options sorted by units
    starts: np.ndarray  # [U] first sorted position of each distinct unit count
    distinct: np.ndarray  # [U] int64, the distinct unit counts, ascending

    @classmethod
    def of(cls, units: np.ndarray) -> _Layout:
        order = np.argsort(units, kind="stable")
        sorted_units = units[order]
        starts = np.flatnonzero(np.concatenate([[True], sorted_units[1:] != sorted_units[:-1]]))
        return cls(units, order, starts, sorted_units[starts])


def _group_step(prev: np.ndarray, lay: _Layout, weight: np.ndarray, n: int) -> np.ndarray:
    """new[c] = min_j weight_j + prev[min(c - units_j, len(prev) - 1)] over units_j <= c, for c < n."""
    m = prev.size
    ext = prev if n <= m else np.concatenate([prev, np.full(n - m, prev[-1])])  # capacity beyond need: flat
    best = np.minimum.reduceat(weight[lay.order], lay.starts)  # [U] cheapest option per unit count
    keep = best < np.minimum.accumulate(np.concatenate([[np.inf], best[:-1]]))  # more units, no cheaper: drop
    units, best = lay.distinct[keep], best[keep]
    new = np.full(n, np.inf)
    umin = int(units[0])
    if umin >= n:
        return new
    span = int(units[-1]) - umin + 1
    if (n - umin) * span <= 65_536:  # small: one sliding-window min beats many slice operations
        dense = np.full(span, np.inf)
        dense[units - umin] = best
        padded = np.concatenate([np.full(span - 1, np.inf), ext[: n - umin]])
        new[umin:] = (sliding_window_view(padded, span) + dense[::-1]).min(axis=1)
        return new
    tmp = np.empty(n)
    for u, w in zip(units.tolist(), best.tolist(), strict=True):
        if u < n:
            np.add(ext[: n - u], w, out=tmp[: n - u])
            np.minimum(new[u:], tmp[: n - u], out=new[u:])
    return new


def _tables(arrs: list[GroupArrays], lays: list[_Layout], lam: float, capacity: int) -> list[np.ndarray]:
    """Backward tables: T[g][c] = min Lagrangian weight of groups g.. with <= c units (flat past len - 1)."""
    tables: list[np.ndarray] = [np.zeros(1)]
    need = 0
    for a, lay in zip(reversed(arrs), reversed(lays), strict=True):
        need += int(lay.distinct[-1])
        weight = a.cost_ms + lam * a.link_bytes if lam else a.cost_ms
        tables.append(_group_step(tables[-1], lay, weight, min(capacity, need) + 1))
    tables.reverse()
    return tables


def _backtrack(arrs: list[GroupArrays], lays: list[_Layout], tables: list[np.ndarray], lam: float,
               capacity: int) -> tuple[int, ...] | None:
    if not math.isfinite(tables[0][min(capacity, tables[0].size - 1)]):
        return None
    choice, c = [], capacity
    for g, (a, lay) in enumerate(zip(arrs, lays, strict=True)):
        u = lay.units
        prev = tables[g + 1]
        weight = a.cost_ms + lam * a.link_bytes if lam else a.cost_ms
        rem = c - u
        vals = np.where(rem >= 0, weight + prev[np.clip(rem, 0, prev.size - 1)], np.inf)
        j = int(np.argmin(vals))
        choice.append(j)
        c -= int(u[j])
    return tuple(choice)


def _halves(arrs: list[GroupArrays], lays: list[_Layout], lam: float, capacity: int) -> tuple[int, ...] | None:
    """Meet in the middle: two halves, each built small-groups-first (their tables stay short until late), joined
    at the best split of capacity between them. Same optimum as one pass, far fewer table cells."""
    if len(arrs) < 2:
        return _backtrack(arrs, lays, _tables(arrs, lays, lam, capacity), lam, capacity)
    by_need = sorted(range(len(arrs)), key=lambda g: int(lays[g].distinct[-1]), reverse=True)
    halves = [by_need[0::2], by_need[1::2]]  # _tables adds a list's groups last-first: smallest first
    tables = [_tables([arrs[g] for g in h], [lays[g] for g in h], lam, capacity) for h in halves]
    c1 = np.arange(capacity + 1)
    t0, t1 = tables[0][0], tables[1][0]
    joined = t0[np.minimum(c1, t0.size - 1)] + t1[np.minimum(capacity - c1, t1.size - 1)]
    split = int(np.argmin(joined))
    if not math.isfinite(joined[split]):
        return None
    choice = [0] * len(arrs)
    for h, tab, cap in zip(halves, tables, (split, capacity - split), strict=True):
        part = _backtrack([arrs[g] for g in h], [lays[g] for g in h], tab, lam, cap)
        assert part is not None
        for g, j in zip(h, part, strict=True):
            choice[g] = j
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
    lays = [_Layout.of(-(-a.units // q)) for a in arrs]
    cap = capacity // q
    passes = 0

    def at(lam: float) -> _Eval | None:
        nonlocal passes
        passes += 1
        tables = _tables(arrs, lays, lam, cap)
        choice = _backtrack(arrs, lays, tables, lam, cap)
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


def _link_floor(arrs: list[GroupArrays], capacity: int) -> tuple[list[np.ndarray], int]:
    """Lower bounds on the link bytes groups g.. must stream within c units: T[g][c // q] (a relaxation: units
    rounded DOWN to q, so every fine choice that fits c units fits c // q coarse ones)."""
    q = max(1, math.ceil(capacity / COARSE_STATES))
    lays = [_Layout.of(a.units // q) for a in arrs]
    link_only = [GroupArrays(a.units, a.link_bytes, np.zeros_like(a.link_bytes)) for a in arrs]
    return _tables(link_only, lays, 0.0, capacity // q), q


class _Search:
    """Depth-first branch and bound over groups, children in bound order, bounded by the Lagrangian tables."""

    def __init__(self, arrs: list[GroupArrays], tables: list[np.ndarray], lam: float, budget: float,
                 best: tuple[int, ...] | None, best_cost: float, link_floor: tuple[list[np.ndarray], int]) -> None:
        self.arrs, self.tables, self.lam, self.budget = arrs, tables, lam, budget
        self.best, self.ub = best, best_cost
        self.link_floor, self.q = link_floor
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
        after = self.link_floor[g + 1]
        ok = (rem >= 0) & (new_link + after[np.clip(rem // self.q, 0, after.size - 1)] <= self.budget)
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
    lays = [_Layout.of(a.units) for a in arrs]
    capacity = problem.capacity_units
    budget = problem.link_budget_bytes_per_step
    stats: dict[str, float] = {}
    if budget is None:
        choice = _halves(arrs, lays, 0.0, capacity)
        assert choice is not None  # check_feasible guarantees a capacity-feasible choice
        return make_solution(problem, choice, "dp", _ms(t0), "one DP pass (no link budget)", {"passes": 1})
    choice = _halves(arrs, lays, 0.0, capacity)
    assert choice is not None
    if _evaluate(arrs, choice)[1] <= budget:  # the optimum without the link budget streams within it: optimal
        return make_solution(problem, choice, "dp", _ms(t0), "one DP pass (link budget not binding)", {"passes": 1})
    lam, feasible, passes = _price_link(arrs, capacity, float(budget))
    stats.update(lam_ms_per_byte=lam, coarse_passes=passes, passes=2)
    link_floor = _link_floor(arrs, capacity)
    least_link = float(link_floor[0][0][min(capacity // link_floor[1], link_floor[0][0].size - 1)])
    if least_link > budget:
        raise InfeasibleError(f"link budget {budget} bytes/step is below the {least_link:.0f} bytes/step that must "
                              f"stream even with all {capacity} units of HBM spent on cutting link traffic")
    tables = _tables(arrs, lays, lam, capacity)
    lower = float(tables[0][min(capacity, tables[0].size - 1)]) - lam * budget
    candidates = [e.choice for e in feasible]
    choice = _backtrack(arrs, lays, tables, lam, capacity)
    if choice is not None:
        candidates.append(choice)
    best, best_cost = None, math.inf
    for cand in candidates:
        cost, link = _evaluate(arrs, cand)
        if link <= budget and sum(int(y.units[j]) for y, j in zip(lays, cand, strict=True)) <= capacity and \
                cost < best_cost:
            best, best_cost = cand, cost
    if best is not None and best_cost - lower <= REL_TOL * max(1.0, abs(best_cost)):
        detail = f"Lagrangian optimum at lam={lam:.3g} ms/byte (no duality gap)"
        return make_solution(problem, best, "dp", _ms(t0), detail, stats)
    search = _Search(arrs, tables, lam, float(budget), best, best_cost, link_floor)
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
