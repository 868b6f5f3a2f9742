"""Per-layer LRU miss-ratio curves estimated online from stack distances, at one or more batch sizes.

Runs in the controller (state/loop feed it each window's routing; the optimizer reads the curves). As a
cache-partitioning system would (Mattson's stack algorithm), one pass over a layer's access stream gives the LRU
hit rate at every cache size at once: an access whose stack distance (distinct experts touched since its last
access, itself included) is d hits in every LRU cache of >= d slots. At batch B a step demands the union of B
tokens' experts, accessed once each, so the curve at B comes from the stream of B-token unions.

API (the loop helper's):
- `MissRatioCurves(num_layers, num_experts, batch_sizes=(1,), decay=0.0)`
- `observe_token(layer, expert_ids)`: one token's experts at `layer`; for every tracked batch size B the
  token joins the pending union, which is flushed as a step every B tokens of that layer.
- `observe_step(layer, union_ids, batch=1)`: a whole step's union, into the curve of batch `batch` (telemetry
  already per step; with continuous batching, `tracked_batch(b)` names the tracked size a step of b tokens
  belongs to). The real steps share one LRU order per layer, whatever their size: a decode step after a
  prefill finds the cache the prefill left (its stack distances count the prefill's experts), as one cache
  shared by every step does; each size keeps its own histogram, and with `decay` every size fades with each
  real step. An object is fed one way, tokens or steps (the other raises ValueError).
- `hit_rate_curve(layer, batch) -> np.ndarray` [E + 1] float64: LRU hit rate with 0..E resident slots
  (non-decreasing, [0] = 0; cold misses miss at every size). Zeros before any observation.
- `expected_misses_per_step(layer, batch) -> np.ndarray` [E + 1]: mean union size per step x (1 - hit rate):
  the loads an LRU cache of each slot count makes per step (what the cost model prices).
- `mean_union_size(layer, batch) -> float`, `num_steps(layer, batch) -> float` (decayed counts).
`decay` in [0, 1): each observed step multiplies that layer's histogram by (1 - decay) first, so the curves
follow a drifting workload (decay 0: exact counts since the start). Curves are for LRU, the agent's default
eviction; they are not concave in general (cliffs), which is why the optimizer solves the split exactly.

Never imports torch, runtime or agent; holds no global state.

Shape letters: L layers, E experts per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class _Recency:
    """One access stream's LRU order: each expert's last-access clock."""

    def __init__(self, num_experts: int) -> None:
        self.last = np.full(num_experts, -1, np.int64)  # [E] access clock, -1 never
        self.clock = 0


class _Stack:
    """One layer's stack-distance histogram at one batch size, over an LRU order it owns (the token path's
    hypothetical stream of B-token steps) or shares with the layer's other batch sizes (the real steps)."""

    def __init__(self, num_experts: int) -> None:
        self.own = _Recency(num_experts)
        self.hist = np.zeros(num_experts + 1)  # [E + 1] hist[d] for d = 1..E; hist[0] holds cold misses
        self.steps = 0.0
        self.accesses = 0.0

    def fade(self, decay: float) -> None:
        """Age the histogram and its counts by one step's `decay`."""
        if decay:
            self.hist *= 1.0 - decay
            self.steps *= 1.0 - decay
            self.accesses *= 1.0 - decay

    def access_step(self, union: np.ndarray, decay: float, order: _Recency | None = None) -> None:
        rec = self.own if order is None else order
        self.fade(decay)
        self.steps += 1.0
        for e in union.tolist():
            t = rec.last[e]
            if t < 0:
                self.hist[0] += 1.0
            else:
                self.hist[int((rec.last > t).sum()) + 1] += 1.0
            rec.clock += 1
            rec.last[e] = rec.clock
            self.accesses += 1.0


