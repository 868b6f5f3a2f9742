"""Local improvement of a feasible split by slot exchanges between layers (used when the link budget binds).

Runs inside the controller process; pure numpy. Never imports torch, runtime or agent; never makes a split
infeasible. A Lagrangian DP answer is optimal for its price, not for the budget: it can leave link budget
unused or sit one step off. Moving d slots from one layer to another (same units, so the capacity still holds)
or into free units, when the move lowers the cost and the link budget still holds, recovers most of that gap.
Groups whose options are consecutive unit counts (a layer's slot counts) exchange slots; any other group (the
KV group's block steps) moves one option up or down with the layers rebalancing around it: units it takes
come from the layers' cheapest slots, units it frees go to their most valuable ones.
"""

from __future__ import annotations

import heapq

import numpy as np

from tierplan.controller.optimizer.problem import GroupArrays

MAX_STEP = 4  # slots moved per exchange: 1..MAX_STEP
MAX_ROUNDS = 400
GROUP_REACH = 2  # a non-slot group tries the options this many steps either side of its current one


def _dense(arrs: list[GroupArrays]) -> list[int]:
    return [g for g, a in enumerate(arrs)
            if a.units.size > 1 and bool((np.diff(a.units) == 1).all())]


class _Slots:
    """The layers' slot positions with padded cost/link rows (moves off either end cost inf)."""

    def __init__(self, arrs: list[GroupArrays], dense: list[int], choice: tuple[int, ...]) -> None:
        num_j = max(arrs[g].units.size for g in dense)
        self.cost = np.full((len(dense), num_j + 2 * MAX_STEP), np.inf)
        self.link = np.zeros_like(self.cost)
        for i, g in enumerate(dense):
            n = arrs[g].units.size
            self.cost[i, MAX_STEP:MAX_STEP + n] = arrs[g].cost_ms
            self.link[i, MAX_STEP:MAX_STEP + n] = arrs[g].link_bytes
        self.pos = np.array([choice[g] for g in dense]) + MAX_STEP
        self.rows = np.arange(len(dense))

    def rebalance(self, num_units: int, take: bool, lam: float) -> tuple[float, float, np.ndarray]:
        """Take (or give) `num_units` slots one at a time, cheapest (most valuable) first by cost + lam * link:
        (d cost, d link, new positions)."""
        pos = self.pos.copy()
        sign = -1 if take else 1
        last = self.cost.shape[1] - 1

        def price(i: int) -> float:
            nxt = pos[i] + sign
            if not 0 <= nxt <= last:
                return np.inf
            return float(self.cost[i, nxt] - self.cost[i, pos[i]] + lam * (self.link[i, nxt] - self.link[i, pos[i]]))

        heap = [(price(i), i) for i in self.rows.tolist()]
        heapq.heapify(heap)
        d_cost = d_link = 0.0
        for _ in range(num_units):
            key, i = heapq.heappop(heap)
            if not np.isfinite(key):
                return np.inf, 0.0, pos
            d_cost += self.cost[i, pos[i] + sign] - self.cost[i, pos[i]]
            d_link += self.link[i, pos[i] + sign] - self.link[i, pos[i]]
            pos[i] += sign
            heapq.heappush(heap, (price(i), i))
        return d_cost, d_link, pos


def improve_by_exchange(arrs: list[GroupArrays], choice: tuple[int, ...], capacity: int, budget: float,
                        lam: float = 0.0) -> tuple[tuple[int, ...], int]:
    """(a split no costlier than `choice`, within both budgets if `choice` was; the number of moves made).
    `lam` (ms per link byte) ranks the slots a group move takes from or gives to the layers."""
    dense = _dense(arrs)
    if not dense:
        return choice, 0
    slots = _Slots(arrs, dense, choice)
    out = list(choice)
    sparse = [g for g in range(len(arrs)) if g not in set(dense)]
    used = sum(int(a.units[j]) for a, j in zip(arrs, choice, strict=True))
    streamed = sum(float(a.link_bytes[j]) for a, j in zip(arrs, choice, strict=True))
    moves = 0
    for _ in range(MAX_ROUNDS):
        step = _best_slot_move(slots, capacity - used, budget - streamed)
        if step is not None:
            d_units, d_link, pos = step
        else:
            found = _best_group_move(arrs, sparse, out, slots, capacity - used, budget - streamed, lam)
            if found is None:
                break
            g, j, d_units, d_link, pos = found
            out[g] = j
        slots.pos = pos
        used += d_units
        streamed += d_link
        moves += 1
    for i, g in enumerate(dense):
        out[g] = int(slots.pos[i]) - MAX_STEP
    return tuple(out), moves


