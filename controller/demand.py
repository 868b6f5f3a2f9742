"""The controller's forecast of the next windows: batch, experts needed per step, KV demand, the local table.

Runs in the controller process, fed one accepted telemetry window at a time (`observe`). Built on the demand
models in controller/predictors: per-layer curves of the engine's expert cache (`MissRatioCurves`, from the step
unions the agent reports, bucketed by the step's token count) with a fallback from the activation frequencies where
a batch size has too few steps yet (predictors/irm_lru: the same cache under independent tokens); and the cross-layer
transition table the plan ships to the agent, estimated from the window's pair counts with the same back-off as
`TransitionTable` (P(j|i) = (n(i,j) + prior q(j)) / (n(i) + prior), q the next layer's per-token marginal).
`forecast()` returns a frozen `DemandForecast`; nothing here decides.
Never imports torch, runtime or agent.

Shape letters: M MoE layers, E experts per layer.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from tierplan.controller.predictors.irm_lru import lru_curve, step_need
from tierplan.controller.predictors.miss_ratio import MissRatioCurves
from tierplan.controller.protocol import Successor, Telemetry, Tier, TransitionRow

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
KV_SATURATED_GROWTH = 2.0  # a full GPU KV share hides the queue behind it: price demand as twice the share
MIN_CURVE_STEPS = 8.0  # decayed steps a batch bucket needs before its measured curve is trusted
MIN_RECALL_LOADS = 20.0  # decayed loads (prefetched + on demand) before the measured recall replaces the prior
# A step of more than this many times the window's median tokens is a large one (a prefill); where the agent splits
# the decode tokens off, a step whose prompt chunk is more than this many times the window's median decode tokens.
LARGE_STEP_FACTOR = 4.0
# KV demand has settled once this many windows passed with none growing more than KV_SETTLE_GROWTH over the one
# before; until then the demand is priced at no less than the GPU KV share the agent started with (a batch that is
# still filling holds a fraction of what it will: H200 phase runs 23-25 took KV from 2,341 to 997 blocks on the 537
# seen after 8 steps, and the runs preempted). Priced, not held as a floor: a plan may still run fewer sequences
# where that is cheaper per token (H200 phase runs 26-27, b128 1K and b8 16K: a floor at the start's share left
# 37-51 expert slots a layer, and the prefills that need every expert made the runs 0.59-0.64x of the best).
KV_SETTLE_WINDOWS = 4
KV_SETTLE_GROWTH = 0.1
DECODE_RATIO_STEPS = 512  # the newest pure decode steps whose batch swing is kept
SWING_QUANTILES = 8  # the decode steps' batch ratios kept as this many equally likely quantiles
MIN_SWING_STEPS = 16  # pure decode steps seen before their swing is used (fewer: the median batch alone)


class CurveSource(StrEnum):
    """Where a forecast's miss curves come from (the policy's `predictor` knob)."""

    MISS_RATIO = "miss_ratio"  # measured LRU curves where a batch bucket has enough steps, else frequencies
    FREQUENCY = "frequency"  # activation frequencies only (independent tokens)


FREQUENCY_SOURCE = "activation frequencies (an LRU cache, tokens independent)"
# A layer's frequency curve (irm_lru.lru_curve, ~30-40 ms each) is a function of each expert's chance to be needed
# in a step, q = 1 - (1 - p)^batch, alone: it is computed again only once some expert's q moved by more than
# LRU_REUSE_Q (the union then moves by at most LRU_REUSE_Q x experts). 16 of them a forecast took ~0.45 s of a
# ~0.5 s step_next on a 2-core box, where a b8 1K decode window lasts ~32 ms on an H100 (phase run 62: the first
# plan applied 128 steps after its window).
LRU_REUSE_Q = 0.002
LRU_MEMO_PER_LAYER = 8
LRU_THREADS = 16  # at most this many curves computed at once (`DemandModel._warm_lru`)


def _usable_cpus() -> int:
    """The CPUs this process may run on (a controller confined beside an engine: bench/baselines/plan_process.py),
    not the machine's: more threads than that only take turns."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def batch_bucket(tokens: float) -> int:
    """The tracked batch size nearest to `tokens` on a log scale."""
    t = max(1.0, tokens)
    return min(BATCH_BUCKETS, key=lambda b: abs(math.log(b) - math.log(t)))


