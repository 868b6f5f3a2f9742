"""Human reasons for a split: the few factors that decided it, in words a user understands (for Plan.reason).

Runs inside the controller process; pure Python + numpy. Never imports torch, runtime or agent. The words come
from the problem alone (group names, option labels, costs, budgets), so any solver's answer can be explained.
"""

from __future__ import annotations

import numpy as np

from tierplan.controller.optimizer.problem import Constraint, Group, GroupKind, SplitProblem, SplitSolution

CLIFF_FACTOR = 4.0  # a one-step drop this many times the median step is a cliff


def _fmt_bytes(num_bytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def _label(group: Group, j: int) -> str:
    opt = group.options[j]
    return opt.label or f"{opt.units} units"


def _cliff(group: Group, j: int) -> str:
    """'; its curve drops X ms at <label>: a cliff' when the chosen option sits past a drop far steeper than the
    steps before it (the curve is not concave there, which an equal-marginal greedy cannot see)."""
    order = sorted(range(len(group.options)), key=lambda k: group.options[k].units)
    costs = np.array([group.options[k].cost_ms for k in order])
    pos = order.index(j)
    if pos < 2:
        return ""
    drops = costs[:pos] - costs[1:pos + 1]  # [pos] drop of the step to order[i + 1]
    for k in np.argsort(-drops).tolist():
        before = drops[max(0, k - 8):k]
        if k == 0 or before.size == 0:
            continue
        steep = drops[k] >= CLIFF_FACTOR * max(float(before.mean()), 1e-12)
        if steep and drops[k] >= 0.2 * (costs[0] - costs[pos]):
            return f"; its curve drops {drops[k]:.3g} ms at {_label(group, order[k + 1])}: a cliff"
        break
    return ""


def top_factors(problem: SplitProblem, solution: SplitSolution, max_factors: int = 5) -> list[str]:
    """The factors behind `solution`, most important first."""
    experts, kv = [], []
    for g, j in zip(problem.groups, solution.choice, strict=True):
        base = min(g.options, key=lambda o: (o.units, o.cost_ms))
        saving = base.cost_ms - g.options[j].cost_ms
        (kv if g.kind is GroupKind.KV else experts).append((saving, g, j))
    experts.sort(key=lambda t: -t[0])
    out = []
    for saving, g, j in experts[:2]:
        base = "none resident" if min(o.units for o in g.options) == 0 else "its smallest option"
        out.append(f"{g.name} gets {_label(g, j)} (saves {saving:.3g} ms/step vs {base}{_cliff(g, j)})")
    cliffs = [(g, _cliff(g, j)) for _, g, j in experts[2:]]
    cliffs = [(g, c) for g, c in cliffs if c]
    if cliffs:
        g, c = cliffs[0]
        example = f"{g.name}{c.replace(';', ':', 1)}"
        out.append(f"{len(cliffs)} more layer(s) get past a cliff in their curve (e.g. {example})")
    for _, g, j in kv:
        out.append(f"{g.name} keeps {_label(g, j)} ({g.options[j].cost_ms:.3g} ms/step lost to what it cannot hold)")
    budget = problem.link_budget_bytes_per_step
    if Constraint.LINK in solution.binding and budget is not None:
        out.append(f"link budget binding: {_fmt_bytes(solution.link_bytes_used)}/step of {_fmt_bytes(budget)}")
    elif budget is not None:
        out.append(f"link budget not binding: {_fmt_bytes(solution.link_bytes_used)}/step of {_fmt_bytes(budget)}")
    if Constraint.CAPACITY in solution.binding:
        out.append(f"HBM full: {solution.units_used} of {problem.capacity_units} units "
                   f"({_fmt_bytes(solution.units_used * problem.unit_bytes)}) in use")
    if experts:
        saving, g, j = experts[-1]
        out.append(f"{g.name} gets least: {_label(g, j)} ({g.options[j].cost_ms:.3g} ms/step of stall left; "
                   "slots buy less there)")
    gap = solution.stats.get("gap_ms")
    if gap:
        out.insert(0, f"near-optimal: within {gap:.3g} ms/step of the best split ({solution.detail})")
    return out[:max_factors]


def reason(problem: SplitProblem, solution: SplitSolution, max_factors: int = 5) -> str:
    """One line for Plan.reason: the objective, then the top factors."""
    head = f"{solution.objective_ms:.3g} ms/step expected stall ({solution.solver})"
    return "; ".join([head, *top_factors(problem, solution, max_factors)])
