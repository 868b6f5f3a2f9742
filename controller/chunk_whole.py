"""The chunked decode step priced on the whole split, over the running batch's swing between prefills.

Runs in the controller process; pure arithmetic (never imports torch, runtime or agent). A decode step leaves its
graphs and runs chunked (`CostModel`'s `chunked_step_ms`, the engine's `eager/layer_over_slots`) where any MoE
layer's union of experts outruns its slots. The knapsack can only charge each layer its own chance of that
(`valuation.option_stall_ms`: a union bound, at the mean batch), which is wrong two ways once a split is chosen:
the layers chunk together, so the sum overstates P(any layer) (over 186 mixed qwen3 plans of H100 phase runs
01-53 it charged 2.84 chunked steps a step where 0.48 ran chunked), and the batch swings between prefills, so a
split that clears the mean batch's unions still chunks at the swing's top (b8 16K 24 GiB: 52 of 128 decode steps
chunked at a mean batch of 2.8 whose unions the 22 slots about held; bench/results/phase_h200.md, session 30).
Here a chosen split is priced once: P(some layer over its slots), layers independent at a given batch, averaged
over the decode steps' batch as the agent reported it (`DemandForecast.decode_batch_ratios`: quantiles of each
pure decode step's tokens over its window's median, scaled to the share's batch). Offline, over the same plans,
the per-step batch cut the error of the chance from 0.206 (the mean batch) to 0.092 (bench/phase_chunking.py).
The coupled search (coupling.py) ranks KV shares with it, in its screen and after each exact solve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tierplan.controller.demand import DemandForecast
from tierplan.controller.valuation import Decode, over_slots_prob


@dataclass(frozen=True)
class Swing:
    """A decode step's per-layer unions over the batch's swing, each row equally likely: mean and spread [Q, M],
    and the decode steps' share of the steps."""

    union: np.ndarray  # [Q, M]
    union_sd: np.ndarray  # [Q, M]
    share: float

    def p_any(self, slots: np.ndarray | Sequence[int], num_experts: int) -> float:
        """P(a decode step's union outruns its slots in some layer): layers independent at each batch."""
        p = over_slots_prob(np.asarray(slots, dtype=float)[None, :], self.union, self.union_sd, num_experts)
        return float(np.mean(1.0 - np.prod(1.0 - p, axis=1)))


def swing_at(fc: DemandForecast, batch: float, union: np.ndarray | Sequence[float], share: float) -> Swing:
    """The swing at the running `batch` whose mean unions are `union` [M] (the curves' loads with no slot), from
    the forecast's activation frequencies and decode batch ratios (`swing_of`); without frequencies, the batch
    alone with no spread."""
    if not fc.token_probs:
        base = np.asarray(union, dtype=float)
        return Swing(base[None, :], np.zeros((1, base.size)), share)
    return swing_of(np.asarray(fc.token_probs, dtype=float), fc.decode_batch_ratios, batch, union, share)


def swing_of(probs: np.ndarray, ratios: Sequence[float], batch: float, union: np.ndarray | Sequence[float],
             share: float) -> Swing:
    """At each ratio r (none: r = 1), the union of independent tokens routed by `probs` [M, E] at r x `batch`,
    scaled per layer by `union` [M] over their union at `batch` (the measured curves' temporal locality, as
    coupling's rescaled curves), and its independent-token spread."""
    base = np.asarray(union, dtype=float)
    probs = np.clip(probs, 0.0, 1.0)
    batches = np.maximum(1.0, np.asarray(ratios or (1.0,), dtype=float) * batch)  # [Q]
    q = 1.0 - (1.0 - probs[None, :, :]) ** batches[:, None, None]  # [Q, M, E] P(needed in a step)
    at_batch = (1.0 - (1.0 - probs) ** max(1.0, batch)).sum(axis=1)  # [M]
    scale = np.where(at_batch > 1e-9, base / np.maximum(at_batch, 1e-9), 1.0)
    return Swing(q.sum(axis=2) * scale, np.sqrt((q * (1.0 - q)).sum(axis=2)), share)


def unions_high(fc: DemandForecast, batch: float, top_k: int) -> np.ndarray:
    """[M] each layer's step union at `batch` tokens, on the high side (for what must leave it room): the larger
    of the activation frequencies' union (`swing_of`'s scaling) and the union of tokens routed uniformly, each
    scaled per layer by the measured union over theirs at the forecast's batch. The frequencies alone read low
    while few tokens are seen, as when the first plan is made: after one window of 4 tokens a layer had seen 3
    of its 8 experts, and their union at 12 tokens read 3.0 where 6.2 is measured."""
    base, at = np.asarray(fc.union_per_step, dtype=float), max(1.0, fc.batch_tokens)
    num_experts = len(fc.misses_per_step[0]) - 1 if fc.misses_per_step else len(fc.hot_order[0])
    uniform = np.full((base.size, num_experts), min(1.0, top_k / max(1, num_experts)))
    high = swing_of(uniform, (max(1.0, batch) / at,), at, base, 1.0).union[0]
    if fc.token_probs:
        high = np.maximum(high, swing_of(np.asarray(fc.token_probs, dtype=float), (max(1.0, batch) / at,), at,
                                         base, 1.0).union[0])
    return np.minimum(high, num_experts)


def whole_chunk_ms(chunked_step_ms: float, swing: Swing, slots: np.ndarray | Sequence[int], num_experts: int
                   ) -> float:
    """The chunked step priced on the whole split `slots` [M], per step (unweighted)."""
    return chunked_step_ms * swing.share * swing.p_any(slots, num_experts) if chunked_step_ms > 0 else 0.0


@dataclass(frozen=True)
class ChunkPrice:
    """How one KV share's valuation priced the chunked decode step (`valuation.chunk_pricing`: each layer charged
    against `charged`, or `flat_step_ms` a step), and the whole split's price over the swing: the difference is
    what a chosen split's step and objective are mended by."""

    chunked_step_ms: float
    charged: Decode | None
    flat_step_ms: float
    swing: Swing
    num_experts: int  # a layer's: none over them with every expert resident

    def charged_ms(self, slots: Sequence[int]) -> float:
        """What the knapsack charged `slots` [M] for the chunked step, per step (unweighted)."""
        if self.charged is None:
            return self.flat_step_ms
        p = over_slots_prob(np.asarray(slots, dtype=float), np.asarray(self.charged.union),
                            np.asarray(self.charged.union_sd), self.num_experts)
        return self.chunked_step_ms * self.charged.share * float(p.sum())

    def whole_ms(self, slots: Sequence[int]) -> float:
        """The chunked step priced on the whole split, per step (unweighted)."""
        return whole_chunk_ms(self.chunked_step_ms, self.swing, slots, self.num_experts)

    def mend_ms(self, slots: Sequence[int]) -> float:
        """The whole split's price less what the knapsack charged it (ms a step, unweighted; either sign)."""
        return self.whole_ms(slots) - self.charged_ms(slots)