@dataclass(frozen=True)
class DemandForecast:
    # tokens per engine step: the median decode tokens where the agent splits them off (while the batch first
    # fills, no less than the newest step's), else the median step where steps are reported, else the mean
    batch_tokens: float
    misses_per_step: tuple[tuple[float, ...], ...]  # [M][E + 1] expected loads per step with 0..E slots
    union_per_step: tuple[float, ...]  # [M] distinct experts a step needs
    curve_source: str  # "measured LRU curves at B=..." or FREQUENCY_SOURCE
    kv_live_blocks: float  # KV blocks the sequences hold (all tiers) plus those the queued requests need
    kv_gpu_used_blocks: float
    kv_saturated: bool  # the GPU KV share was full: demand may be higher than seen
    hot_order: tuple[tuple[int, ...], ...]  # [M] experts by activation frequency, hottest first
    num_windows: int
    reuse_per_step: float = 0.0  # prefix blocks reused per step (telemetry's reuse events)
    reuse_ages_s: tuple[float, ...] = ()  # recent reuse ages, ascending (how long since each block was touched)
    touch_blocks_per_s: float = 0.0  # KV blocks touched per second (new and reused): LRU's clock
    prefetch_recall: float | None = None  # measured share of needed loads the local predictor brought ahead
    prefetch_precision: float | None = None  # measured share of its prefetches that their layer used
    token_probs: tuple[tuple[float, ...], ...] = ()  # [M][E] P(a token routes to each expert): curves at any batch
    curve_batch: float = 0.0  # the batch `misses_per_step` describes: its bucket when measured (0: batch_tokens)
    bucket_curves: tuple[BucketCurves, ...] = ()  # measured LRU curves at every batch bucket with enough steps
    # Steps far above the median (prefills): their share of the steps, and the loads they add per step (their
    # own curves, at their size, times their share) [M][E + 1]; `with_large_steps` folds them into a curve.
    large_step_share: float = 0.0
    large_step_misses: tuple[tuple[float, ...], ...] = ()
    kv_filling_blocks: int = 0  # KV demand not settled yet: the agent's start share, the least demand is priced at
    kv_rising: bool = False  # KV demand has yet to settle (DemandModel.kv_rising): the batch is still filling
    kv_first_fill: bool = False  # rising, and never settled nor fallen yet: the run's first fill, from the start
    # The GPU blocks the running sequences will hold when a plan made now lands, a window on (None: those in use):
    # while the demand still rises, the share in force keeps admitting (`DemandModel.forecast`).
    kv_gpu_landing_blocks: float | None = None
    # Pure decode steps' tokens over their window's median, as equally likely quantiles (`swing_ratios`;
    # () until enough are seen): the running batch's swing between prefills, which the chunked step's price reads.
    decode_batch_ratios: tuple[float, ...] = ()


@dataclass(frozen=True)
class BucketCurves:
    """The measured LRU curves of one batch bucket, every MoE layer having enough steps in it."""

    bucket: int
    misses_per_step: tuple[tuple[float, ...], ...]  # [M][E + 1]
    union_per_step: tuple[float, ...]  # [M]


def frequency_curve(probs: np.ndarray, batch: float) -> tuple[np.ndarray, float]:
    """Expected loads per step with 0..E slots holding the most frequent experts, tokens drawn independently
    from the per-token probabilities `probs` [E]; and the step's expected union."""
    q = step_need(probs, batch)  # [E] P(needed in a step)
    q_sorted = np.sort(q)[::-1]
    tail = np.concatenate([np.cumsum(q_sorted[::-1])[::-1], [0.0]])  # [E + 1] sum of the not-resident
    return tail, float(q.sum())


def swing_ratios(ratios: Sequence[float], n: int = SWING_QUANTILES) -> tuple[float, ...]:
    """`n` equally likely ratios standing for `ratios` (their quantile midpoints); () with fewer than
    MIN_SWING_STEPS of them."""
    if len(ratios) < MIN_SWING_STEPS:
        return ()
    qs = (np.arange(n) + 0.5) / n
    return tuple(float(x) for x in np.quantile(np.asarray(ratios, dtype=float), qs))


