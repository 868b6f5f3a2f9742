"""KV demand for the split optimizer: what a GPU budget of G KV blocks is worth, window by window of a trace.

Runs in the controller process (the loop values the optimizer's KV options from it) and in offline tools.
Pure numpy; must never import torch, runtime or agent, touch the network, or keep state between objects.

API
    trace = load_request_trace(path)  or  trace_from_rows(rows)   (controller/requests_jsonl.py)
    model = KVDemandModel(trace, decode_step_s, block_tokens=16, prefill_tokens_per_s=None, sample_s=0.5)
    win = model.window(start_s, end_s)   # seconds since the trace's first arrival, [start_s, end_s)
    wins = model.windows(window_s)       # consecutive windows covering the whole trace
    win.kv_value_curve(blocks_options) -> list[KVValuePoint]   # one point per option, in the given order
        KVValuePoint(blocks, prefix_hit_rate, admitted_tokens)  (a NamedTuple: unpacks as a 3-tuple)
    win.admitted_batch(blocks) -> float  # mean running requests that budget holds
    win.num_requests, win.demand_tokens_mean, win.running_mean, win.num_prefix_blocks
    lru_prefix_hit_rate(trace, capacity_prefix_blocks, start_s, end_s) -> float   # exact LRU, the reference

`blocks` counts the engine's KV blocks of `block_tokens` tokens (ModelShape.block_tokens); the trace's
prefix ids name 512-token blocks, so both are converted through tokens.

Model (expected values over the window; each choice below is a stated approximation):
- Running requests. Request r holds KV from its arrival until it has generated `output_length` tokens:
  prefill takes input_length / prefill_tokens_per_s (0 when None), then one token per `decode_step_s`
  (pass the measured step time: Telemetry.step_timings_ms.mean / 1000, or the cost model's). Its KV is
  input_length plus the tokens generated so far. Sampled every `sample_s`, this gives the demand D(t) in
  tokens and the running count n(t). Queueing delay, shared prefix pages and fragmentation are ignored.
- admitted_tokens(G) = mean_t min(C, D(t)), C = G * block_tokens: the context a budget keeps resident
  (what it does not hold must wait or be preempted); admitted_batch(G) = mean_t n(t) * min(1, C / D(t)).
- prefix_hit_rate(G): the fraction of the window's prompt prefix blocks (512 tokens each) found cached,
  counting only a prompt's leading run of cached blocks (vLLM reuses a prefix, not a block after a miss).
  The cache is LRU over prefix blocks with the budget left after the running requests' generated tokens:
  C_prefix = (C - admitted generated tokens) / 512. Its hits use the characteristic-time (working-set)
  approximation of LRU: the mean number of distinct prefix blocks touched in a trailing window of length T
  is W(T) = sum_i |[t_i, t_i + min(T, gap_i)) within the window| / window length (gap_i: time to block i's
  next access); T_C solves W(T_C) = C_prefix, and a block hits iff its prefix's recency (the largest
  time-since-last-seen among its leading blocks) is <= T_C and its position j < C_prefix (the prompt's own
  j earlier blocks were touched just before it). Tests bound its error against exact LRU
  (`lru_prefix_hit_rate`) to 0.03 from about one prompt's blocks up (same-millisecond bursts make it
  overestimate below that; such budgets admit almost no batch anyway).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tierplan.controller.predictors.kv_features import Raw, block_events, next_gap_s
from tierplan.controller.requests_jsonl import BLOCK_TOKENS as PREFIX_BLOCK_TOKENS
from tierplan.controller.requests_jsonl import RequestTrace

_NUM_T = 96  # points of the working-set curve W(T), log-spaced


class KVValuePoint(NamedTuple):
    blocks: int  # GPU KV blocks of block_tokens tokens
    prefix_hit_rate: float  # fraction of the window's prompt prefix blocks served from the cache
    admitted_tokens: float  # time-averaged KV tokens of running requests the budget holds


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _segment_cummax(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Running max within consecutive segments of `lengths` ([E] values, segments in order)."""
    out = values.copy()
    start = 0
    for n in lengths.tolist():
        if n > 1:
            np.maximum.accumulate(out[start:start + n], out=out[start:start + n])
        start += n
    return out


