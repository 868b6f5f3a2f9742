"""The loads an LRU expert cache makes per step when tokens pick experts independently, from frequencies alone.

Runs in the controller (demand.py's fallback where a batch size has no measured LRU curve yet). Pure numpy +
scipy.special; never imports torch, runtime or agent.

Why: the engine's cache is LRU, and a cache holding the most frequent experts (`demand.frequency_curve`) prices
far fewer loads wherever a step's union nears the slots. Over the phase bench's routing table (qwen3 cut to 8
layers, 66 experts of layer 0 in use), loads per layer-step, against an LRU cache walked over independent draws
from the same frequencies (3,000 steps; bench/results/phase_h200.md, session 23):

| tokens a step | slots | frequencies | LRU walk | here |
|---|---|---|---|---|
| 64 | 51 | 14.6 | 37.3 | 36.4 |
| 8 | 40 | 13.9 | 25.0 | 25.0 |
| 8 | 60 | 2.4 | 4.9 | 4.9 |
| 1 | 51 | 1.25 | 1.74 | 1.71 |

Model (step-granular reuse): expert i, needed this step with probability q_i = 1 - (1 - p_i)^B, was last needed
g + 1 steps ago with probability q_i (1 - q_i)^g. It hits with s slots when at most s - 1 other experts were
touched since: in the g steps between, after it in that step, or before it in this one (a step touches its union
in random order: i's positions a, b uniform on a grid). Expert j is untouched there with probability
u_j = (1 - q_j)^g (1 - q_j (1 - a)) (1 - q_j b), independently, so the count is Poisson-binomial, priced by its
mean, variance and skew (the mean-field count, its expectation for the count, gave 0.22 loads at 6 of 8 slots
where the walk makes 1.53). Cells of like mean and spread are pooled before the CDF is evaluated at every slot
count; with the position pairs' symmetry and the cells' sums in float32 (within 1e-7 of float64 over random
layers), a 128-expert layer takes ~35 ms on this 2-core box (~60 ms before both).
"""

from __future__ import annotations

import numpy as np
from scipy.special import ndtr

POSITIONS = 8  # where in its step an access falls: a grid over [0, 1), for the earlier step's use and this one's
MAX_GAP = 128  # steps between two uses looked at; a reuse from further back counts as a miss
POOL_EXPERTS = 0.05  # cells whose count's mean and spread agree to this many experts share one CDF


def step_need(probs: np.ndarray, batch: float) -> np.ndarray:
    """P(an expert is needed in a step of `batch` tokens), tokens drawn independently from the per-token
    probabilities `probs` (any shape, last axis experts): 1 - (1 - p)^batch, at least one token a step."""
    return 1.0 - (1.0 - np.clip(np.asarray(probs, dtype=np.float64), 0.0, 1.0)) ** max(1.0, float(batch))


def lru_curve(probs: np.ndarray, batch: float) -> tuple[np.ndarray, float]:
    """(loads per step with 0..E LRU slots [E + 1], the step's expected union), tokens of a `batch`-token step
    drawn independently from the per-token probabilities `probs` [E] (summing to top-k)."""
    p = np.asarray(probs, dtype=np.float64)
    e = p.size
    q_all = step_need(p, batch)  # [E] P(needed in a step)
    q = q_all[q_all > 0]  # [n] experts ever routed
    union = float(q.sum())
    if q.size == 0:
        return np.zeros(e + 1), 0.0
    pos = (np.arange(POSITIONS) + 0.5) / POSITIONS  # [P]
    absent = (1.0 - q)[None, :] ** np.arange(MAX_GAP)[:, None]  # [G, n] j absent from the g steps between
    # j not after i's position a in the earlier step is 1 - q_j (1 - pos_a) = 1 - q_j pos_(P-1-a): j not before
    # position P-1-a in this step. So a pair (a, b) and the pair (P-1-b, P-1-a) see the same count: each
    # unordered pair of `before` rows is computed once and weighs 2 off the diagonal (36 cells of 64).
    first, second = np.triu_indices(POSITIONS)
    twice = np.where(first == second, 1.0, 2.0)  # [U]
    before = 1.0 - q[None, :] * pos[:, None]  # [P, n] j not before the position in its step
    # float32 from here: half the bytes in the passes below; the counts' moments change by < 1e-7 of a load.
    untouched = (absent[:, None, :] * (before[first] * before[second])[None, :, :]).astype(np.float32)  # [G, U, n]
    touched = 1.0 - untouched
    mean = touched.sum(axis=-1, keepdims=True) - touched  # [G, U, n] others touched, for i = the last axis
    each_var = touched * untouched
    var = each_var.sum(axis=-1, keepdims=True) - each_var
    each_m3 = each_var * (untouched - touched)  # third central moment of one Bernoulli
    m3 = each_m3.sum(axis=-1, keepdims=True) - each_m3
    weight = (q * q[None, :] * absent / POSITIONS**2)[:, None, :] * twice[None, :, None]  # [G, U, n]
    # Cells whose weight underflowed to 0 pool with the rest: they add nothing to any sum.
    mean, weight, var, m3 = mean.ravel(), weight.ravel(), var.ravel(), m3.ravel()
    spread = np.sqrt(np.maximum(var, 0.0))
    # Pooled on an integer grid (no sort): a count is at most n - 1 and its spread at most sqrt(n) / 2.
    spread_bins = int(np.sqrt(q.size) / 2 / POOL_EXPERTS) + 2
    key = np.rint(mean / POOL_EXPERTS).astype(np.int64) * spread_bins + np.rint(spread / POOL_EXPERTS).astype(np.int64)
    size = (int(q.size / POOL_EXPERTS) + 2) * spread_bins
    w = np.bincount(key, weights=weight, minlength=size)
    used = np.flatnonzero(w)
    w = w[used]  # [C] pooled cells

    def pooled(x: np.ndarray) -> np.ndarray:  # the cells' weighted mean of x
        return np.bincount(key, weights=weight * x, minlength=size)[used] / w

    mu, sd, third = pooled(mean), np.maximum(pooled(spread), 1e-6), pooled(m3)
    skew = third / sd**3
    # A hit with s slots: at most s - 1 others touched. The count is Poisson-binomial: the refined normal
    # approximation (Volkova 1996), Phi(x) + skew (1 - x^2) phi(x) / 6 at x = (s - 1/2 - mean) / spread, keeps
    # the skew a count near its bound n - 1 has (plain Phi priced 0.11 loads at 7 of 8 slots where LRU makes 0.003).
    x = (np.arange(1, e + 1)[None, :] - 0.5 - mu[:, None]) / sd[:, None]  # [C, E]
    below = ndtr(x) + skew[:, None] * (1.0 - x**2) * np.exp(-0.5 * x**2) / (6.0 * np.sqrt(2.0 * np.pi))
    below = np.maximum.accumulate(np.clip(below, 0.0, 1.0), axis=1)  # a CDF: within [0, 1], never falling
    hits = np.concatenate([[0.0], w @ below])  # [E + 1]
    return np.maximum(union - hits, 0.0), union