def union_sd(fc: DemandForecast, batch: float) -> np.ndarray:
    """[M] the spread of one step's union of experts at `batch` tokens, each layer's, tokens drawn independently
    from the activation frequencies (a sum of independent needs: variance sum q(1 - q)); zeros without them."""
    if not fc.token_probs:
        return np.zeros(len(fc.misses_per_step))
    q = step_need(np.asarray(fc.token_probs), batch)  # [M, E]
    return np.sqrt((q * (1.0 - q)).sum(axis=1))


def large_share_at(fc: DemandForecast, batch_tokens: float | None = None) -> float:
    """The large steps' (prefills') share of the steps at the running batch `batch_tokens` (None: the observed
    one). Every request prefills once, so in a steady stream prefills per step follow the sequences running:
    the share scales by batch / observed. While the KV demand is still rising the prefills are the batch filling,
    arrivals rather than turnover, so a larger batch is not read as more of them: extrapolated, a fill's window
    of 2 decoding sequences and 3 prompts in 8 steps read as every step a prompt at the 9 sequences a share would
    hold, every slot worth a load each step, the same in every layer, and the knapsack split the experts
    all-or-nothing (H100 phase run 35, b8 1K 24 GiB: 66 slots in five layers, 8 in two, 47 in one; reproduced
    on the CPU at its sizes)."""
    share = fc.large_step_share
    if batch_tokens is None or fc.batch_tokens <= 0 or share <= 0:
        return share
    ratio = batch_tokens / fc.batch_tokens
    return min(1.0, share * (min(1.0, ratio) if fc.kv_rising else ratio))


def decode_share(fc: DemandForecast, batch_tokens: float | None = None) -> float:
    """The share of steps that are not large ones (prefills) at the running batch `batch_tokens` (the observed
    one by default): `large_share_at`."""
    return 1.0 - large_share_at(fc, batch_tokens)


def with_large_steps(curves: tuple[tuple[float, ...], ...] | np.ndarray, fc: DemandForecast,
                     batch_tokens: float | None = None) -> tuple[tuple[float, ...], ...] | np.ndarray:
    """`curves` [M][E + 1] (a typical step's loads) as the expected loads of an average step: the typical steps'
    share of them plus what the large steps (prefills) add at their own size. A prefill needs nearly every
    expert a layer has seen, so each slot short of them costs a load in every prefill step, which a curve at
    the median step alone prices at nothing once its few experts fit (H200 phase run 20, b32 40 GiB: ~20 of
    ~150 steps were 1K prefills, each streaming the ~60 experts a layer did not hold).
    `batch_tokens`: the running batch the curves describe, where it is not the observed one (a KV share that
    runs fewer sequences): their share as `large_share_at` scales it. Held at the observed share, a share running
    a tenth of the sequences would pay ten times the prefills per token served (H200 phase run 26, b128: the
    KV-first split kept, its 51 slots a layer costing each prefill 155 ms against 40-51 ms with 77)."""
    if not fc.large_step_misses:
        return curves  # no large step seen: the curves as they are (no copy on the valuation's path)
    share, large = fc.large_step_share, np.asarray(fc.large_step_misses)  # large: [M, E + 1], times the share
    if share > 0:
        scaled = large_share_at(fc, batch_tokens)
        share, large = scaled, large * (scaled / share)
    return (1.0 - share) * np.asarray(curves) + large  # [M, E + 1]


