"""Features of KV prefix-block accesses, computed online in time order (controller process).

An *event* is one prefix block of one arriving request: block `h` at position `j` of a prompt of `d` blocks,
at time `t`. `BlockFeaturizer.observe` returns the raw features of a request's events as they were known just
before it arrived (counts, last-seen times, the running reuse rate), then folds the request into its state, so
features never look ahead. `model_matrix` turns raw features into what the learned models read; `next_gap_s`
gives, offline, the time from each event to the same block's next access (the label's source), and
`block_events` featurizes a whole trace.

Pure numpy and Python: must never import torch, runtime or agent, and keeps no state outside its objects.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from tierplan.controller.requests_jsonl import RequestTrace

_CAP_S = 1e5  # recency beyond ~a day is "never seen" for the models (log scale saturates)


class Raw(IntEnum):
    """Columns of the raw feature matrix [E, len(Raw)] (E = events)."""

    COUNT = 0  # accesses of this block before this one
    RECENCY_S = 1  # time since this block's last access; inf when never seen
    POSITION = 2  # block index j in the prompt (0 = first 512 tokens)
    DEPTH = 3  # number of prefix blocks of the prompt
    HIT_BLOCKS = 4  # leading blocks of the prompt seen before (its prefix-cache hit under an unbounded cache)
    DEEP_RECENCY_S = 5  # time since the deepest hit block was last seen (the conversation's last turn); inf if none
    DEEP_COUNT = 6  # accesses of that deepest hit block so far (~ the conversation's turn number)
    INPUT_TOKENS = 7
    INTERARRIVAL_S = 8  # since the previous request of the trace (load)
    REUSE_RATE = 9  # running mean (EWMA over requests) of hit_blocks / depth before this request


NUM_RAW = len(Raw)
MODEL_FEATURES = (
    "log_count", "log_recency", "never_seen", "position", "log_depth", "position_frac", "is_last_block",
    "hit_blocks", "hit_frac", "in_hit_prefix", "log_deep_recency", "log_deep_count", "log_input_tokens",
    "log_interarrival", "reuse_rate",
)


def _log_time(seconds: np.ndarray) -> np.ndarray:
    return np.log1p(np.minimum(seconds, _CAP_S))


def model_matrix(raw: np.ndarray) -> np.ndarray:
    """Raw features [E, NUM_RAW] -> model inputs [E, len(MODEL_FEATURES)] (float64, all finite)."""
    if raw.ndim != 2 or raw.shape[1] != NUM_RAW:
        raise ValueError(f"raw features must have shape [E, {NUM_RAW}], got {raw.shape}")
    pos, depth, hits = raw[:, Raw.POSITION], raw[:, Raw.DEPTH], raw[:, Raw.HIT_BLOCKS]
    cols = (
        np.log1p(raw[:, Raw.COUNT]),
        _log_time(raw[:, Raw.RECENCY_S]),
        np.isinf(raw[:, Raw.RECENCY_S]),
        pos,
        np.log1p(depth),
        pos / depth,
        pos == depth - 1,
        hits,
        hits / depth,
        pos < hits,
        _log_time(raw[:, Raw.DEEP_RECENCY_S]),
        np.log1p(raw[:, Raw.DEEP_COUNT]),
        np.log1p(raw[:, Raw.INPUT_TOKENS]),
        _log_time(raw[:, Raw.INTERARRIVAL_S]),
        raw[:, Raw.REUSE_RATE],
    )
    return np.column_stack(cols).astype(np.float64)  # [E, F]


class BlockFeaturizer:
    """Per-block access counts and last-seen times, plus the trace-wide reuse rate, updated request by request.

    `forget_after_s`: a block unseen for longer is dropped from the books (bounded memory; it then counts as
    never seen). The sweep runs every `sweep_every` requests, so memory stays bounded by the blocks touched
    within about `forget_after_s`.
    """

    def __init__(self, reuse_rate_alpha: float = 0.02, forget_after_s: float = 86_400.0,
                 sweep_every: int = 10_000) -> None:
        if not 0.0 < reuse_rate_alpha <= 1.0:
            raise ValueError(f"reuse_rate_alpha must be in (0, 1], got {reuse_rate_alpha!r}")
        if not forget_after_s > 0:
            raise ValueError(f"forget_after_s must be positive, got {forget_after_s!r}")
        self._alpha = reuse_rate_alpha
        self._forget_after_s = forget_after_s
        self._sweep_every = sweep_every
        self._count: dict[Hashable, int] = {}
        self._last_s: dict[Hashable, float] = {}
        self._reuse_rate = 0.0
        self._prev_arrival_s: float | None = None
        self._num_requests = 0

    @property
    def num_tracked_blocks(self) -> int:
        return len(self._last_s)

    def last_seen_s(self, block: Hashable) -> float | None:
        return self._last_s.get(block)

    def observe(self, arrival_s: float, hash_ids: Sequence[Hashable], input_tokens: int) -> np.ndarray:
        """Raw features [len(hash_ids), NUM_RAW] of this request's blocks, then record the request.

        Arrivals must not go back in time (the trace loader guarantees it for files).
        """
        if self._prev_arrival_s is not None and arrival_s < self._prev_arrival_s:
            raise ValueError(f"arrival_s {arrival_s} is before the previous request's {self._prev_arrival_s}")
        count, last_s = self._count, self._last_s
        depth = len(hash_ids)
        hits = 0
        for h in hash_ids:
            if h not in last_s:
                break
            hits += 1
        deep = hash_ids[hits - 1] if hits else None
        deep_recency_s = arrival_s - last_s[deep] if deep is not None else np.inf
        deep_count = count[deep] if deep is not None else 0
        gap_s = arrival_s - self._prev_arrival_s if self._prev_arrival_s is not None else 0.0
        raw = np.empty((depth, NUM_RAW), dtype=np.float64)  # [B, NUM_RAW]
        for j, h in enumerate(hash_ids):
            seen_s = last_s.get(h)
            raw[j, Raw.COUNT] = count.get(h, 0)
            raw[j, Raw.RECENCY_S] = arrival_s - seen_s if seen_s is not None else np.inf
        raw[:, Raw.POSITION] = np.arange(depth)
        raw[:, Raw.DEPTH] = depth
        raw[:, Raw.HIT_BLOCKS] = hits
        raw[:, Raw.DEEP_RECENCY_S] = deep_recency_s
        raw[:, Raw.DEEP_COUNT] = deep_count
        raw[:, Raw.INPUT_TOKENS] = input_tokens
        raw[:, Raw.INTERARRIVAL_S] = gap_s
        raw[:, Raw.REUSE_RATE] = self._reuse_rate
        for h in hash_ids:
            count[h] = count.get(h, 0) + 1
            last_s[h] = arrival_s
        if depth:
            self._reuse_rate += self._alpha * (hits / depth - self._reuse_rate)
        self._prev_arrival_s = arrival_s
        self._num_requests += 1
        if self._num_requests % self._sweep_every == 0:
            self._forget(arrival_s)
        return raw

    def _forget(self, now_s: float) -> None:
        stale = [h for h, t in self._last_s.items() if now_s - t > self._forget_after_s]
        for h in stale:
            del self._last_s[h], self._count[h]


@dataclass(frozen=True)
class KVBlockEvents:
    """All block events of a trace, in time order. Arrays are [E]; raw is [E, NUM_RAW]."""

    times_s: np.ndarray  # since the first request
    blocks: np.ndarray  # int64 prefix hash ids
    request: np.ndarray  # int64 index of the request in the trace
    raw: np.ndarray


def block_events(trace: RequestTrace, progress: Callable[[int], None] | None = None) -> KVBlockEvents:
    """Featurize every block of every request of `trace` online, in time order (`progress` gets requests done)."""
    featurizer = BlockFeaturizer()
    arrival_s = (trace.arrival_ms - trace.arrival_ms[0]) / 1000.0  # [R]
    rows: list[np.ndarray] = []
    for r, ids in enumerate(trace.hash_ids):
        rows.append(featurizer.observe(float(arrival_s[r]), ids, int(trace.input_length[r])))
        if progress is not None and (r + 1) % 1000 == 0:
            progress(1000)
    if progress is not None:
        progress(trace.num_requests % 1000)
    depth = np.fromiter((len(h) for h in trace.hash_ids), dtype=np.int64, count=trace.num_requests)  # [R]
    request = np.repeat(np.arange(trace.num_requests), depth)  # [E]
    blocks = np.fromiter((h for ids in trace.hash_ids for h in ids), dtype=np.int64, count=int(depth.sum()))
    raw = np.concatenate(rows) if rows else np.empty((0, NUM_RAW))
    return KVBlockEvents(times_s=arrival_s[request], blocks=blocks, request=request, raw=raw)


def next_gap_s(blocks: np.ndarray, times_s: np.ndarray) -> np.ndarray:
    """For events in time order ([E] block ids, [E] times): time to the same block's next access; inf if none."""
    if blocks.shape != times_s.shape or blocks.ndim != 1:
        raise ValueError(f"blocks and times_s must be equal 1-D shapes, got {blocks.shape} and {times_s.shape}")
    order = np.lexsort((np.arange(len(blocks)), blocks))  # by block, then event order
    gap = np.full(len(blocks), np.inf)
    same = blocks[order][1:] == blocks[order][:-1]
    gap[order[:-1][same]] = times_s[order][1:][same] - times_s[order][:-1][same]
    return gap
