"""Per-layer curves of the loads an expert cache makes per step at every slot count, estimated online, at one or
more batch sizes; the cache is the engine's (runtime's `OnDemandExperts`), not a textbook per-access LRU.

Runs in the controller (state/loop feed it each window's routing; the optimizer reads the curves). The engine
serves a step's union of needed experts in consecutive groups of its slots, by ascending id, and a miss evicts
the least recently used resident outside its group: it never evicts an expert the step still needs while the
union fits, and once a union outgrows the slots, the first group's misses evict every resident outside it, so
the later groups find nothing. One pass over a layer's steps prices every slot count S at once: a needed expert
hits at S when it is among the step's first S (by id) and at most S - 1 others were touched since its last use
before this step (a step-granular distance; Mattson's per-access distance also counts the step's own earlier
accesses, a cache that evicts what the step still needs).

Against the engine's rule replayed (bench/phase_residency.py, itself checked against `OnDemandExperts`) over
three real routing traces fitted to 128, 8 and 60 experts, steps of 1-256 decode tokens swinging by half and a
prefill in 20 (this CPU box, session 42): within 15 % (or 0.5 loads) at all 125 slot counts looked at, at most
5.3 % off; Mattson's per-access curves at 82 (32 decode tokens a step at 56 of 128 slots: 63.7 loads a step
where the engine makes 16.4, every slot below the union looking worthless).

API (the loop helper's):
- `MissRatioCurves(num_layers, num_experts, batch_sizes=(1,), decay=0.0)`
- `observe_token(layer, expert_ids)`: one token's experts at `layer`; for every tracked batch size B the
  token joins the pending union, which is flushed as a step every B tokens of that layer.
- `observe_step(layer, union_ids, batch=1)`: a whole step's union, into the curve of batch `batch` (telemetry
  already per step; with continuous batching, `tracked_batch(b)` names the tracked size a step of b tokens
  belongs to). The real steps share one recency order per layer, whatever their size: a decode step after a
  prefill finds the cache the prefill left (its distances count the prefill's experts), as one cache
  shared by every step does; each size keeps its own loads, and with `decay` every size fades with each
  real step. An object is fed one way, tokens or steps (the other raises ValueError).
- `hit_rate_curve(layer, batch) -> np.ndarray` [E + 1] float64: the share of needed experts found resident with
  0..E slots (non-decreasing, [0] = 0; cold misses miss at every size). Zeros before any observation.
- `expected_misses_per_step(layer, batch) -> np.ndarray` [E + 1]: the loads a step makes at each slot count
  (what the cost model prices); mean union size per step x (1 - hit rate).
- `mean_union_size(layer, batch) -> float`, `num_steps(layer, batch) -> float` (decayed counts).
`decay` in [0, 1): each observed step multiplies that layer's loads by (1 - decay) first, so the curves
follow a drifting workload (decay 0: exact counts since the start). The curves are not concave in general
(cliffs), which is why the optimizer solves the split exactly.

Never imports torch, runtime or agent; holds no global state.

Shape letters: L layers, E experts per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class _Recency:
    """One access stream's recency order: each expert's last-access clock."""

    def __init__(self, num_experts: int) -> None:
        self.last = np.full(num_experts, -1, np.int64)  # [E] access clock, -1 never
        self.clock = 0


class _Loads:
    """One layer's loads per slot count at one batch size, over a recency order it owns (the token path's
    hypothetical stream of B-token steps) or shares with the layer's other batch sizes (the real steps)."""

    def __init__(self, num_experts: int) -> None:
        self.own = _Recency(num_experts)
        self.loads = np.zeros(num_experts + 1)  # [E + 1] loads summed over steps, at 0..E slots
        self.steps = 0.0
        self.accesses = 0.0

    def fade(self, decay: float) -> None:
        """Age the loads and their counts by one step's `decay`."""
        if decay:
            self.loads *= 1.0 - decay
            self.steps *= 1.0 - decay
            self.accesses *= 1.0 - decay

    def access_step(self, union: np.ndarray, decay: float, order: _Recency | None = None) -> None:
        rec = self.own if order is None else order
        self.fade(decay)
        e = rec.last.size
        need = np.sort(union)  # the engine's order: ascending groups of the slots
        last = rec.last[need]  # [U] each needed expert's last use before this step
        # Step-granular distance: 1 + the experts touched after its last use and before this step (never: e + 1).
        newer = e - np.searchsorted(np.sort(rec.last), last, side="right")
        dist = np.where(last < 0, e + 1, newer + 1)
        # With S slots an expert hits when resident at the step's start (distance <= S) and in the first group
        # (rank < S): that group's misses evict every resident outside it, so the later groups all miss.
        found = np.maximum(dist, np.arange(1, need.size + 1))
        hits = np.cumsum(np.bincount(found, minlength=e + 2)[: e + 1])  # [E + 1] at 0..E slots
        self.loads += need.size - hits
        self.steps += 1.0
        self.accesses += need.size
        rec.last[need] = rec.clock + np.arange(1, need.size + 1)  # the highest ids the most recent after a step
        rec.clock += need.size


class MissRatioCurves:
    """Online per-layer loads-per-step curves of the engine's expert cache at each tracked batch size (see the
    module docstring)."""

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
        self._per_size = {(layer, b): _Loads(num_experts) for layer in range(num_layers) for b in self.batch_sizes}
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

    def _per_layer_size(self, layer: int, batch: int) -> _Loads:
        if (layer, batch) not in self._per_size:
            raise ValueError(f"miss-ratio curves: layer {layer} / batch {batch} not tracked "
                             f"(layers 0..{self.num_layers - 1}, batch sizes {list(self.batch_sizes)})")
        return self._per_size[(layer, batch)]

    def _feeding(self, how: str) -> None:
        """Tokens (hypothetical streams per size) and real steps (one stream) keep different recency orders: one
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
                self._per_size[(layer, b)].access_step(flat[np.sort(first)], self.decay)
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
        loads = self._per_layer_size(layer, batch)
        for b in self.batch_sizes:  # every size fades with each real step (the one cache forgets what stops coming)
            self._per_size[(layer, b)].fade(self.decay)
        loads.access_step(ids, 0.0, self._order[layer])

    def hit_rate_curve(self, layer: int, batch: int = 1) -> np.ndarray:
        st = self._per_layer_size(layer, batch)
        if st.accesses <= 0:
            return np.zeros(self.num_experts + 1)
        return 1.0 - st.loads / st.accesses  # [E + 1]; [0] = 0: with no slot every needed expert loads

    def mean_union_size(self, layer: int, batch: int = 1) -> float:
        st = self._per_layer_size(layer, batch)
        return st.accesses / st.steps if st.steps else 0.0

    def num_steps(self, layer: int, batch: int = 1) -> float:
        return self._per_layer_size(layer, batch).steps

    def expected_misses_per_step(self, layer: int, batch: int = 1) -> np.ndarray:
        return self.mean_union_size(layer, batch) * (1.0 - self.hit_rate_curve(layer, batch))
