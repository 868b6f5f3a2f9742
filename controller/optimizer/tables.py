"""The capacity DP kernel of the exact split solver (`dp.py`): tables over 0..C units, backtracking, halves.

Runs inside the controller process; pure numpy. Never imports torch, runtime or agent; never mutates its inputs.
A table T[c] is the least total weight of a set of groups using at most c units; it is non-increasing in c and
stored only up to the units those groups could ever use (flat beyond, read with `at_capacity`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from tierplan.controller.optimizer.problem import Group, GroupArrays

_ROWS_PER_CHUNK = 16  # option rows reduced per numpy call: small enough to stay in cache


def at_capacity(table: np.ndarray, c: int | np.ndarray) -> np.ndarray:
    return table[np.minimum(c, table.size - 1)]


@dataclass(frozen=True)
class Layout:
    """A group's options grouped by (possibly rounded) unit count, for building its dense weight vector."""

    units: np.ndarray  # [J] int64, per option
    order: np.ndarray  # [J] options sorted by units
    starts: np.ndarray  # [U] first sorted position of each distinct unit count
    distinct: np.ndarray  # [U] int64, the distinct unit counts, ascending

    @classmethod
    def of_group(cls, group: Group) -> Layout:
        return cls(group.arrays.units, *group.by_units)


def group_step(prev: np.ndarray, lay: Layout, weight: np.ndarray, n: int) -> np.ndarray:
    """new[c] = min_j weight_j + prev[min(c - units_j, len(prev) - 1)] over units_j <= c, for c < n."""
    best = np.minimum.reduceat(weight[lay.order], lay.starts)  # [U] cheapest option per unit count
    keep = best < np.minimum.accumulate(np.concatenate([[np.inf], best[:-1]]))  # more units, no cheaper: drop
    keep &= lay.distinct < n
    units, best = lay.distinct[keep], best[keep]
    new = np.full(n, np.inf)
    if units.size == 0:
        return new
    umin, umax = int(units[0]), int(units[-1])
    width = n - umin
    # Row r of `shifted` is prev (flat past its end) shifted right by umax - r units, inf where c < units:
    # row umax - u, column c - umin holds prev[c - u]. Rows are windows of one padded array (no copies).
    padded = np.full(umax - umin + width, np.inf)
    tail = padded[umax - umin:]
    m = min(prev.size, width)
    tail[:m] = prev[:m]
    tail[m:] = prev[-1]
    step = padded.strides[0]
    shifted = as_strided(padded, shape=(umax - umin + 1, width), strides=(step, step), writeable=False)
    acc = new[umin:]
    least = np.empty(width)
    span = umax - umin + 1
    if span <= 2 * units.size:  # dense (an MoE layer's 0..E slots): row slices are views, no gathering
        row_weight = np.full(span, np.inf)
        row_weight[umax - units] = best  # holes (dominated counts) stay inf
        block = np.empty((min(_ROWS_PER_CHUNK, span), width))
        for r0 in range(0, span, _ROWS_PER_CHUNK):
            r1 = min(span, r0 + _ROWS_PER_CHUNK)
            part = block[: r1 - r0]
            np.add(shifted[r0:r1], row_weight[r0:r1, None], out=part)
            np.minimum.reduce(part, axis=0, out=least)
            np.minimum(acc, least, out=acc)
        return new
    rows = umax - units  # sparse (KV block counts in steps): gather the few rows there are
    for i in range(0, rows.size, _ROWS_PER_CHUNK):
        part = shifted[rows[i:i + _ROWS_PER_CHUNK]]  # [R, width] gathered copy
        part += best[i:i + _ROWS_PER_CHUNK, None]
        np.minimum.reduce(part, axis=0, out=least)
        np.minimum(acc, least, out=acc)
    return new


def tables_of(arrs: list[GroupArrays], lays: list[Layout], lam: float, capacity: int) -> list[np.ndarray]:
    """Suffix tables: T[g][c] = least sum of cost_ms + lam * link_bytes over groups g.. within c units.

    Groups are added last-first, so a list sorted by descending units keeps the early tables short."""
    tables: list[np.ndarray] = [np.zeros(1)]
    need = 0
    for a, lay in zip(reversed(arrs), reversed(lays), strict=True):
        need += int(lay.distinct[-1])
        weight = weights(a, lam)
        tables.append(group_step(tables[-1], lay, weight, min(capacity, need) + 1))
    tables.reverse()
    return tables


def backtrack(arrs: list[GroupArrays], lays: list[Layout], tables: list[np.ndarray], lam: float,
               capacity: int) -> tuple[int, ...] | None:
    if not math.isfinite(tables[0][min(capacity, tables[0].size - 1)]):
        return None
    choice, c = [], capacity
    for g, (a, lay) in enumerate(zip(arrs, lays, strict=True)):
        u = lay.units
        prev = tables[g + 1]
        weight = weights(a, lam)
        rem = c - u
        vals = np.where(rem >= 0, weight + prev[np.clip(rem, 0, prev.size - 1)], np.inf)
        j = int(np.argmin(vals))
        choice.append(j)
        c -= int(u[j])
    return tuple(choice)


def weights(a: GroupArrays, lam: float) -> np.ndarray:
    return a.cost_ms + lam * a.link_bytes if lam else a.cost_ms


def halves(arrs: list[GroupArrays], lays: list[Layout], lam: float,
           capacity: int) -> tuple[tuple[int, ...], float] | None:
    """Meet in the middle: two halves, each built small-groups-first (their tables stay short until late), joined
    at the best split of capacity between them. Same optimum as one pass, far fewer table cells."""
    if len(arrs) < 2:
        tables = tables_of(arrs, lays, lam, capacity)
        choice = backtrack(arrs, lays, tables, lam, capacity)
        return None if choice is None else (choice, float(at_capacity(tables[0], capacity)))
    by_need = sorted(range(len(arrs)), key=lambda g: int(lays[g].distinct[-1]), reverse=True)
    parts = [by_need[0::2], by_need[1::2]]  # tables_of adds a list's groups last-first: smallest first
    tables = [tables_of([arrs[g] for g in h], [lays[g] for g in h], lam, capacity) for h in parts]
    c1 = np.arange(capacity + 1)
    t0, t1 = tables[0][0], tables[1][0]
    joined = t0[np.minimum(c1, t0.size - 1)] + t1[np.minimum(capacity - c1, t1.size - 1)]
    split = int(np.argmin(joined))
    if not math.isfinite(joined[split]):
        return None
    choice = [0] * len(arrs)
    for h, tab, cap in zip(parts, tables, (split, capacity - split), strict=True):
        part = backtrack([arrs[g] for g in h], [lays[g] for g in h], tab, lam, cap)
        assert part is not None
        for g, j in zip(h, part, strict=True):
            choice[g] = j
    return tuple(choice), float(joined[split])
