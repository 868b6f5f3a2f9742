"""Exact dynamic-programming solver for the split MCKP (`problem.py`): the controller's fast path.

Runs inside the controller process; pure numpy. Never imports torch, runtime or agent; never mutates the problem.

How it handles two constraints (HBM units, exact; the per-step link budget, priced):
- The DP (`tables.py`) runs over capacity only, vectorised over 0..C (two halves met in the middle); the link
  budget enters as a Lagrangian price: option weight = cost_ms + lam * link_bytes.
- The price starts at the LP relaxation's dual (`pricing.py`). Price 0 with a split that streams within the
  budget: optimal, one pass (the link does not bind). Otherwise a few passes at prices around the dual's peak
  (raise until a split fits, then where the two bracketing splits' Lagrangian lines cross). Every pass gives a
  valid lower bound, value(lam) - lam * budget, for any lam >= 0; the cheapest split that fits is the answer.
- Verification: bound = answer (within 1e-9 relative) means proven optimal. Otherwise, by default, the answer
  carries its proven gap (`stats["gap_ms"]`, `detail`) once it is within `target_gap`; with `exact=True` the gap
  is closed by a depth-first branch and bound on fine tables at the best price (bound at a node: cost so far +
  table of the remaining groups - lam * link budget left; link feasibility pruned exactly with a link-only
  table), and past `max_nodes` the MILP finishes it (solver "dp+milp", recorded, never silent).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from tierplan.controller.optimizer.exchange import improve_by_exchange
from tierplan.controller.optimizer.pricing import link_price
from tierplan.controller.optimizer.problem import (
    GroupArrays,
    InfeasibleError,
    SplitProblem,
    SplitSolution,
    group_arrays,
    make_solution,
)
from tierplan.controller.optimizer.tables import Layout, at_capacity, halves, tables_of

REL_TOL = 1e-9  # optimality tolerance (relative): well inside the 1e-6 the solvers must agree to
NODE_LIMIT = 2_000  # search nodes before the MILP takes over (the search only pays off on small problems)
PRICE_PASSES = 2  # DP passes at link prices around the dual's peak (cheapest split that fits wins) ...
MAX_PASSES = 8  # ... or more, raising the price, until one fits
TARGET_GAP = 0.005  # default: stop pricing once a split that fits is proven within 0.5% of optimal
PRICE_STEP = 1.25


class _NodeLimit(Exception):
    pass


@dataclass
class _Eval:
    choice: tuple[int, ...]
    cost_ms: float
    link_bytes: float


def _evaluate(arrs: list[GroupArrays], choice: tuple[int, ...]) -> _Eval:
    cost = sum(float(a.cost_ms[j]) for a, j in zip(arrs, choice, strict=True))
    link = sum(float(a.link_bytes[j]) for a, j in zip(arrs, choice, strict=True))
    return _Eval(choice, cost, link)


class _Search:
    """Depth-first branch and bound over groups (in table order), children in bound order."""

    def __init__(self, arrs: list[GroupArrays], lays: list[Layout], tables: list[np.ndarray], lam: float,
                 budget: float, incumbent: _Eval | None, capacity: int, max_nodes: int) -> None:
        self.arrs, self.tables, self.lam, self.budget = arrs, tables, lam, budget
        self.best = incumbent.choice if incumbent else None
        self.ub = incumbent.cost_ms if incumbent else math.inf
        link_only = [GroupArrays(a.units, a.link_bytes, a.link_bytes) for a in arrs]
        self.least_link = tables_of(link_only, lays, 0.0, capacity)  # least link bytes of groups g.. in c units
        self.nodes, self.max_nodes = 0, max_nodes
        self.path: list[int] = []

    def _cut(self) -> float:
        return self.ub - REL_TOL * max(1.0, abs(self.ub)) if math.isfinite(self.ub) else math.inf

    def run(self, capacity: int) -> None:
        self._node(0, capacity, 0.0, 0.0)

    def _node(self, g: int, c: int, link: float, cost: float) -> None:
        self.nodes += 1
        if self.nodes > self.max_nodes:
            raise _NodeLimit
        a = self.arrs[g]
        rem = c - a.units
        new_link = link + a.link_bytes
        ok = (rem >= 0) & (new_link + at_capacity(self.least_link[g + 1], np.maximum(rem, 0)) <= self.budget)
        if g == len(self.arrs) - 1:
            total = np.where(ok, cost + a.cost_ms, np.inf)
            j = int(np.argmin(total))
            if total[j] < self._cut():
                self.ub, self.best = float(total[j]), (*self.path, j)
            return
        bound = cost + a.cost_ms + at_capacity(self.tables[g + 1], np.maximum(rem, 0))
        bound = np.where(ok, bound - self.lam * (self.budget - new_link), np.inf)
        for j in np.argsort(bound, kind="stable").tolist():
            if not bound[j] < self._cut():
                break
            self.path.append(j)
            self._node(g + 1, c - int(a.units[j]), float(new_link[j]), cost + float(a.cost_ms[j]))
            self.path.pop()


def solve_dp(problem: SplitProblem, exact: bool = False, max_nodes: int = NODE_LIMIT,
             target_gap: float = TARGET_GAP) -> SplitSolution:
    """The optimum of `problem` (module docstring); raises InfeasibleError with the cause.

    When the link budget binds with a duality gap, `exact=False` returns the cheapest split that fits among a few
    DP passes at prices around the dual's peak, stopping once one is within `target_gap` (relative) of the
    Lagrangian bound (feasible; its proven distance from optimal in `stats["gap_ms"]` and `detail`);
    `exact=True` closes the gap: the search, then the MILP past `max_nodes`."""
    t0 = time.perf_counter()
    problem.check_feasible()
    arrs = group_arrays(problem)
    lays = [Layout.of_group(g) for g in problem.groups]
    capacity = problem.capacity_units
    budget = problem.link_budget_bytes_per_step
    if budget is None:
        found = halves(arrs, lays, 0.0, capacity)
        assert found is not None  # check_feasible guarantees a capacity-feasible choice
        return make_solution(problem, found[0], "dp", _ms(t0), "one DP pass (no link budget)", {"passes": 1},
                             link_binds=False, settle=True)
    lam = link_price(arrs, capacity, float(budget))
    stats: dict[str, float] = {"lam_ms_per_byte": lam, "passes": 0}
    best_lam, lower, incumbent, inc_price = lam, -math.inf, None, lam
    lo: tuple[float, _Eval] | None = None  # the dearest price seen whose split streams too much
    hi: tuple[float, _Eval] | None = None  # the cheapest price seen whose split fits
    price = lam
    for num in range(MAX_PASSES):
        if num >= PRICE_PASSES and incumbent is not None:
            break
        found = halves(arrs, lays, price, capacity)
        assert found is not None
        stats["passes"] += 1
        e = _evaluate(arrs, found[0])
        if found[1] - price * budget > lower:
            best_lam, lower = price, found[1] - price * budget
        if e.link_bytes <= budget:
            hi = (price, e) if hi is None or price < hi[0] else hi
            if incumbent is None or e.cost_ms < incumbent.cost_ms:
                incumbent, inc_price = e, price
        else:
            lo = (price, e) if lo is None or price > lo[0] else lo
        if incumbent is not None and incumbent.cost_ms - lower <= (REL_TOL if exact else target_gap) * max(
                1.0, abs(incumbent.cost_ms)):
            break
        if lo is not None and hi is not None:  # where the two splits' Lagrangian lines cross: the dual's peak
            nxt = (hi[1].cost_ms - lo[1].cost_ms) / max(lo[1].link_bytes - hi[1].link_bytes, 1e-12)
            if not lo[0] < nxt < hi[0] or nxt == price:
                break
            price = nxt
        elif hi is None:
            price = price * PRICE_STEP if price > 0 else _first_price(arrs)
        else:
            price = hi[0] / PRICE_STEP
    stats["lower_bound_ms"] = lower
    if incumbent is not None and incumbent.cost_ms - lower > REL_TOL * max(1.0, abs(incumbent.cost_ms)):
        better, moves = improve_by_exchange(arrs, incumbent.choice, capacity, float(budget), best_lam)
        e = _evaluate(arrs, better)
        if moves and e.link_bytes <= budget and e.cost_ms < incumbent.cost_ms:
            incumbent = e
            stats["exchange_moves"] = moves
    if incumbent is not None and incumbent.cost_ms - lower <= REL_TOL * max(1.0, abs(incumbent.cost_ms)):
        how = "link budget not binding" if best_lam == 0.0 else f"Lagrangian optimum at lam={best_lam:.3g} ms/byte"
        return make_solution(problem, incumbent.choice, "dp", _ms(t0), f"DP, {how} (no gap)", stats,
                             link_binds=best_lam > 0.0, settle=True)
    if incumbent is not None and not exact:
        gap = incumbent.cost_ms - lower
        stats["gap_ms"] = gap
        polish = f" + {stats['exchange_moves']:.0f} slot exchanges" if "exchange_moves" in stats else ""
        detail = (f"DP at link price {inc_price:.3g} ms/byte{polish}, within {gap:.3g} ms "
                  f"({100 * gap / max(abs(incumbent.cost_ms), 1e-12):.2g}%) of optimal (Lagrangian bound)")
        return make_solution(problem, incumbent.choice, "dp", _ms(t0), detail, stats, link_binds=True, settle=True)
    return _close_gap(problem, arrs, lays, best_lam, lower, incumbent, max_nodes, stats, t0)


def least_link_bytes(problem: SplitProblem) -> int:
    """The fewest link bytes per step any split within the HBM capacity streams (exact): the floor below which a
    link budget makes the problem infeasible. Where every group's own least (fewest units among ties) fits the
    capacity together, their sum is that floor; otherwise one DP pass finds it. Raises InfeasibleError if no
    split fits the capacity."""
    SplitProblem(problem.groups, problem.capacity_units, problem.unit_bytes).check_feasible()
    least = [min(g.options, key=lambda o: (o.link_bytes, o.units)) for g in problem.groups]
    if sum(o.units for o in least) <= problem.capacity_units:
        return sum(o.link_bytes for o in least)
    return least_link_bytes_dp(problem)


def least_link_bytes_dp(problem: SplitProblem) -> int:
    """`least_link_bytes` by the DP pass alone (the capacity checked by the caller)."""
    arrs = group_arrays(problem)
    link_only = [GroupArrays(a.units, a.link_bytes, a.link_bytes) for a in arrs]
    found = halves(link_only, [Layout.of_group(g) for g in problem.groups], 0.0, problem.capacity_units)
    assert found is not None
    return round(_evaluate(arrs, found[0]).link_bytes)


def _first_price(arrs: list[GroupArrays]) -> float:
    cost_span = max(float(a.cost_ms.max() - a.cost_ms.min()) for a in arrs) + 1e-12
    return cost_span / (max(float(a.link_bytes.max()) for a in arrs) + 1.0)


def _close_gap(problem: SplitProblem, arrs: list[GroupArrays], lays: list[Layout], lam: float, lower: float,
               incumbent: _Eval | None, max_nodes: int, stats: dict[str, float], t0: float) -> SplitSolution:
    """Exact: branch and bound on fine tables at `lam`, the MILP past `max_nodes`."""
    capacity, budget = problem.capacity_units, float(problem.link_budget_bytes_per_step or 0)
    # Table order: most units first, so the tables (built last-first) stay short for longest.
    perm = sorted(range(len(arrs)), key=lambda g: int(lays[g].distinct[-1]), reverse=True)
    p_arrs, p_lays = [arrs[g] for g in perm], [lays[g] for g in perm]
    tables = tables_of(p_arrs, p_lays, lam, capacity)
    start = None if incumbent is None else _Eval(tuple(incumbent.choice[g] for g in perm), incumbent.cost_ms,
                                                 incumbent.link_bytes)
    search = _Search(p_arrs, p_lays, tables, lam, budget, start, capacity, max_nodes)
    try:
        search.run(capacity)
    except _NodeLimit:
        from tierplan.controller.optimizer.milp import solve_milp

        stats.update(search_nodes=search.nodes, fallback_milp=1)
        sol = solve_milp(problem)
        detail = f"search passed {max_nodes} nodes; the MILP finished it"
        return make_solution(problem, sol.choice, "dp+milp", _ms(t0), detail, stats, link_binds=True, settle=True)
    stats["search_nodes"] = search.nodes
    if search.best is None:
        raise InfeasibleError(f"no split fits both the HBM capacity ({capacity} units) and the link budget "
                              f"({budget:.0f} bytes/step): every split that fits the capacity streams more")
    detail = (f"DP, Lagrangian bound at lam={lam:.3g} ms/byte, gap {search.ub - lower:.3g} ms closed by search "
              f"({search.nodes} nodes)")
    return make_solution(problem, _unpermute(perm, search.best), "dp", _ms(t0), detail, stats, link_binds=True,
                         settle=True)


def _unpermute(perm: list[int], choice: tuple[int, ...]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for g, j in zip(perm, choice, strict=True):
        out[g] = j
    return tuple(out)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3