@dataclass(frozen=True)
class KVDemandWindow:
    """One window's KV demand; see the module docstring for the model. Arrays as noted."""

    start_s: float
    end_s: float
    block_tokens: int
    num_requests: int  # arrivals in the window
    demand_tokens: np.ndarray  # [S] KV tokens the running requests need, every sample_s
    generated_tokens: np.ndarray  # [S] the generated part of demand_tokens
    running: np.ndarray  # [S] running requests
    prefix_recency_s: np.ndarray  # [A] per prefix block of the window's prompts; inf = never seen before
    prefix_position: np.ndarray  # [A] the block's index in its prompt
    ws_T_s: np.ndarray  # [K] trailing-window lengths, increasing
    ws_blocks: np.ndarray  # [K] mean distinct prefix blocks touched within them (nondecreasing)
    ws_all_blocks: float  # the same for an unbounded window

    @property
    def num_prefix_blocks(self) -> int:
        return len(self.prefix_recency_s)

    @property
    def demand_tokens_mean(self) -> float:
        return float(self.demand_tokens.mean()) if len(self.demand_tokens) else 0.0

    @property
    def running_mean(self) -> float:
        return float(self.running.mean()) if len(self.running) else 0.0

    def _admit_frac(self, capacity_tokens: float) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.minimum(1.0, capacity_tokens / np.maximum(self.demand_tokens, 1e-12))  # [S]

    def admitted_batch(self, blocks: int) -> float:
        """Mean running requests a budget of `blocks` KV blocks holds."""
        blocks = _check_blocks([blocks])[0]
        if not len(self.running):
            return 0.0
        return float((self.running * self._admit_frac(blocks * self.block_tokens)).mean())

    def _characteristic_time_s(self, capacity_blocks: float) -> float:
        if capacity_blocks >= self.ws_all_blocks:
            return math.inf
        if capacity_blocks < self.ws_blocks[0]:
            return -math.inf  # smaller than the blocks touched in the same millisecond: LRU keeps no reuse
        k = int(np.searchsorted(self.ws_blocks, capacity_blocks, side="right"))  # ws_blocks[k-1] <= C
        if k >= len(self.ws_blocks):
            return math.inf
        lo, hi = self.ws_blocks[k - 1], self.ws_blocks[k]
        frac = 0.0 if hi <= lo else (capacity_blocks - lo) / (hi - lo)
        return float(np.exp(np.log(self.ws_T_s[k - 1]) + frac * np.log(self.ws_T_s[k] / self.ws_T_s[k - 1])))

    def kv_value_curve(self, blocks_options: Sequence[int]) -> list[KVValuePoint]:
        """(blocks, prefix_hit_rate, admitted_tokens) for each option, in the order given."""
        points = []
        for blocks in _check_blocks(blocks_options):
            capacity = float(blocks * self.block_tokens)
            if len(self.demand_tokens):
                frac = self._admit_frac(capacity)
                admitted = float(np.minimum(capacity, self.demand_tokens).mean())
                generated = float((self.generated_tokens * frac).mean())
            else:
                admitted = generated = 0.0
            hit = 0.0
            prefix_blocks = (capacity - generated) / PREFIX_BLOCK_TOKENS
            if self.num_prefix_blocks and prefix_blocks >= 1.0:
                t_c = self._characteristic_time_s(prefix_blocks)
                # A first access always misses; block j comes after the prompt's own j blocks in LRU order.
                ok = np.isfinite(self.prefix_recency_s) & (self.prefix_position < prefix_blocks)
                hit = float(np.count_nonzero(ok & (self.prefix_recency_s <= t_c))) / self.num_prefix_blocks
            points.append(KVValuePoint(blocks, hit, admitted))
        return points


