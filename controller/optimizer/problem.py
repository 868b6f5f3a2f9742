"""The HBM split as a multiple-choice knapsack (MCKP): the problem every solver in this package solves.

Runs inside the controller process; pure Python + numpy. It never imports torch, runtime or agent, and it
never decides anything: it describes a split problem, checks it, and evaluates a choice.

Model (separable, documented once here):
- One `Group` per decision: one per MoE layer (options = resident slot counts 0..E) and one or more KV groups
  (options = GPU block counts). Each group takes exactly one `Option`.
- `Option.units` is HBM in units of `SplitProblem.unit_bytes` (e.g. one expert slot stride). KV options are
  rounded UP to whole units (`units_for_bytes`), so a chosen split never exceeds the real budget.
- `Option.cost_ms` is the expected stall/step time the choice contributes (lower is better). Only sums of
  costs matter, so any constant offset per group is harmless.
- `Option.link_bytes` is what the choice makes stream over the host link per step (the non-resident part of a
  layer's union; KV fetches/spills). With `link_budget_bytes_per_step` set, the sum over groups must not
  exceed it.
- Migration: moving a group from its `current` option to another costs
  `migration_ms_per_unit * |units - current units|` added to that option's cost (amortised per step by the
  caller: ms to move one unit divided by the steps the plan is expected to hold). Separable, so every solver
  sees it as part of the option cost (`effective_costs`).
Objective: minimise the sum of effective costs s.t. sum(units) <= capacity_units and sum(link) <= link budget.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np


class ProblemError(ValueError):
    """A malformed problem: says what is wrong and where."""


class InfeasibleError(ValueError):
    """A well-formed problem with no split that satisfies every constraint; says which constraint and why."""


class GroupKind(StrEnum):
    EXPERTS = "experts"  # one MoE layer: options are resident slot counts
    KV = "kv"  # KV cache: options are GPU block counts


class Constraint(StrEnum):
    CAPACITY = "capacity"
    LINK = "link"


@dataclass(frozen=True)
class Option:
    units: int
    cost_ms: float
    link_bytes: int = 0
    label: str = ""


@dataclass(frozen=True)
class GroupArrays:
    """One group's options as arrays (what the vectorised solvers work on)."""

    units: np.ndarray  # [J] int64
    cost_ms: np.ndarray  # [J] float64, migration included
    link_bytes: np.ndarray  # [J] float64 (exact for integers below 2**53)