class MissRatioCurves:
    """Online per-layer LRU hit-rate curves at each tracked batch size (see module docstring)."""

    name = "miss-ratio"
    version = 1

    def __init__(self, num_layers: int, num_experts: int, batch_sizes: Sequence[int] = (1,),
                 decay: float = 0.0) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"miss-ratio curves: need num_layers, num_experts >= 1, got {num_layers}, {num_experts}")
        if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
            raise ValueError(f"miss-ratio curves: batch_sizes must be ints >= 1, got {list(batch_sizes)}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"miss-ratio curves: decay must be in [0, 1), got {decay}")
        self.num_layers, self.num_experts, self.decay = num_layers, num_experts, decay
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self._stacks = {(layer, b): _Stack(num_experts) for layer in range(num_layers) for b in self.batch_sizes}
        self._order = [_Recency(num_experts) for _ in range(num_layers)]  # per layer: the real steps' LRU order
        self._fed: str | None = None  # "tokens" or "steps", from the first observation
        self._pending = {(layer, b): ([], 0) for layer in range(num_layers) for b in self.batch_sizes}

    def _check(self, layer: int, ids: np.ndarray) -> np.ndarray:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"miss-ratio curves: layer {layer} outside [0, {self.num_layers})")
        ids = np.asarray(ids, np.int64).ravel()
        ids = ids[ids >= 0]
        if ids.size and int(ids.max()) >= self.num_experts:
            raise ValueError(f"miss-ratio curves: expert {int(ids.max())} at layer {layer} >= num_experts "
                             f"{self.num_experts}")
        return ids

    def _stack(self, layer: int, batch: int) -> _Stack:
        if (layer, batch) not in self._stacks:
            raise ValueError(f"miss-ratio curves: layer {layer} / batch {batch} not tracked "
                             f"(layers 0..{self.num_layers - 1}, batch sizes {list(self.batch_sizes)})")
        return self._stacks[(layer, batch)]

    def _feeding(self, how: str) -> None:
        """Tokens (hypothetical streams per size) and real steps (one stream) keep different LRU orders: one
        object is fed one way, never both."""
        if self._fed is None:
            self._fed = how
        elif self._fed != how:
            raise ValueError(f"miss-ratio curves: fed by {self._fed} already, not by {how} (use one object per way)")

    def observe_token(self, layer: int, expert_ids: np.ndarray) -> None:
        ids = self._check(layer, expert_ids)
        self._feeding("tokens")
        for b in self.batch_sizes:
            parts, n = self._pending[(layer, b)]
            parts.append(ids)
            n += 1
            if n == b:
                flat = np.concatenate(parts)
                _, first = np.unique(flat, return_index=True)
                self._stacks[(layer, b)].access_step(flat[np.sort(first)], self.decay)
                parts, n = [], 0
            self._pending[(layer, b)] = (parts, n)

    def tracked_batch(self, batch: int) -> int:
        """The largest tracked batch size <= `batch` (the smallest tracked one below that)."""
        below = [b for b in self.batch_sizes if b <= batch]
        return below[-1] if below else self.batch_sizes[0]

    def observe_step(self, layer: int, union_ids: np.ndarray, batch: int = 1, distinct: bool = False) -> None:
        """`distinct`: the caller guarantees no repeated id (skips the dedup)."""
        ids = self._check(layer, union_ids)
        if not distinct:
            _, first = np.unique(ids, return_index=True)
            ids = ids[np.sort(first)]
        self._feeding("steps")
        stack = self._stack(layer, batch)
        for b in self.batch_sizes:  # every size fades with each real step (the one cache forgets what stops coming)
            self._stacks[(layer, b)].fade(self.decay)
        stack.access_step(ids, 0.0, self._order[layer])

    def hit_rate_curve(self, layer: int, batch: int = 1) -> np.ndarray:
        st = self._stack(layer, batch)
        curve = np.zeros(self.num_experts + 1)  # [E + 1]
        total = st.hist.sum()
        if total > 0:
            curve[1:] = np.cumsum(st.hist[1:]) / total
        return curve

    def mean_union_size(self, layer: int, batch: int = 1) -> float:
        st = self._stack(layer, batch)
        return st.accesses / st.steps if st.steps else 0.0

    def num_steps(self, layer: int, batch: int = 1) -> float:
        return self._stack(layer, batch).steps

    def expected_misses_per_step(self, layer: int, batch: int = 1) -> np.ndarray:
        return self.mean_union_size(layer, batch) * (1.0 - self.hit_rate_curve(layer, batch))
