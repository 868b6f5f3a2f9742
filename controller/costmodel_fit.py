"""Online Bayesian linear regression: the cost model's parameters learned from telemetry windows.

Runs in the controller process (and in `tierplan sim`). Pure numpy. The prior mean is the constants a user
gives (a hardware sheet, a bench result); the prior strength says how many observations they are worth.
Each window adds one weighted observation; old evidence decays by `forgetting` per update so the fit
follows a drifting machine (thermal limits, a neighbour on the PCIe switch). Features that a telemetry
window cannot tell apart (collinear, or always zero) stay at their prior: the posterior only moves along
directions the data spans. It must never touch I/O or keep global state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

_ROBUST_AFTER = 5  # observations before residuals are trusted to say what an outlier is
HUBER_K = 1.5  # residuals beyond this many median absolute residuals are down-weighted (the default)
_SCALE_RATE = 0.1  # log-step of the residual scale per observation


class OnlineLinear:
    """y ≈ theta · x with a Gaussian prior N(prior_mean, (prior_strength * diag(scale^-2))^-1)."""

    def __init__(self, prior_mean: Sequence[float], prior_scale: Sequence[float], prior_strength: float = 1.0,
                 forgetting: float = 1.0, robust: bool = False, huber_k: float = HUBER_K) -> None:
        mean = np.asarray(prior_mean, dtype=np.float64)  # [P]
        scale = np.asarray(prior_scale, dtype=np.float64)  # [P]
        if mean.shape != scale.shape or mean.ndim != 1:
            raise ValueError(f"OnlineLinear: prior_mean and prior_scale must be 1-D of one length, got {mean.shape} "
                             f"and {scale.shape}")
        if not (scale > 0).all() or prior_strength <= 0 or not 0 < forgetting <= 1 or not huber_k > 0:
            raise ValueError("OnlineLinear: prior_scale, prior_strength and huber_k must be > 0, forgetting in (0, 1]")
        self._prior_prec = np.diag(prior_strength / scale**2)  # [P, P]
        self._prior_mean = mean
        self._prec = self._prior_prec.copy()  # [P, P] posterior precision
        self._rhs = self._prior_prec @ mean  # [P] precision-weighted mean
        self.forgetting, self.robust, self.huber_k = forgetting, robust, huber_k
        self.num_updates = 0
        self._res_scale = 0.0

    @property
    def theta(self) -> np.ndarray:
        return np.linalg.solve(self._prec, self._rhs)  # [P]

    def theta_at_least(self, lower: Sequence[float]) -> np.ndarray:
        """The posterior mode subject to theta >= lower (active set: a coordinate below its bound is held
        there and the others move as the posterior's correlations say)."""
        prec, mean = self._prec, self.theta
        low = np.asarray(lower, dtype=np.float64)  # [P]
        held = np.zeros(mean.shape, dtype=bool)
        theta = mean.copy()
        for _ in range(mean.size):
            below = (theta < low - 1e-15) & ~held
            if not below.any():
                break
            held |= below
            free = ~held
            theta = np.where(held, low, mean)
            if free.any():  # conditional mode of the free coordinates given the held ones
                shift = np.linalg.solve(prec[np.ix_(free, free)], prec[np.ix_(free, held)] @ (low[held] - mean[held]))
                theta[free] = mean[free] - shift
        return np.maximum(theta, low)

    def update(self, x: Sequence[float], y: float, weight: float = 1.0) -> None:
        """Add one observation (weight = how many samples it summarises, e.g. the window's steps). With
        `robust`, an observation far from the current fit (a step a neighbour's process preempted) counts
        less: Huber weights against a running scale of the residuals."""
        xv = np.asarray(x, dtype=np.float64)  # [P]
        if xv.shape != self._rhs.shape or not np.isfinite(xv).all() or not np.isfinite(y) or weight <= 0:
            return
        if self.robust:
            residual = abs(y - float(np.dot(self.theta, xv)))
            if self.num_updates >= _ROBUST_AFTER and self._res_scale > 0:
                cut = self.huber_k * self._res_scale
                weight *= 1.0 if residual <= cut else cut / residual
            # The scale tracks the median absolute residual (a stochastic-approximation quantile: up when a
            # residual is above it, down when below), which a heavy tail of preempted steps cannot inflate.
            if self._res_scale == 0:
                self._res_scale = residual
            else:
                self._res_scale *= math.exp(_SCALE_RATE if residual > self._res_scale else -_SCALE_RATE)
        # Forget toward the prior, not toward zero: a long quiet spell leaves the constants, not nothing.
        f = self.forgetting
        self._prec = f * self._prec + (1 - f) * self._prior_prec + weight * np.outer(xv, xv)
        self._rhs = f * self._rhs + (1 - f) * (self._prior_prec @ self._prior_mean) + weight * y * xv
        self.num_updates += 1

    def predict(self, x: Sequence[float]) -> float:
        return float(np.dot(self.theta, np.asarray(x, dtype=np.float64)))