@dataclass(frozen=True)
class Group:
    name: str
    options: tuple[Option, ...]
    current: int | None = None  # index into options of today's placement (migration cost, hysteresis)
    kind: GroupKind = GroupKind.EXPERTS

    def __post_init__(self) -> None:
        if not self.name:
            raise ProblemError("group name must be non-empty")
        if not self.options:
            raise ProblemError(f"group {self.name!r}: has no options (expected at least one)")
        for i, opt in enumerate(self.options):
            where = f"group {self.name!r} option {i}"
            if isinstance(opt.units, bool) or not isinstance(opt.units, int | np.integer) or opt.units < 0:
                raise ProblemError(f"{where}: units={opt.units!r}, expected an int >= 0")
            if isinstance(opt.cost_ms, bool) or not isinstance(opt.cost_ms, int | float | np.number) or \
                    not math.isfinite(opt.cost_ms):
                raise ProblemError(f"{where}: cost_ms={opt.cost_ms!r}, expected a finite number")
            if isinstance(opt.link_bytes, bool) or not isinstance(opt.link_bytes, int | np.integer) or \
                    opt.link_bytes < 0:
                raise ProblemError(f"{where}: link_bytes={opt.link_bytes!r}, expected an int >= 0")
        if self.current is not None and not 0 <= self.current < len(self.options):
            raise ProblemError(f"group {self.name!r}: current={self.current} outside 0..{len(self.options) - 1}")

    @classmethod
    def from_arrays(cls, name: str, units: np.ndarray, cost_ms: np.ndarray, link_bytes: np.ndarray | None = None,
                    labels: list[str] | None = None, current: int | None = None,
                    kind: GroupKind = GroupKind.EXPERTS) -> Group:
        """A group from per-option arrays (how the loop builds one from a curve); same checks as the options."""
        units, cost_ms = np.asarray(units), np.asarray(cost_ms, dtype=np.float64)
        link = np.zeros(units.shape, dtype=np.int64) if link_bytes is None else np.asarray(link_bytes)
        if not units.shape == cost_ms.shape == link.shape or units.ndim != 1:
            raise ProblemError(f"group {name!r}: units {units.shape}, cost_ms {cost_ms.shape} and link_bytes "
                               f"{link.shape} must be 1-d of one length")
        if labels is not None and len(labels) != units.size:
            raise ProblemError(f"group {name!r}: {len(labels)} labels for {units.size} options")
        names = labels or [""] * units.size
        options = tuple(Option(int(u), float(c), int(v), lab)
                        for u, c, v, lab in zip(units.tolist(), cost_ms.tolist(), link.tolist(), names, strict=True))
        group = cls(name, options, current, kind)
        group.arrays  # noqa: B018 - builds the cache now, at construction, not inside a timed solve
        return group

    @functools.cached_property
    def by_units(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order, starts, distinct): options sorted by units (stable), where each unit count starts, and the
        distinct counts ascending. Built once; the DP groups options of equal size with it."""
        units = self.arrays.units
        if units.size == 1 or bool((units[1:] > units[:-1]).all()):  # already sorted and distinct (slot counts)
            index = np.arange(units.size)
            return index, index, units
        order = np.argsort(units, kind="stable")
        sorted_units = units[order]
        starts = np.flatnonzero(np.concatenate([[True], sorted_units[1:] != sorted_units[:-1]]))
        return order, starts, sorted_units[starts]

    @functools.cached_property
    def arrays(self) -> GroupArrays:
        """The options as arrays, migration not included (built once; solvers must not write to them)."""
        n = len(self.options)
        units = np.fromiter((o.units for o in self.options), dtype=np.int64, count=n)
        cost = np.fromiter((o.cost_ms for o in self.options), dtype=np.float64, count=n)
        link = np.fromiter((o.link_bytes for o in self.options), dtype=np.float64, count=n)
        for a in (units, cost, link):
            a.flags.writeable = False
        return GroupArrays(units, cost, link)


@dataclass(frozen=True)
class SplitProblem:
    groups: tuple[Group, ...]
    capacity_units: int
    unit_bytes: int
    link_budget_bytes_per_step: int | None = None
    migration_ms_per_unit: float = 0.0
    # No split within the capacity meets the link's own share of a step (valuation.assemble): the budget is left
    # off, or, where a caller sets one beside this flag, it only ranks splits, and one over it breaks no promise.
    link_budget_is_floor: bool = False

    def __post_init__(self) -> None:
        if not self.groups:
            raise ProblemError("problem has no groups (expected one per MoE layer plus the KV group(s))")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ProblemError(f"group names repeat: {dup}")
        if self.capacity_units < 0:
            raise ProblemError(f"capacity_units={self.capacity_units}, expected >= 0 "
                               "(HBM budget minus dense weights and activation workspace, in units)")
        if self.unit_bytes <= 0:
            raise ProblemError(f"unit_bytes={self.unit_bytes}, expected > 0")
        if self.link_budget_bytes_per_step is not None and self.link_budget_bytes_per_step < 0:
            raise ProblemError(f"link_budget_bytes_per_step={self.link_budget_bytes_per_step}, expected >= 0")
        if not math.isfinite(self.migration_ms_per_unit) or self.migration_ms_per_unit < 0:
            raise ProblemError(f"migration_ms_per_unit={self.migration_ms_per_unit!r}, expected finite >= 0")

    @property
    def num_options(self) -> int:
        return sum(len(g.options) for g in self.groups)

    def check_feasible(self) -> None:
        """Raise InfeasibleError naming the cause when no choice can satisfy a constraint on its own."""
        min_units = sum(int(g.arrays.units.min()) for g in self.groups)
        if min_units > self.capacity_units:
            worst = max(self.groups, key=lambda g: int(g.arrays.units.min()))
            raise InfeasibleError(
                f"capacity {self.capacity_units} units ({self.capacity_units * self.unit_bytes} bytes) is below "
                f"the {min_units} units the smallest options need (largest minimum: group {worst.name!r})")
        budget = self.link_budget_bytes_per_step
        if budget is not None:
            min_link = sum(int(g.arrays.link_bytes.min()) for g in self.groups)
            if min_link > budget:
                raise InfeasibleError(
                    f"link budget {budget} bytes/step is below the {min_link} bytes/step that must stream even "
                    "with every group at its least-streaming option")


@dataclass(frozen=True)
class SplitSolution:
    choice: tuple[int, ...]  # option index per group, in problem order
    objective_ms: float  # sum of effective costs (migration included)
    solver: str
    solve_ms: float
    units_used: int
    link_bytes_used: int
    binding: tuple[Constraint, ...]
    detail: str = ""  # how optimality was established (e.g. "lagrangian gap closed by search, 12 nodes")
    stats: dict[str, float] = field(default_factory=dict)


def migration_ms(problem: SplitProblem, group: Group, option: Option) -> float:
    if group.current is None or problem.migration_ms_per_unit == 0.0:
        return 0.0
    return problem.migration_ms_per_unit * abs(option.units - group.options[group.current].units)


def group_arrays(problem: SplitProblem) -> list[GroupArrays]:
    out = []
    for g in problem.groups:
        a = g.arrays
        if g.current is not None and problem.migration_ms_per_unit:
            cost = a.cost_ms + problem.migration_ms_per_unit * np.abs(a.units - a.units[g.current])
            a = GroupArrays(a.units, cost, a.link_bytes)
        out.append(a)
    return out


def effective_costs(problem: SplitProblem) -> list[np.ndarray]:
    return [a.cost_ms for a in group_arrays(problem)]


def evaluate(problem: SplitProblem, choice: tuple[int, ...]) -> tuple[float, int, int]:
    """(objective_ms, units_used, link_bytes_used) of a choice; checks the choice's shape, not feasibility."""
    if len(choice) != len(problem.groups):
        raise ProblemError(f"choice has {len(choice)} entries for {len(problem.groups)} groups")
    objective, units, link = 0.0, 0, 0
    for g, j in zip(problem.groups, choice, strict=True):
        if not 0 <= j < len(g.options):
            raise ProblemError(f"choice {j} outside group {g.name!r}'s 0..{len(g.options) - 1}")
        opt = g.options[j]
        objective += opt.cost_ms + migration_ms(problem, g, opt)
        units += opt.units
        link += opt.link_bytes
    return objective, units, link