def _check_blocks(options: Sequence[int]) -> list[int]:
    out = list(options)
    if not out:
        raise ValueError("blocks_options is empty; expected at least one block count")
    for i, b in enumerate(out):
        if isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 0:
            raise ValueError(f"blocks_options[{i}] must be an int >= 0 (KV blocks), got {b!r}")
    return [int(b) for b in out]


class KVDemandModel:
    """A request trace prepared once for KV value curves over any of its windows."""

    def __init__(self, trace: RequestTrace, decode_step_s: float, block_tokens: int = 16,
                 prefill_tokens_per_s: float | None = None, sample_s: float = 0.5) -> None:
        self.decode_step_s = _positive("decode_step_s", decode_step_s)
        self.sample_s = _positive("sample_s", sample_s)
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}")
        self.block_tokens = block_tokens
        prefill_s = 0.0 if prefill_tokens_per_s is None else 1.0 / _positive("prefill_tokens_per_s",
                                                                             prefill_tokens_per_s)
        ev = block_events(trace)
        self._arrival_s = (trace.arrival_ms - trace.arrival_ms[0]) / 1000.0  # [R]
        self._input = trace.input_length.astype(np.float64)  # [R]
        self._output = trace.output_length.astype(np.float64)  # [R]
        self._decode_start_s = self._arrival_s + self._input * prefill_s  # [R]
        self._end_s = self._decode_start_s + self._output * self.decode_step_s  # [R]
        self._ev_t = ev.times_s  # [E]
        self._ev_request = ev.request  # [E]
        self._ev_gap = next_gap_s(ev.blocks, ev.times_s)  # [E]
        depth = np.array([len(h) for h in trace.hash_ids], dtype=np.int64)  # [R]
        self._ev_prefix_recency = _segment_cummax(ev.raw[:, Raw.RECENCY_S], depth)  # [E]
        self._ev_position = ev.raw[:, Raw.POSITION]  # [E]
        self.span_s = float(self._end_s.max())
        self._t_grid = np.geomspace(1e-3, max(self.span_s, 1.0) * 2.0, _NUM_T)  # [K] trailing-window lengths

    def window(self, start_s: float, end_s: float) -> KVDemandWindow:
        if not (math.isfinite(start_s) and math.isfinite(end_s) and 0 <= start_s < end_s):
            raise ValueError(f"window needs 0 <= start_s < end_s (finite seconds), got {start_s!r}, {end_s!r}")
        return self._window(start_s, end_s, self._covered_time(np.array([start_s, end_s]))[:, :2])

    def windows(self, window_s: float) -> list[KVDemandWindow]:
        """Consecutive windows of `window_s` from 0 until the last request has finished."""
        window_s = _positive("window_s", window_s)
        num = max(1, math.ceil(self.span_s / window_s))
        edges = np.arange(num + 1) * window_s  # [N+1]
        covered = self._covered_time(edges)  # [K+1, N+1]
        return [self._window(float(edges[i]), float(edges[i + 1]), covered[:, i:i + 2]) for i in range(num)]

    def _covered_time(self, x: np.ndarray) -> np.ndarray:
        """F_T(x) = sum_i clip(x - t_i, 0, min(T, gap_i)) for each T of the grid, then T unbounded: [K+1, X].

        The working set of a window [a, b) is (F_T(b) - F_T(a)) / (b - a). Few points: directly, O(E) each;
        many: once per T through the accesses sorted by when they stop being their block's latest one.
        """
        t, gap = self._ev_t, self._ev_gap
        out = np.empty((_NUM_T + 1, len(x)))
        cum_t = np.concatenate([[0.0], np.cumsum(t)])  # t is sorted (time order)
        num_started = np.searchsorted(t, x, side="right")  # [X]
        for k, T in enumerate([*self._t_grid, math.inf]):
            d = np.minimum(T, gap)  # [E]
            if len(x) <= 4:
                out[k] = [float(np.clip(xi - t, 0.0, d).sum()) for xi in x]
                continue
            e = t + d
            order = np.argsort(e, kind="stable")
            e_sorted = e[order]
            finite = np.isfinite(e_sorted)
            cum_d = np.concatenate([[0.0], np.cumsum(np.where(finite, d[order], 0.0))])
            cum_te = np.concatenate([[0.0], np.cumsum(np.where(finite, t[order], 0.0))])
            num_ended = np.searchsorted(e_sorted, x, side="right")  # [X]
            out[k] = (cum_d[num_ended] + x * (num_started - num_ended)
                      - (cum_t[num_started] - cum_te[num_ended]))
        return out

    def _window(self, start_s: float, end_s: float, covered: np.ndarray) -> KVDemandWindow:
        arrived = (self._arrival_s >= start_s) & (self._arrival_s < end_s)  # [R]
        demand, generated, running = self._samples(start_s, end_s)
        in_window = arrived[self._ev_request]  # [E]
        ws = (covered[:, 1] - covered[:, 0]) / (end_s - start_s)  # [K+1]
        ws_grid = np.maximum.accumulate(ws[:-1])
        return KVDemandWindow(start_s=start_s, end_s=end_s, block_tokens=self.block_tokens,
                              num_requests=int(arrived.sum()), demand_tokens=demand, generated_tokens=generated,
                              running=running, prefix_recency_s=self._ev_prefix_recency[in_window],
                              prefix_position=self._ev_position[in_window],
                              ws_T_s=self._t_grid, ws_blocks=ws_grid, ws_all_blocks=float(max(ws[-1], ws_grid[-1])))

    def _samples(self, start_s: float, end_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        num = max(1, math.ceil((end_s - start_s) / self.sample_s))
        times = start_s + (np.arange(num) + 0.5) * self.sample_s  # [S]
        live = (self._arrival_s < end_s) & (self._end_s > start_s)
        arrival, dstart, end = self._arrival_s[live], self._decode_start_s[live], self._end_s[live]
        first = np.searchsorted(times, arrival, side="left")  # first sample at or after arrival
        stop = np.searchsorted(times, end, side="left")  # samples before the request ends
        counts = np.maximum(stop - first, 0)
        total = int(counts.sum())
        if total == 0:
            zeros = np.zeros(num)
            return zeros, zeros.copy(), zeros.copy()
        owner = np.repeat(np.arange(len(counts)), counts)  # [P]
        offset = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        idx = first[owner] + offset  # [P] sample index
        gen = np.clip((times[idx] - dstart[owner]) / self.decode_step_s, 0.0, self._output[live][owner])
        demand = np.bincount(idx, self._input[live][owner] + gen, minlength=num)
        return demand, np.bincount(idx, gen, minlength=num), np.bincount(idx, minlength=num).astype(np.float64)


def lru_prefix_hit_rate(trace: RequestTrace, capacity_prefix_blocks: int, start_s: float = 0.0,
                        end_s: float = math.inf) -> float:
    """Exact LRU over 512-token prefix blocks (every request, in order), with prefix-run hits as in the model:
    the fraction of prefix blocks of requests arriving in [start_s, end_s) found cached. The reference the
    characteristic-time approximation is checked against."""
    cache: OrderedDict[int, None] = OrderedDict()
    arrival_s = (trace.arrival_ms - trace.arrival_ms[0]) / 1000.0
    hits = total = 0
    for r, ids in enumerate(trace.hash_ids):
        counted = start_s <= arrival_s[r] < end_s
        run = True
        for h in ids:
            hit = h in cache
            run = run and hit
            if counted:
                hits += run
                total += 1
            if hit:
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > capacity_prefix_blocks:
                    cache.popitem(last=False)
    return hits / total if total else 0.0
