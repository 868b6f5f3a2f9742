"""The loads the engine's expert cache makes per step when tokens pick experts independently, from frequencies alone.

Runs in the controller (demand.py's fallback where a batch size has no measured curve yet). Pure numpy +
scipy.special; never imports torch, runtime or agent.

Why: the engine's cache is LRU, and a cache holding the most frequent experts (`demand.frequency_curve`) prices
far fewer loads wherever a step's union nears the slots.

Model: expert i, needed this step with probability q_i = 1 - (1 - p_i)^B, was last needed g + 1 steps ago with
probability q_i (1 - q_i)^g. As the engine keeps it (runtime's `OnDemandExperts`, miss_ratio.py), it is resident
at the step's start with s slots when at most s - 1 others were touched since: in the g steps between, or after
it in that step (a union is served by ascending id: the needed j > i). Expert j is untouched there with
probability (1 - q_j)^g, times (1 - q_j) for j > i, independently, so the count is Poisson-binomial, priced by
its mean, variance and skew. It hits when also in the step's first group of s: fewer than s of the experts
before it needed this step (that group's misses evict every resident outside it). Each expert's cells of like
mean and spread are pooled before the CDF is evaluated at every slot count. Against the engine's rule replayed
over independent draws (bench/phase_residency.py; 2,000 steps, this CPU box, session 42), loads per layer-step:

| experts, top-k | tokens a step | slots | here | engine's rule |
|---|---|---|---|---|
| 128, 8 | 8 | 37 | 23.4 | 23.9 |
| 128, 8 | 32 | 73 | 23.4 | 23.9 |
| 64, 8 | 16 | 27 | 29.7 | 29.7 |
| 32, 4 | 1 | 5 | 2.83 | 2.77 |

Until session 42 this priced a per-access LRU, whose step may evict an expert it still needs: 30.0 and 38.3 loads
at the first two rows. A 128-expert layer takes 40-90 ms on this 2-core box.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scipy.special import ndtr

MAX_GAP = 128  # steps between two uses looked at; a reuse from further back counts as a miss
POOL_EXPERTS = 0.1  # cells whose count's mean and spread agree to this many experts share one CDF


def step_need(probs: np.ndarray, batch: float) -> np.ndarray:
    """P(an expert is needed in a step of `batch` tokens), tokens drawn independently from the per-token
    probabilities `probs` (any shape, last axis experts): 1 - (1 - p)^batch, at least one token a step."""
    return 1.0 - (1.0 - np.clip(np.asarray(probs, dtype=np.float64), 0.0, 1.0)) ** max(1.0, float(batch))


def rank_cdf(q: np.ndarray, num_slots: int) -> np.ndarray:
    """[n, S + 1] P(fewer than s of the experts before i (by id) are needed in a step) at s = 0..S, for each of
    the n experts, needed independently with probabilities `q`: where i falls among its step's union."""
    out = np.zeros((q.size, num_slots + 1))
    pmf = np.zeros(q.size + 1)  # the count of experts before i needed, built one expert at a time
    pmf[0] = 1.0
    for i, qi in enumerate(q.tolist()):
        cdf = np.cumsum(pmf)
        out[i, 1:] = cdf[np.minimum(np.arange(num_slots), q.size)]
        pmf[1 : i + 2] = pmf[1 : i + 2] * (1.0 - qi) + pmf[: i + 1] * qi
        pmf[0] *= 1.0 - qi
    return out