def violations(problem: SplitProblem, choice: tuple[int, ...], link_budget: bool = True) -> list[str]:
    """Constraints the choice breaks, in words; empty when feasible. `link_budget` False: the capacity only."""
    _, units, link = evaluate(problem, choice)
    out = []
    if units > problem.capacity_units:
        out.append(f"uses {units} units of {problem.capacity_units}")
    budget = problem.link_budget_bytes_per_step
    if link_budget and budget is not None and link > budget:
        out.append(f"streams {link} bytes/step of a {budget} budget")
    return out


def binding_constraints(problem: SplitProblem, choice: tuple[int, ...],
                        link_binds: bool | None = None) -> tuple[Constraint, ...]:
    """Constraints that bind: capacity when some group could lower its cost by a single move that only the
    capacity forbids; the link budget when the solver priced it above zero (`link_binds`), else by the same
    single-move rule."""
    _, units, link = evaluate(problem, choice)
    free_units = problem.capacity_units - units
    budget = problem.link_budget_bytes_per_step
    free_link = math.inf if budget is None else budget - link
    cap = lnk = False
    for arr, j in zip(group_arrays(problem), choice, strict=True):
        better = arr.cost_ms < arr.cost_ms[j] - 1e-12 * max(1.0, abs(arr.cost_ms[j]))
        if not better.any():
            continue
        du = arr.units[better] - arr.units[j]
        dl = arr.link_bytes[better] - arr.link_bytes[j]
        cap |= bool(((du > free_units) & (dl <= free_link)).any())
        lnk |= bool(((dl > free_link) & (du <= free_units)).any())
    if link_binds is not None:
        lnk = link_binds and budget is not None
    return tuple(c for c, on in ((Constraint.CAPACITY, cap), (Constraint.LINK, lnk)) if on)


