"""Baseline eviction policies for a per-layer expert cache: LRU, LFU, LFU with EWMA decay, LFRU (no prefetch).

Runs in the controller (offline evaluation and as the reference the tierplan policies must beat); the agent
runs the same rules locally. Every policy here is online: it sees only the accesses the harness gives it.
Never prefetches, never imports torch, runtime or agent.

- `lru`: evict the least recently used resident.
- `lfu`: evict the resident with the fewest accesses since the start (counts kept for every expert, resident
  or not: "perfect" LFU); ties go to the least recent.
- `lfu-ewma`: like lfu, but each layer's counts decay by `decay` per step, so old popularity fades.
- `lfru`: LFRU (Bilal et al. 2017, the shape of vLLM PR #37190's expert cache): the ceil(C/2) most recent
  residents form a privileged LRU partition that is never evicted; the victim is the least frequent of the rest.

Shape letters: L layers, E experts per layer.
"""

from __future__ import annotations

import math

import numpy as np

_TIE_SCALE = 1e-9  # recency as a tiebreak far below one access of frequency


class _Recency:
    """Per-layer access clock shared by the baselines."""

    def reset(self, num_layers: int, num_experts: int, capacity: int, top_k: int) -> None:
        self.capacity = capacity
        self._clock = 0
        self.last_used = np.full((num_layers, num_experts), -1.0)  # [L, E] access time, -1 never
        self.count = np.zeros((num_layers, num_experts))  # [L, E] accesses (decayed for lfu-ewma)

    def begin_layer(self, step: int, layer: int, union: np.ndarray) -> None:
        pass

    def touch(self, layer: int, expert: int, hit: bool) -> None:
        self._clock += 1
        self.last_used[layer, expert] = self._clock
        self.count[layer, expert] += 1.0

    def prefetch(self, step: int, layer: int, resident: np.ndarray, budget: int) -> list[int]:
        return []


class LRUPolicy(_Recency):
    name = "lru"

    def victim(self, layer: int, evictable: np.ndarray) -> int:
        return int(np.where(evictable, self.last_used[layer], np.inf).argmin())


class LFUPolicy(_Recency):
    name = "lfu"

    def victim(self, layer: int, evictable: np.ndarray) -> int:
        score = self.count[layer] + _TIE_SCALE * self.last_used[layer]  # [E]
        return int(np.where(evictable, score, np.inf).argmin())


class EWMALFUPolicy(LFUPolicy):
    """LFU whose counts decay by `decay` per step (one step = one begin_layer of the layer)."""

    name = "lfu-ewma"

    def __init__(self, decay: float = 0.02) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"lfu-ewma: decay must be in (0, 1), got {decay}")
        self.decay = decay

    def begin_layer(self, step: int, layer: int, union: np.ndarray) -> None:
        self.count[layer] *= 1.0 - self.decay


class LFRUPolicy(_Recency):
    name = "lfru"

    def victim(self, layer: int, evictable: np.ndarray) -> int:
        candidates = np.flatnonzero(evictable)
        privileged = math.ceil(self.capacity / 2)
        # The incoming expert takes one privileged place; the privileged - 1 most recent residents keep theirs.
        keep_old = max(1, candidates.size - (privileged - 1))
        if keep_old < candidates.size:
            order = np.argsort(self.last_used[layer, candidates])  # oldest first
            candidates = candidates[order[:keep_old]]
        score = self.count[layer, candidates] + _TIE_SCALE * self.last_used[layer, candidates]
        return int(candidates[score.argmin()])


def baseline_policies() -> list[_Recency]:
    """One fresh instance of each baseline, in report order."""
    return [LRUPolicy(), LFUPolicy(), EWMALFUPolicy(), LFRUPolicy()]
