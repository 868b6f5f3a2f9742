"""Baseline split policies: the equal-marginal greedy (WiSP MV-WSA style) and FluxMoE's rho rule.

Runs inside the controller process (and in benchmarks); pure Python + numpy. Never imports torch, runtime or
agent. These are what tierplan is compared against, not what it plans with: both are blind to cliffs in a
miss-ratio curve, which the exact DP is not.

- `solve_greedy`: every group starts at its fewest-units option; while the split streams more than the link
  budget, the next option (by units) that cuts the most link bytes per byte of HBM is taken; then repeatedly the
  next option of the group with the best marginal benefit (ms) per byte, while it fits, until no next step
  lowers the cost. A flat stretch before a cliff has zero marginal benefit, so the greedy stops
  short of it: the known failure of equal-marginal allocation on non-concave curves. The HBM capacity is a
  hard limit; the link budget only ranks steps (WiSP's allocator has none): a split that ends over it is
  returned with the overage named in the solution's detail, never refused.
- `fluxmoe_split`: FluxMoE's rule rho = tau_comp / tau_load with dead zone [0.9, 1.0], run to its fixed point,
  KV first. tau_load = link bytes of the split / link bytes per ms; tau_comp = the step's compute ms. The KV
  share starts at its demand cap (the smallest KV option at which the KV cost reaches its least: more KV buys
  nothing; or `kv_cap_units`) and experts take the rest, up to every expert. rho < 0.9 (loads cannot hide
  behind compute): move `step_units` from KV to experts, never below the KV group's least option; rho > 1.0
  (loads hidden): move them back, but only while KV is under its cap, so experts never shrink to give KV
  memory it cannot use; inside the dead zone: stop. Experts get an equal share per layer (the rule has no
  notion of per-layer curves), each layer the most slots within its share; KV takes every unit left, so no
  budget goes unused while experts could not take it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
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
    """The equal-marginal greedy (module docstring); raises InfeasibleError only when no choice fits the HBM
    capacity. A split it ends over the link budget with is returned, the overage named in its detail."""
    t0 = time.perf_counter()
    dataclasses.replace(problem, link_budget_bytes_per_step=None).check_feasible()  # the capacity alone
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
    if units > problem.capacity_units:  # never: every step taken was checked against the capacity
        raise InfeasibleError("the equal-marginal greedy ended over the HBM capacity: "
                              + "; ".join(violations(problem, choice)))
    detail = "equal-marginal greedy (baseline)"
    if budget is not None and link > budget:
        detail += (f"; streams {link} bytes/step, {link - budget} over the link budget of {budget} (WiSP's "
                   "allocator has no link budget: here it only ranks the steps, the split is kept)")
    return make_solution(problem, choice, "greedy", (time.perf_counter() - t0) * 1e3, detail)


def _equal_share(problem: SplitProblem, expert_units: int) -> tuple[int, ...]:
    """Experts: the same share per layer, each layer the most units within it (least cost among equals; its
    fewest if none fits); KV: the largest option that fits what the experts left (split evenly over KV groups)."""
    expert_groups = [i for i, g in enumerate(problem.groups) if g.kind is GroupKind.EXPERTS]
    arrs = group_arrays(problem)
    per_layer = expert_units // max(1, len(expert_groups))
    choice = [0] * len(arrs)
    used = 0
    for i in expert_groups:
        a = arrs[i]
        fits = np.flatnonzero(a.units <= per_layer)
        if fits.size:
            most = fits[a.units[fits] == a.units[fits].max()]
            j = int(most[np.argmin(a.cost_ms[most])])
        else:
            j = int(np.argmin(a.units))
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


def kv_demand_cap_units(problem: SplitProblem) -> int:
    """Units of KV the split can use: per KV group the fewest units at which its cost reaches its least (the
    controller's KV demand is met; more blocks buy nothing), summed over the KV groups."""
    total = 0
    for g in problem.groups:
        if g.kind is not GroupKind.KV:
            continue
        a = g.arrays
        least = float(a.cost_ms.min())
        at_least = np.flatnonzero(a.cost_ms <= least + 1e-9 * max(1.0, abs(least)))
        total += int(a.units[at_least].min())
    return total


def fluxmoe_split(problem: SplitProblem, compute_ms_per_step: float, link_bytes_per_ms: float,
                  step_units: int | None = None, max_steps: int = 10_000,
                  kv_cap_units: int | None = None) -> SplitSolution:
    """FluxMoE's rho rule run to its fixed point, KV first (module docstring). `kv_cap_units`: the KV share's
    cap (default: `kv_demand_cap_units`). Raises InfeasibleError if it ends over a budget."""
    if compute_ms_per_step <= 0 or link_bytes_per_ms <= 0:
        raise ValueError(f"compute_ms_per_step={compute_ms_per_step} and link_bytes_per_ms={link_bytes_per_ms} "
                         "must be > 0")
    t0 = time.perf_counter()
    problem.check_feasible()
    kinds = [g.kind for g in problem.groups]
    arrs = group_arrays(problem)
    experts = [a for a, k in zip(arrs, kinds, strict=True) if k is GroupKind.EXPERTS]
    step = step_units or max(1, len(experts))
    min_experts = sum(int(a.units.min()) for a in experts)
    max_experts = sum(int(a.units.max()) for a in experts)
    kv_min = sum(int(a.units.min()) for a, k in zip(arrs, kinds, strict=True) if k is not GroupKind.EXPERTS)
    cap = kv_demand_cap_units(problem) if kv_cap_units is None else kv_cap_units
    # Experts range from what KV at its cap leaves (KV first) to what KV at its least leaves.
    hi = max(min_experts, min(max_experts, problem.capacity_units - kv_min))
    lo = min(hi, max(min_experts, problem.capacity_units - cap))
    expert_units, seen = lo, set()
    choice = _equal_share(problem, expert_units)
    rho = math.inf
    for _ in range(max_steps):
        _, _, link = evaluate(problem, choice)
        rho = compute_ms_per_step / max(link / link_bytes_per_ms, 1e-12)
        if RHO_LOW <= rho <= RHO_HIGH or expert_units in seen:
            break
        seen.add(expert_units)
        nxt = min(max(expert_units + (step if rho < RHO_LOW else -step), lo), hi)
        if nxt == expert_units:
            break  # at the end of the range: experts hold every unit KV cannot use, or KV is at its least
        expert_units = nxt
        choice = _equal_share(problem, expert_units)
    broken = violations(problem, choice)
    if broken:
        raise InfeasibleError(f"FluxMoE's rho rule ended over a budget: {'; '.join(broken)}")
    return make_solution(problem, choice, "fluxmoe", (time.perf_counter() - t0) * 1e3,
                         f"FluxMoE rho rule (baseline), rho={rho:.2f}, {expert_units} units to experts "
                         f"(range {lo}..{hi}: KV capped at {cap} units it can use)")