def _best_slot_move(slots: _Slots, free_units: int, free_link: float) -> tuple[int, float, np.ndarray] | None:
    """The best improving exchange of 1..MAX_STEP slots between two layers, or fill of free units."""
    cost, link, pos, rows = slots.cost, slots.link, slots.pos, slots.rows
    steps = np.arange(1, MAX_STEP + 1)[:, None]  # [D, 1]
    here_c, here_l = cost[rows, pos], link[rows, pos]
    down_c, down_l = cost[rows, pos - steps] - here_c, link[rows, pos - steps] - here_l  # [D, G]
    up_c, up_l = cost[rows, pos + steps] - here_c, link[rows, pos + steps] - here_l
    pair_c = down_c[:, :, None] + up_c[:, None, :]  # [D, from, to]
    pair_l = down_l[:, :, None] + up_l[:, None, :]
    pair_c[:, rows, rows] = np.inf
    pair_c[pair_l > free_link] = np.inf
    fill_c = np.where((steps <= free_units) & (up_l <= free_link), up_c, np.inf)  # [D, G]
    best_pair = np.unravel_index(int(np.argmin(pair_c)), pair_c.shape)
    best_fill = np.unravel_index(int(np.argmin(fill_c)), fill_c.shape)
    if min(pair_c[best_pair], fill_c[best_fill]) >= -1e-12:
        return None
    new = pos.copy()
    if fill_c[best_fill] <= pair_c[best_pair]:
        d, g = int(best_fill[0]) + 1, int(best_fill[1])
        new[g] += d
        return d, float(up_l[best_fill]), new
    d, a, b = int(best_pair[0]) + 1, int(best_pair[1]), int(best_pair[2])
    new[a] -= d
    new[b] += d
    return 0, float(pair_l[best_pair]), new


def _best_group_move(arrs: list[GroupArrays], sparse: list[int], choice: list[int], slots: _Slots,
                     free_units: int, free_link: float, lam: float) -> tuple[int, int, int, float, np.ndarray] | None:
    """The best improving move of a non-slot group to a neighbouring option, the layers rebalancing its units."""
    best = None
    for g in sparse:
        a, j = arrs[g], choice[g]
        order = np.argsort(a.units, kind="stable").tolist()
        at = order.index(j)
        for k in order[max(0, at - GROUP_REACH):at] + order[at + 1:at + 1 + GROUP_REACH]:
            d_units = int(a.units[k] - a.units[j])
            taken = max(0, d_units - free_units)
            given = max(0, -d_units)
            r_cost, r_link, pos = slots.rebalance(taken or given, taken > 0, lam) if taken or given else \
                (0.0, 0.0, slots.pos)
            d_cost = float(a.cost_ms[k] - a.cost_ms[j]) + r_cost
            d_link = float(a.link_bytes[k] - a.link_bytes[j]) + r_link
            if d_cost < -1e-12 and d_link > free_link:  # promising but streams too much: swap slots to repair
                fixed = _repair(slots, pos, d_link - free_link, lam)
                if fixed is not None:
                    d_cost, d_link, pos = d_cost + fixed[0], d_link + fixed[1], fixed[2]
            if d_cost < -1e-12 and d_link <= free_link and (best is None or d_cost < best[0]):
                net_units = d_units - taken + given
                best = (d_cost, g, k, net_units, d_link, pos)
    return None if best is None else best[1:]


def _repair(slots: _Slots, pos: np.ndarray, excess_link: float, lam: float,
            max_moves: int = 96) -> tuple[float, float, np.ndarray] | None:
    """Slot exchanges that cut link bytes at the least cost + lam * link until `excess_link` is gone:
    (d cost, d link, positions), or None if they cannot."""
    cost, link, rows = slots.cost, slots.link, slots.rows
    pos = pos.copy()
    steps = np.arange(1, MAX_STEP + 1)[:, None]
    d_cost = d_link = 0.0
    for _ in range(max_moves):
        if d_link <= -excess_link:
            return d_cost, d_link, pos
        here_c, here_l = cost[rows, pos], link[rows, pos]
        down_c, down_l = cost[rows, pos - steps] - here_c, link[rows, pos - steps] - here_l
        up_c, up_l = cost[rows, pos + steps] - here_c, link[rows, pos + steps] - here_l
        pair_c = down_c[:, :, None] + up_c[:, None, :]
        pair_l = down_l[:, :, None] + up_l[:, None, :]
        key = np.where(pair_l < 0, pair_c + lam * pair_l, np.inf)
        key[:, rows, rows] = np.inf
        best = np.unravel_index(int(np.argmin(key)), key.shape)
        if not np.isfinite(key[best]):
            return None
        d, a, b = int(best[0]) + 1, int(best[1]), int(best[2])
        d_cost += float(pair_c[best])
        d_link += float(pair_l[best])
        pos[a] -= d
        pos[b] += d
    return (d_cost, d_link, pos) if d_link <= -excess_link else None