class DemandModel:
    """See the module docstring. `moe_layers` are model layer indices; arrays are indexed by MoE position."""

    def __init__(self, moe_layers: tuple[int, ...], num_experts: int, top_k: int, decay: float = 0.05,
                 ewma: float = 0.5, prior: float = 1.0, block_tokens: int = 16, max_reuse_ages: int = 4096,
                 max_union_steps: int = 16) -> None:
        self.moe_layers, self.num_experts, self.top_k = tuple(moe_layers), num_experts, top_k
        self.index = {layer: m for m, layer in enumerate(self.moe_layers)}
        self.ewma, self.prior, self.decay = ewma, prior, decay
        m, e = len(self.moe_layers), num_experts
        self.curves = MissRatioCurves(m, e, BATCH_BUCKETS, decay=decay)
        self.freq = np.zeros((m, e))  # [M, E] decayed tokens routed to each expert
        self.tokens = np.zeros(m)  # [M] decayed tokens
        self.pairs = np.zeros((m, e, e))  # [M, E, E] decayed n(i at m, j at m+1)
        self.src = np.zeros((m, e))  # [M, E] decayed n(i at m) over windows that reported pairs
        self.batch_tokens: float | None = None
        self.decode_batch_seen = False  # the batch came from decoding sequences' tokens (Telemetry v3's split)
        self.batch_newest: float | None = None  # the newest step's decoding sequences (Telemetry v3's split)
        self.step_weight = 0.0  # decayed steps whose token counts were seen
        self.large_steps = np.zeros(len(BATCH_BUCKETS))  # decayed large steps (LARGE_STEP_FACTOR) by batch bucket
        self.decode_ratios: deque[float] = deque(maxlen=DECODE_RATIO_STEPS)  # pure decode steps' tokens / median
        self.kv_live: float | None = None
        self.kv_live_now = 0.0
        self.kv_queued_now = 0.0
        self.kv_gpu: float = 0.0
        self.kv_swapped: float = 0.0
        self.kv_gpu_limit: int | None = None  # the GPU KV blocks the applied plan allows (saturation test)
        self.kv_start_blocks: int | None = None  # the GPU KV share the agent ran before any plan of ours applied
        self.kv_recent: deque[float] = deque(maxlen=KV_SETTLE_WINDOWS)  # the last windows' KV demand (held + queued)
        self.kv_fill_over = False  # the batch's first fill is over (see `observe`)
        self.kv_written_blocks = 0.0  # KV blocks the last window's tokens wrote (each token processed adds its KV)
        self.num_windows = 0
        self.table_version = 0
        self.block_tokens, self.max_union_steps = block_tokens, max_union_steps
        self._lru_memo: list[list[tuple[np.ndarray, tuple[np.ndarray, float]]]] = [
            [] for _ in self.moe_layers]  # per layer: (q, curve), most recently used last (`_lru`)
        self.lru_curves_computed = 0  # frequency curves computed, not reused (tests, reports)
        self.union_steps_skipped = 0  # reported steps past max_union_steps, left out of the curves (per layer)
        self.reuse_ages: deque[float] = deque(maxlen=max_reuse_ages)
        self.reuse_per_step: float | None = None
        self.touch_blocks_per_s: float | None = None
        self.prefetch_useful = 0.0  # decayed every window; counted over windows that ran a table
        self.prefetch_missed = 0.0
        self.prefetch_wasted = 0.0  # decayed prefetches whose layer did not use them

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else self.ewma * new + (1 - self.ewma) * old

    def observe(self, tel: Telemetry) -> None:
        keep = 1.0 - self.decay
        self.freq *= keep
        self.tokens *= keep
        for row in tel.layers:
            m = self.index.get(row.layer)
            if m is not None:
                self.freq[m] += row.activation_counts
                self.tokens[m] += row.num_tokens
        batches: list[int] = []
        for u in tel.step_unions:
            m = self.index.get(u.layer)
            if m is None:
                continue
            # The newest steps only (a window's 8 steps all fit): the curves are decayed averages anyway (a step
            # and layer costs ~25 us, 128 experts, this 2-core box). Every size shares one recency order per layer,
            # so skipped steps shorten the distances of the next ones: keep the cap above the window.
            steps = list(zip(u.batch_tokens, u.unions, strict=True))
            self.union_steps_skipped += max(0, len(steps) - self.max_union_steps)
            steps = steps[-self.max_union_steps:]
            for b, union in steps:
                if b > 0:
                    self.curves.observe_step(m, np.asarray(union, np.int64), batch_bucket(b))
            batches = list(u.batch_tokens)
        n = tel.step_timings_ms.num_steps
        self.step_weight *= keep
        self.large_steps *= keep
        if tel.step_decode_tokens:
            self._observe_decode_split(tel)
        else:
            self._observe_steps(batches or [b for b in tel.step_tokens if b > 0], tel, n)
        if tel.transitions:
            self.pairs *= keep
            self.src *= keep
            counts = {row.layer: row.activation_counts for row in tel.layers}
            for t in tel.transitions:
                m = self.index.get(t.layer)
                if m is None or self.index.get(t.next_layer) != m + 1:
                    continue
                if t.pairs:
                    flat = np.fromiter(itertools.chain.from_iterable(t.pairs), np.int64, 3 * len(t.pairs))
                    src, dst, count = flat.reshape(-1, 3).T  # [3, P]
                    np.add.at(self.pairs[m], (src, dst), count)
                if t.layer in counts:
                    self.src[m] += counts[t.layer]
            self.table_version += 1
        blocks = tel.kv.blocks_per_tier
        self.kv_queued_now = float(tel.queued_kv_blocks)
        self.kv_live_now = float(sum(blocks.values())) + self.kv_queued_now
        self.kv_live = self._smooth(self.kv_live, self.kv_live_now)
        self.kv_recent.append(self.kv_live_now)
        # The first fill is over once the demand settles, or falls by more than the settling margin (sequences
        # finished: turnover, not a fill; a demand that swings never settles).
        fell = len(self.kv_recent) >= 2 and self.kv_recent[-1] < (1.0 - KV_SETTLE_GROWTH) * self.kv_recent[-2]
        self.kv_fill_over = self.kv_fill_over or fell or not self.kv_rising()
        if self.batch_newest is not None and not self.kv_fill_over:
            # While the batch first fills, its window's median lags the sequences the blocks in use already hold,
            # and smoothing with the emptier windows before lags it more: every KV share's batch scales from
            # batch / blocks in use (coupling.running_batch), so a share was priced at a third to a fifth of the
            # batch it then ran (H100 phase run 55, b256 1K 40 GiB: 24.6 tokens a step for a share that ran
            # ~118, which took 288 expert slots from four layers; 17.0 s against 8.0 for the twin that did not).
            # Until the fill ends, the batch is the newest step's; smoothing goes on from there.
            self.batch_tokens = max(self.batch_tokens or 0.0, self.batch_newest)
        if tel.kv_gpu_limit_blocks is not None and tel.applied_plan_version == 0:
            self.kv_start_blocks = tel.kv_gpu_limit_blocks  # the serving shape it was started with, not ours
        self.kv_gpu = float(blocks.get(Tier.GPU, 0))
        self.kv_swapped = float(blocks.get(Tier.CPU, 0) + blocks.get(Tier.NVME, 0))
        written = sum(tel.step_tokens) if tel.step_tokens else max((r.num_tokens for r in tel.layers), default=0)
        self.kv_written_blocks = written / self.block_tokens
        self._observe_reuse(tel, n)
        # Every window fades the prefetch evidence, with a table or without: a table withheld for its precision
        # (loop.py) comes back once what condemned it has faded, and is measured again.
        self.prefetch_useful *= keep
        self.prefetch_missed *= keep
        self.prefetch_wasted *= keep
        pf = tel.local_prefetch
        if pf is not None and pf.table_version > 0:
            self.prefetch_useful += pf.useful
            self.prefetch_missed += tel.expert_misses
            self.prefetch_wasted += pf.wasted
        self.num_windows += 1

    def _observe_steps(self, batches: list[int], tel: Telemetry, n: int) -> None:
        """The batch from the steps' token counts (the step unions', else the reported ones), no decode split."""
        if batches:
            # The median step, not the mean: one prefill of a thousand tokens among eight decode steps would
            # price every step's experts at a 130-token union (H200 phase run 04: 36-394 "tokens/step" at
            # decode batches of 1-5), and with it every KV share's batch. The large steps are kept apart.
            median = float(np.median(batches))
            self.batch_tokens = self._smooth(self.batch_tokens, median)
            self.step_weight += len(batches)
            for b in batches:
                if b > LARGE_STEP_FACTOR * median:
                    self.large_steps[BATCH_BUCKETS.index(batch_bucket(b))] += 1.0
        elif n and tel.layers:  # the window's mean: a prefill inflates it (an agent that reports neither)
            self.batch_tokens = self._smooth(self.batch_tokens, float(np.mean([r.num_tokens for r in tel.layers])) / n)

    def _observe_decode_split(self, tel: Telemetry) -> None:
        """The batch from the decoding sequences' tokens of the steps that had any: the running batch. The
        median of whole steps reads a window where most steps carry a prompt chunk as a batch of prompts, and
        every KV share's batch with it (H200 phase run 37, b32 16K 56 GiB: the first plan priced at 14,304
        tokens a step for ten sequences; runs 39-40, b256 1K: ~1,800 for 72). A step whose prompt chunk is over
        LARGE_STEP_FACTOR times the window's median decode tokens is a large one, at its whole size. A window
        where nothing decoded has no running batch to read: before any decode, its whole steps are read as
        without the split (a prefill-only load: its batch is its prompts); after, the batch stands and its steps
        count as large ones against it (smoothed in, a window of prompts would take days of decodes back)."""
        tokens, decodes = tel.step_tokens, tel.step_decode_tokens
        running = [d for d in decodes if d > 0]
        if not running and not self.decode_batch_seen:
            self._observe_steps([t for t in tokens if t > 0], tel, tel.step_timings_ms.num_steps)
            return
        if running:
            self.batch_newest = float(running[-1])
            median = float(np.median(running))
            self.batch_tokens = self._smooth(self.batch_tokens, median)
            self.decode_batch_seen = True
        else:
            median = self.batch_tokens or 1.0
        steps = [(t, d) for t, d in zip(tokens, decodes, strict=True) if t > 0]
        self.step_weight += len(steps)
        self.decode_ratios.extend(d / median for t, d in steps if t == d)  # a prompt chunk runs off the graphs anyway
        for t, d in steps:
            if t - d > LARGE_STEP_FACTOR * median:
                self.large_steps[BATCH_BUCKETS.index(batch_bucket(t))] += 1.0

    def _observe_reuse(self, tel: Telemetry, num_steps: int) -> None:
        """Prefix reuse: how often blocks come back and after how long, against how fast blocks are touched."""
        events = tel.kv.reuse_events
        self.reuse_ages.extend(e.age_s for e in events)
        span_s = tel.window_end_s - tel.window_start_s
        if num_steps:
            self.reuse_per_step = self._smooth(self.reuse_per_step, len(events) / num_steps)
        if span_s > 0 and tel.layers:
            new_blocks = max(r.num_tokens for r in tel.layers) / self.block_tokens
            self.touch_blocks_per_s = self._smooth(self.touch_blocks_per_s, (new_blocks + len(events)) / span_s)

    # ---- reading -----------------------------------------------------------------------------------------
    def _token_probs(self, m: int) -> np.ndarray:
        """[E] per-token routing probabilities of MoE layer m (uniform top-k before any token)."""
        e = self.num_experts
        return self.freq[m] / self.tokens[m] if self.tokens[m] else np.full(e, self.top_k / e)

    def _memo(self, m: int, q: np.ndarray) -> tuple[np.ndarray, float] | None:
        """Layer m's memoised curve whose q is within LRU_REUSE_Q of `q` everywhere (made most recent), or None."""
        memo = self._lru_memo[m]
        for i, (q0, got) in enumerate(memo):
            if float(np.abs(q - q0).max()) <= LRU_REUSE_Q:
                memo.append(memo.pop(i))
                return got
        return None

    def _remember(self, m: int, q: np.ndarray, got: tuple[np.ndarray, float]) -> None:
        memo = self._lru_memo[m]
        self.lru_curves_computed += 1
        memo.append((q, got))
        del memo[:-LRU_MEMO_PER_LAYER]

    def _lru(self, m: int, batch: float) -> tuple[np.ndarray, float]:
        """`lru_curve` of layer m at `batch`, reused while no expert's q moved past LRU_REUSE_Q (shared arrays:
        callers copy what they change)."""
        probs = self._token_probs(m)
        q = step_need(probs, batch)  # [E] as lru_curve reads it
        got = self._memo(m, q)
        if got is None:
            got = lru_curve(probs, batch)
            self._remember(m, q, got)
        return got

    def _warm_lru(self, wanted: Sequence[tuple[int, float]]) -> None:
        """Compute the (layer, batch) curves `_lru` will be asked for and has not memoised, side by side: numpy
        lets go of the GIL in lru_curve's array passes (16 curves of 128 experts: 0.67 s one after another,
        0.37 s on 2 threads of a 2-core box). Same curves as `_lru` computes one by one."""
        todo: dict[tuple[int, float], np.ndarray] = {}
        for m, batch in wanted:
            if (m, batch) not in todo:
                q = step_need(self._token_probs(m), batch)
                if self._memo(m, q) is None:
                    todo[(m, batch)] = q
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(min(len(todo), _usable_cpus(), LRU_THREADS)) as pool:
            got = list(pool.map(lambda key: lru_curve(self._token_probs(key[0]), key[1]), todo))
        for ((m, _), q), curve in zip(todo.items(), got, strict=True):
            if self._memo(m, q) is None:  # two batches of one layer can share a q within the tolerance
                self._remember(m, q, curve)

    def _measured(self, m: int, bucket: int) -> tuple[np.ndarray, float] | None:
        if self.curves.num_steps(m, bucket) < MIN_CURVE_STEPS:
            return None
        curve = self.curves.expected_misses_per_step(m, bucket).copy()
        curve[-1] = 0.0  # every expert resident: nothing is ever evicted, so no miss once loaded
        return curve, self.curves.mean_union_size(m, bucket)

    def forecast(self, source: CurveSource = CurveSource.MISS_RATIO) -> DemandForecast:
        batch = self.batch_tokens or 1.0
        bucket = batch_bucket(batch)
        misses, unions, measured = [], [], True
        num_moe = len(self.moe_layers)
        at = ({b: [self._measured(m, b) for m in range(num_moe)] for b in BATCH_BUCKETS}
              if source is CurveSource.MISS_RATIO else {})  # bucket -> per layer (curve, union) or None
        self._warm_lru([(m, batch) for m in range(num_moe) if not at or at[bucket][m] is None]
                       + self._large_wanted(at))
        for m in range(num_moe):
            got = at[bucket][m] if at else None
            if got is None:
                got = self._lru(m, batch)
                measured = False
            misses.append(tuple(float(x) for x in got[0]))
            unions.append(got[1])
        buckets = [BucketCurves(b, tuple(tuple(float(v) for v in x[0]) for x in row if x is not None),
                                tuple(x[1] for x in row if x is not None))
                   for b, row in at.items() if all(x is not None for x in row)]
        probs = tuple(tuple(float(v) for v in self._token_probs(m)) for m in range(num_moe))
        hot = tuple(tuple(int(e) for e in np.argsort(-self.freq[m], kind="stable"))
                    for m in range(len(self.moe_layers)))
        limit = self.kv_gpu_limit
        # Full, with sequences swapped out: the share is what limits the batch.
        saturated = limit is not None and self.kv_gpu >= limit > 0 and self.kv_swapped > 0
        # Demand (held + queued) rises at once (the last window) and falls smoothly. Without a queue report, a
        # saturated share hides the queue behind it: then demand is priced as a multiple of the share.
        live = max(self.kv_live or 0.0, self.kv_live_now)
        if saturated and limit is not None and not self.kv_queued_now:
            live = max(live, KV_SATURATED_GROWTH * limit)
        rising = self.kv_rising()
        filling = self.kv_start_blocks if self.kv_start_blocks is not None and rising else 0
        live = max(live, float(filling))
        # While the demand rises, the share in force (ours, else the agent's start share) keeps admitting until a
        # plan made now lands a window on: the blocks held then are those held now plus what a window writes, up
        # to that share and the demand (H200 run 37, b32 16K 56 GiB: ~14K blocks were held when the first plan,
        # priced at the first window's, cut the share to 10,734, and the swaps back took 3.2 s of 10.2).
        landing = self.kv_gpu
        in_force = limit if limit is not None else self.kv_start_blocks
        if rising and in_force is not None:
            landing = max(landing, min(float(in_force), live, self.kv_gpu + self.kv_written_blocks))
        source = f"measured LRU curves at B~{bucket}" if measured else FREQUENCY_SOURCE
        share, large = self._large_steps(at)
        return DemandForecast(batch, tuple(misses), tuple(unions), source, live, self.kv_gpu, saturated, hot,
                              self.num_windows, self.reuse_per_step or 0.0, tuple(sorted(self.reuse_ages)),
                              self.touch_blocks_per_s or 0.0, self._recall(), self._precision(), token_probs=probs,
                              bucket_curves=tuple(buckets), curve_batch=float(bucket) if measured else batch,
                              large_step_share=share, large_step_misses=large, kv_filling_blocks=filling,
                              kv_rising=rising, kv_gpu_landing_blocks=landing,
                              kv_first_fill=rising and not self.kv_fill_over,
                              decode_batch_ratios=swing_ratios(self.decode_ratios))

    def kv_rising(self) -> bool:
        """Whether KV demand has yet to settle: fewer than KV_SETTLE_WINDOWS windows seen, or one of the last of
        them grew more than KV_SETTLE_GROWTH over the window before it."""
        if self.num_windows < KV_SETTLE_WINDOWS:
            return True
        return any(b > (1.0 + KV_SETTLE_GROWTH) * a for a, b in itertools.pairwise(self.kv_recent))

    def _large_wanted(self, at: dict[int, list[tuple[np.ndarray, float] | None]]) -> list[tuple[int, float]]:
        """The (layer, batch) frequency curves `_large_steps` will read."""
        if self.step_weight <= 0 or not self.large_steps.any():
            return []
        return [(m, float(BATCH_BUCKETS[int(i)])) for i in np.flatnonzero(self.large_steps > 0)
                for m in range(len(self.moe_layers)) if not at or at[BATCH_BUCKETS[int(i)]][m] is None]

    def _large_steps(self, at: dict[int, list[tuple[np.ndarray, float] | None]]
                     ) -> tuple[float, tuple[tuple[float, ...], ...]]:
        """The large steps' share and the loads they add per step [M][E + 1]: each bucket's measured curve where
        `at` has one, else the activation frequencies at the bucket's size."""
        if self.step_weight <= 0 or not self.large_steps.any():
            return 0.0, ()
        shares = self.large_steps / self.step_weight  # [buckets]
        out = []
        for m in range(len(self.moe_layers)):
            acc = np.zeros(self.num_experts + 1)
            for i in np.flatnonzero(shares > 0):
                b = BATCH_BUCKETS[int(i)]
                got = at[b][m] if at else None
                acc += shares[i] * (got[0] if got is not None else self._lru(m, b)[0])
            out.append(tuple(float(x) for x in acc))
        return float(shares.sum()), tuple(out)

    def _precision(self) -> float | None:
        issued = self.prefetch_useful + self.prefetch_wasted
        return self.prefetch_useful / issued if issued >= MIN_RECALL_LOADS else None

    def _recall(self) -> float | None:
        loads = self.prefetch_useful + self.prefetch_missed
        return self.prefetch_useful / loads if loads >= MIN_RECALL_LOADS else None

    def need_probs(self, batch: float, horizon_steps: int) -> np.ndarray:
        """[M, E] P(each expert is needed within the next `horizon_steps` steps of `batch` tokens), tokens drawn
        independently from the activation frequencies (what `Forecast.layers` carries)."""
        e = self.num_experts
        tokens = np.maximum(self.tokens, 1e-12)[:, None]  # [M, 1]
        p = np.where(self.tokens[:, None] > 0, self.freq / tokens, self.top_k / e)  # [M, E] per token
        return 1.0 - (1.0 - np.clip(p, 0.0, 1.0)) ** (max(1.0, batch) * horizon_steps)

    def transition_rows(self, top_m: int, min_prob: float) -> list[TransitionRow]:
        """The plan's table: for every source seen, its top-m successors at the next MoE layer."""
        rows = []
        for m in range(len(self.moe_layers) - 1):
            nxt = self.freq[m + 1] / self.tokens[m + 1] if self.tokens[m + 1] else np.zeros(self.num_experts)
            for i in np.flatnonzero(self.src[m] > 0).tolist():
                probs = np.clip((self.pairs[m, i] + self.prior * nxt) / (self.src[m, i] + self.prior), 0.0, 1.0)
                order = [int(j) for j in np.argsort(-probs, kind="stable")[:top_m] if probs[j] >= min_prob]
                if order:
                    rows.append(TransitionRow(layer=self.moe_layers[m], src=i,
                                              next=tuple(Successor(j, float(probs[j])) for j in order)))
        return rows