def lru_curve(probs: np.ndarray, batch: float) -> tuple[np.ndarray, float]:
    """(loads per step with 0..E slots of the engine's LRU cache [E + 1], the step's expected union), tokens of a
    `batch`-token step drawn independently from the per-token probabilities `probs` [E] (summing to top-k)."""
    p = np.asarray(probs, dtype=np.float64)
    e = p.size
    q_all = step_need(p, batch)  # [E] P(needed in a step)
    q = q_all[q_all > 0]  # [n] experts ever routed, by id
    union = float(q.sum())
    if q.size == 0:
        return np.zeros(e + 1), 0.0
    absent = (1.0 - q)[None, :] ** np.arange(MAX_GAP)[:, None]  # [G, n] j absent from the g steps between
    # Others touched since i's use g + 1 steps ago: in the steps between, or after i in that step (the engine
    # serves a union by ascending id: the needed j > i). Sums over j < i and j > i as running sums.
    early = 1.0 - absent  # [G, n] j (< i) touched
    late = 1.0 - absent * (1.0 - q)[None, :]  # [G, n] j (> i) touched

    def others(fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:  # [G, n] sum over j != i of fn(touched_j)
        lo, hi = fn(early), fn(late)
        return np.cumsum(lo, axis=1) - lo + np.cumsum(hi[:, ::-1], axis=1)[:, ::-1] - hi

    mean = others(lambda t: t)
    var = others(lambda t: t * (1.0 - t))
    m3 = others(lambda t: t * (1.0 - t) * (1.0 - 2.0 * t))  # third central moment of one Bernoulli
    weight = q * q[None, :] * absent  # [G, n] i needed now, last needed g + 1 steps ago
    spread = np.sqrt(np.maximum(var, 0.0))
    # Each expert's cells (one a gap) pooled on an integer grid of like count and spread (no sort): a count is at
    # most n - 1 and its spread at most sqrt(n) / 2. Cells whose weight underflowed to 0 are left out.
    spread_bins = int(np.sqrt(q.size) / 2 / POOL_EXPERTS) + 2
    size = (int(q.size / POOL_EXPERTS) + 2) * spread_bins
    key = (np.rint(mean / POOL_EXPERTS).astype(np.int64) * spread_bins + np.rint(spread / POOL_EXPERTS).astype(np.int64)
           + size * np.arange(q.size)[None, :]).ravel()
    cells, cell = np.unique(key, return_inverse=True)
    weight = weight.ravel()
    w = np.bincount(cell, weights=weight)
    used = np.flatnonzero(w)
    w, expert = w[used], cells[used] // size  # [C] pooled cells, whose each is

    def pooled(v: np.ndarray) -> np.ndarray:  # the cells' weighted mean of v
        return np.bincount(cell, weights=weight * v.ravel())[used] / w

    mu, sd, third = pooled(mean), np.maximum(pooled(spread), 1e-6), pooled(m3)
    skew = third / sd**3
    # Found at the step's start with s slots: at most s - 1 others touched since. The count is Poisson-binomial:
    # the refined normal approximation (Volkova 1996), Phi(x) + skew (1 - x^2) phi(x) / 6 at
    # x = (s - 1/2 - mean) / spread, keeps the skew a count near its bound n - 1 has (plain Phi priced 0.11 loads
    # at 7 of 8 slots where LRU makes 0.003).
    # float32 from here: half the bytes in the [C, E] passes; a load moves by < 1e-4.
    mu, sd, skew = mu.astype(np.float32), sd.astype(np.float32), skew.astype(np.float32)
    x = (np.arange(1, e + 1, dtype=np.float32)[None, :] - 0.5 - mu[:, None]) / sd[:, None]  # [C, E]
    below = ndtr(x) + skew[:, None] * (1.0 - x**2) * np.exp(-0.5 * x**2) / np.float32(6.0 * np.sqrt(2.0 * np.pi))
    below = np.maximum.accumulate(np.clip(below, 0.0, 1.0), axis=1)  # a CDF: within [0, 1], never falling
    found = np.zeros((q.size, e))  # [n, E] i resident at the step's start, s = 1..E
    first = np.flatnonzero(np.r_[True, expert[1:] != expert[:-1]])  # the cells come sorted by expert
    found[expert[first]] = np.add.reduceat(w[:, None] * below, first, axis=0)
    # ... and in the step's first group of s (fewer than s needed experts before it): that group's misses evict
    # every resident outside it, so a later group finds nothing (miss_ratio.py).
    hits = np.concatenate([[0.0], (found * rank_cdf(q, e)[:, 1:]).sum(axis=0)])  # [E + 1]
    return np.maximum(union - hits, 0.0), union