def units_for_bytes(num_bytes: int, unit_bytes: int) -> int:
    """HBM bytes as units, rounded UP so a choice in units never exceeds the byte budget."""
    return -(-num_bytes // unit_bytes)


def capacity_units_of(hbm_budget_bytes: int, dense_bytes: int, workspace_bytes: int, unit_bytes: int) -> int:
    """Units left for experts and KV: budget - dense weights - activation workspace, rounded DOWN."""
    free = hbm_budget_bytes - dense_bytes - workspace_bytes
    if free < 0:
        raise InfeasibleError(f"HBM budget {hbm_budget_bytes} bytes is below dense weights {dense_bytes} + "
                              f"activation workspace {workspace_bytes} bytes")
    return free // unit_bytes


TIE_MS = 1e-9  # option costs this close (relative above 1 ms) are one cost: below any solver's tolerance


def settle_ties(problem: SplitProblem, choice: tuple[int, ...]) -> tuple[int, ...]:
    """`choice` with each group, in order, moved to its fewest-units option that costs no more than its chosen one
    within TIE_MS, where the link budget still holds. The exact solvers' optima agree in cost to their tolerances,
    not in which of two options of one cost they take (the LRU fallback curve, predictors/irm_lru, is flat once the
    slots hold a step's union: more slots then buy ~1e-11 ms); settled, they issue one plan, and HBM that buys
    nothing is left to the KV cache."""
    arrs = group_arrays(problem)
    out = [int(j) for j in choice]
    budget = problem.link_budget_bytes_per_step
    link = sum(int(a.link_bytes[j]) for a, j in zip(arrs, out, strict=True))
    for g, a in enumerate(arrs):
        j = out[g]
        tie = a.cost_ms <= a.cost_ms[j] + TIE_MS * max(1.0, abs(float(a.cost_ms[j])))
        fits = a.link_bytes - a.link_bytes[j] <= (math.inf if budget is None else budget - link)
        ok = np.flatnonzero(tie & fits & (a.units < a.units[j]))
        if ok.size:
            k = int(ok[np.lexsort((a.cost_ms[ok], a.units[ok]))[0]])  # fewest units, then the cheaper
            link += int(a.link_bytes[k]) - int(a.link_bytes[j])
            out[g] = k
    return tuple(out)


def make_solution(problem: SplitProblem, choice: tuple[int, ...], solver: str, solve_ms: float,
                  detail: str = "", stats: dict[str, float] | None = None,
                  link_binds: bool | None = None, settle: bool = False) -> SplitSolution:
    """The solution record of `choice`; `settle` (the exact solvers) first settles its ties (`settle_ties`)."""
    if settle:
        choice = settle_ties(problem, choice)
    objective, units, link = evaluate(problem, choice)
    return SplitSolution(choice=tuple(int(j) for j in choice), objective_ms=objective, solver=solver,
                         solve_ms=solve_ms, units_used=units, link_bytes_used=link,
                         binding=binding_constraints(problem, choice, link_binds), detail=detail,
                         stats=dict(stats or {}))
