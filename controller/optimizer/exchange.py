"""Local improvement of a feasible split by slot exchanges between layers (used when the link budget binds).

Runs inside the controller process; pure numpy. Never imports torch, runtime or agent; never makes a split
infeasible. A Lagrangian DP answer is optimal for its price, not for the budget: it can leave link budget
unused or sit one step off. Moving d slots from one layer to another (same units, so the capacity still holds)
or into free units, when the move lowers the cost and the link budget still holds, recovers most of that gap.
Only groups whose options are consecutive unit counts (a layer's slot counts) take part.
"""

from __future__ import annotations

import numpy as np

from controller.optimizer.problem import GroupArrays

MAX_STEP = 4  # slots moved per exchange: 1..MAX_STEP
MAX_ROUNDS = 400


def _dense(arrs: list[GroupArrays]) -> list[int]:
    return [g for g, a in enumerate(arrs)
            if a.units.size > 1 and bool((np.diff(a.units) == 1).all())]


def improve_by_exchange(arrs: list[GroupArrays], choice: tuple[int, ...], capacity: int,
                        budget: float) -> tuple[tuple[int, ...], int]:
    """(a split no costlier than `choice`, within both budgets if `choice` was; the number of moves made)."""
    dense = _dense(arrs)
    if len(dense) < 1:
        return choice, 0
    num_j = max(arrs[g].units.size for g in dense)
    cost = np.full((len(dense), num_j + 2 * MAX_STEP), np.inf)  # padded: moves off either end cost inf
    link = np.zeros_like(cost)
    for i, g in enumerate(dense):
        n = arrs[g].units.size
        cost[i, MAX_STEP:MAX_STEP + n], link[i, MAX_STEP:MAX_STEP + n] = arrs[g].cost_ms, arrs[g].link_bytes
    out = list(choice)
    pos = np.array([choice[g] for g in dense]) + MAX_STEP
    rows = np.arange(len(dense))
    used = sum(int(a.units[j]) for a, j in zip(arrs, choice, strict=True))
    streamed = sum(float(a.link_bytes[j]) for a, j in zip(arrs, choice, strict=True))
    steps = np.arange(1, MAX_STEP + 1)[:, None]  # [D, 1]
    moves = 0
    for _ in range(MAX_ROUNDS):
        here_c, here_l = cost[rows, pos], link[rows, pos]
        down_c, down_l = cost[rows, pos - steps] - here_c, link[rows, pos - steps] - here_l  # [D, G]
        up_c, up_l = cost[rows, pos + steps] - here_c, link[rows, pos + steps] - here_l
        pair_c = down_c[:, :, None] + up_c[:, None, :]  # [D, from, to]
        pair_l = down_l[:, :, None] + up_l[:, None, :]
        pair_c[:, rows, rows] = np.inf
        pair_c[pair_l > budget - streamed] = np.inf
        fill_c = np.where((steps <= capacity - used) & (up_l <= budget - streamed), up_c, np.inf)  # [D, G]
        best_pair = np.unravel_index(int(np.argmin(pair_c)), pair_c.shape)
        best_fill = np.unravel_index(int(np.argmin(fill_c)), fill_c.shape)
        gain_pair, gain_fill = pair_c[best_pair], fill_c[best_fill]
        if min(gain_pair, gain_fill) >= -1e-12:
            break
        if gain_fill <= gain_pair:
            d, g = int(best_fill[0]) + 1, int(best_fill[1])
            pos[g] += d
            used += d
            streamed += float(up_l[best_fill])
        else:
            d, a, b = int(best_pair[0]) + 1, int(best_pair[1]), int(best_pair[2])
            streamed += float(pair_l[best_pair])
            pos[a] -= d
            pos[b] += d
        moves += 1
    for i, g in enumerate(dense):
        out[g] = int(pos[i]) - MAX_STEP
    return tuple(out), moves
