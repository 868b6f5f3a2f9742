"""The link budget's price for the exact DP: the LP relaxation's dual, by nested bisection on its subgradients.

Runs inside the controller process; pure numpy. Never imports torch, runtime or agent; never mutates its input.
Relaxing both constraints of the split MCKP gives the concave dual
    D(mu, lam) = sum_g min_j (cost_j + mu * units_j + lam * link_j) - mu * C - lam * B,
whose maximiser is the LP relaxation's pair of shadow prices. Any lam >= 0 gives the DP a valid bound, so the
price only needs to be good, not exact: log-space bisection to about 1% is plenty, at ~20 µs per evaluation.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tierplan.controller.optimizer.problem import GroupArrays

OUTER_STEPS = 14  # bisection steps on lam (log space)
INNER_STEPS = 18  # bisection steps on mu for each lam


class _Padded:
    """All groups' options as [G, J] matrices (missing options: infinite cost, so never the minimum)."""

    def __init__(self, arrs: list[GroupArrays]) -> None:
        num_j = max(a.units.size for a in arrs)
        shape = (len(arrs), num_j)
        self.cost, self.units, self.link = np.full(shape, np.inf), np.zeros(shape), np.zeros(shape)
        for g, a in enumerate(arrs):
            n = a.units.size
            self.cost[g, :n], self.units[g, :n], self.link[g, :n] = a.cost_ms, a.units, a.link_bytes
        self.rows = np.arange(len(arrs))

    def usage(self, mu: float, lam: float) -> tuple[float, float]:
        """(units, link bytes) of the groupwise minimisers at prices (mu, lam)."""
        j = np.argmin(self.cost + mu * self.units + lam * self.link, axis=1)
        return float(self.units[self.rows, j].sum()), float(self.link[self.rows, j].sum())


def _first_fit(check: Callable[[float], bool], lo: float, hi: float, steps: int) -> float:
    """Smallest price in (lo, hi] (log-space bisection) at which check(price) holds; check(hi) must hold."""
    for _ in range(steps):
        mid = (lo * hi) ** 0.5 if lo > 0 else hi / 1024.0
        if check(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _grow(check: Callable[[float], bool], start: float) -> float | None:
    price = start
    for _ in range(60):
        if check(price):
            return price
        price *= 4.0
    return None


def link_price(arrs: list[GroupArrays], capacity: int, budget: float) -> float:
    """lam (ms per byte) maximising the LP dual; 0 when the LP relaxation streams within the budget."""
    pad = _Padded(arrs)
    cost_span = float(np.nanmax(np.where(np.isfinite(pad.cost), pad.cost, np.nan)) -
                      np.nanmin(np.where(np.isfinite(pad.cost), pad.cost, np.nan))) + 1e-12
    unit_span = float(pad.units.max()) + 1.0
    link_span = float(pad.link.max()) + 1.0

    def mu_for(lam: float) -> float:
        if pad.usage(0.0, lam)[0] <= capacity:
            return 0.0
        hi = _grow(lambda mu: pad.usage(mu, lam)[0] <= capacity, cost_span / unit_span)
        if hi is None:
            return 0.0
        return _first_fit(lambda mu: pad.usage(mu, lam)[0] <= capacity, 0.0, hi, INNER_STEPS)

    def fits(lam: float) -> bool:
        return pad.usage(mu_for(lam), lam)[1] <= budget

    if fits(0.0):
        return 0.0
    hi = _grow(fits, cost_span / link_span)
    if hi is None:  # even an unbounded price cannot meet the budget in the relaxation: price it high
        return cost_span / max(budget, 1.0) * 1e6
    return _first_fit(fits, 0.0, hi, OUTER_STEPS)
