"""Baseline split policies: the equal-marginal greedy (WiSP MV-WSA style) and FluxMoE's rho rule.

Runs inside the controller process (and in benchmarks); pure Python + numpy. Never imports torch, runtime or
agent. These are what tierplan is compared against, not what it plans with: both are blind to cliffs in a
miss-ratio curve, which the exact DP is not.

- `solve_greedy`: every group starts at its fewest-units option; while the split streams more than the link
  budget, the next option (by units) that cuts the most link bytes per byte of HBM is taken; then repeatedly the
  next option of the group with the best marginal benefit (ms) per byte, while it fits, until no next step
  lowers the cost. A flat stretch before a cliff has zero marginal benefit, so the greedy stops
  short of it: the known failure of equal-marginal allocation on non-concave curves.
- `fluxmoe_split`: FluxMoE's rule rho = tau_comp / tau_load with dead zone [0.9, 1.0], run to its fixed point.
  tau_load = link bytes of the split / link bytes per ms; tau_comp = the step's compute ms. rho < 0.9 (loads
  cannot hide behind compute): move `step_units` from KV to experts; rho > 1.0 (loads hidden, memory better
  spent on KV): move them back; inside the dead zone: stop. Experts get an equal share per layer (the rule has
  no notion of per-layer curves); the KV group takes what is left.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from tierplan.controller.optimizer.problem import (
    GroupKind,
    InfeasibleError,
    SplitProblem,
    SplitSolution,
    evaluate,
    group_arrays,
    make_solution,
    violations,
)

RHO_LOW, RHO_HIGH = 0.9, 1.0


def solve_greedy(problem: SplitProblem) -> SplitSolution:
    """The equal-marginal greedy; raises InfeasibleError when it cannot end within the budgets."""
    t0 = time.perf_counter()
    problem.check_feasible()
    arrs = group_arrays(problem)
    orders = [np.lexsort((a.cost_ms, a.units)) for a in arrs]  # by units, cheapest first on ties
    pos = [0] * len(arrs)
    units = sum(int(a.units[o[0]]) for a, o in zip(arrs, orders, strict=True))
    link = sum(int(a.link_bytes[o[0]]) for a, o in zip(arrs, orders, strict=True))
    budget = problem.link_budget_bytes_per_step

    def ratio(g: int, by_link: bool) -> float | None:
        a, o, i = arrs[g], orders[g], pos[g]
        if i + 1 >= o.size:
            return None
        du = max(int(a.units[o[i + 1]] - a.units[o[i]]), 1e-9)
        vals = a.link_bytes if by_link else a.cost_ms
        return float(vals[o[i]] - vals[o[i + 1]]) / du

    # Phase 1 (only while over the link budget): the steps that cut the most link bytes per unit.
    # Phase 2: the steps that cut the most ms per unit, while they fit.
    for by_link in (True, False):
        heap = [(-r, g) for g in range(len(arrs)) if (r := ratio(g, by_link)) is not None]
        heapq.heapify(heap)
        while heap and (not by_link or (budget is not None and link > budget)):
            neg_ratio, g = heapq.heappop(heap)
            if neg_ratio >= 0:
                break  # the best next step saves nothing
            a, o, i = arrs[g], orders[g], pos[g]
            du = int(a.units[o[i + 1]] - a.units[o[i]])
            dl = int(a.link_bytes[o[i + 1]] - a.link_bytes[o[i]])
            if units + du > problem.capacity_units or (budget is not None and dl > 0 and link + dl > budget):
                continue  # this group's next step does not fit: the group stops growing in this phase
            pos[g] += 1
            units, link = units + du, link + dl
            if (r := ratio(g, by_link)) is not None:
                heapq.heappush(heap, (-r, g))
    choice = tuple(int(o[i]) for o, i in zip(orders, pos, strict=True))
    broken = violations(problem, choice)
    if broken:
        raise InfeasibleError(f"the equal-marginal greedy ended over a budget: {'; '.join(broken)}")
    return make_solution(problem, choice, "greedy", (time.perf_counter() - t0) * 1e3,
                         "equal-marginal greedy (baseline)")


def _equal_share(problem: SplitProblem, expert_units: int) -> tuple[int, ...]:
    """Experts: the same share per layer (largest option within it); KV: the largest option that still fits."""
    expert_groups = [i for i, g in enumerate(problem.groups) if g.kind is GroupKind.EXPERTS]
    arrs = group_arrays(problem)
    per_layer = expert_units // max(1, len(expert_groups))
    choice = [0] * len(arrs)
    used = 0
    for i in expert_groups:
        a = arrs[i]
        fits = np.flatnonzero(a.units <= per_layer)
        j = int(fits[np.argmin(a.cost_ms[fits])]) if fits.size else int(np.argmin(a.units))
        choice[i] = j
        used += int(a.units[j])
    others = [i for i in range(len(arrs)) if i not in set(expert_groups)]
    free = problem.capacity_units - used
    for i in others:
        a = arrs[i]
        share = free // max(1, len(others))
        fits = np.flatnonzero(a.units <= share)
        choice[i] = int(fits[np.argmax(a.units[fits])]) if fits.size else int(np.argmin(a.units))
    return tuple(choice)


def fluxmoe_split(problem: SplitProblem, compute_ms_per_step: float, link_bytes_per_ms: float,
                  step_units: int | None = None, max_steps: int = 10_000) -> SplitSolution:
    """FluxMoE's rho rule run to its fixed point (module docstring); raises InfeasibleError if it ends over a
    budget."""
    if compute_ms_per_step <= 0 or link_bytes_per_ms <= 0:
        raise ValueError(f"compute_ms_per_step={compute_ms_per_step} and link_bytes_per_ms={link_bytes_per_ms} "
                         "must be > 0")
    t0 = time.perf_counter()
    problem.check_feasible()
    num_expert_groups = sum(g.kind is GroupKind.EXPERTS for g in problem.groups)
    step = step_units or max(1, num_expert_groups)
    expert_units, seen = problem.capacity_units // 2, set()
    choice = _equal_share(problem, expert_units)
    for _ in range(max_steps):
        _, _, link = evaluate(problem, choice)
        rho = compute_ms_per_step / max(link / link_bytes_per_ms, 1e-12)
        if RHO_LOW <= rho <= RHO_HIGH or expert_units in seen:
            break
        seen.add(expert_units)
        move = step if rho < RHO_LOW else -step
        nxt = min(max(expert_units + move, 0), problem.capacity_units)
        if nxt == expert_units:
            break
        expert_units = nxt
        choice = _equal_share(problem, expert_units)
    broken = violations(problem, choice)
    if broken:
        raise InfeasibleError(f"FluxMoE's rho rule ended over a budget: {'; '.join(broken)}")
    return make_solution(problem, choice, "fluxmoe", (time.perf_counter() - t0) * 1e3,
                         f"FluxMoE rho rule (baseline), rho={rho:.2f}, {expert_units} units to experts")
