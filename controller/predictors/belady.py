"""Belady's MIN: the clairvoyant eviction policy (no prefetch), the upper bound of any demand-paging cache.

Runs only in offline evaluation: it is given the whole per-layer access stream in its constructor and evicts
the resident whose next access is furthest away (never again = furthest). With no prefetch and no bypass it
is optimal, so its hit rate bounds every online eviction policy's on the same stream. Never used to decide
anything online; never imports torch, runtime or agent.

Shape letters: L layers, E experts per layer, A accesses of one layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_NEVER = np.iinfo(np.int64).max


def next_use_times(stream: np.ndarray) -> np.ndarray:
    """[A] for each access of `stream` ([A] expert ids of one layer), the index of the same expert's next
    access, or _NEVER."""
    nxt = np.full(stream.shape[0], _NEVER, np.int64)  # [A]
    last: dict[int, int] = {}
    for i in range(stream.shape[0] - 1, -1, -1):
        e = int(stream[i])
        nxt[i] = last.get(e, _NEVER)
        last[e] = i
    return nxt


class BeladyPolicy:
    """MIN over the given streams: `streams[l]` is layer l's accesses in the order the harness makes them."""

    name = "belady"

    def __init__(self, streams: Sequence[np.ndarray]) -> None:
        self._streams = [np.asarray(s, np.int64) for s in streams]
        self._next = [next_use_times(s) for s in self._streams]

    def reset(self, num_layers: int, num_experts: int, capacity: int, top_k: int) -> None:
        if num_layers != len(self._streams):
            raise ValueError(f"belady: built for {len(self._streams)} layers, replay has {num_layers}")
        self._pos = [0] * num_layers
        self._next_use = np.full((num_layers, num_experts), _NEVER, np.int64)  # [L, E]

    def begin_layer(self, step: int, layer: int, union: np.ndarray) -> None:
        pass

    def touch(self, layer: int, expert: int, hit: bool) -> None:
        i = self._pos[layer]
        if i >= self._streams[layer].shape[0] or self._streams[layer][i] != expert:
            raise ValueError(f"belady: access {i} of layer {layer} is expert {expert}, not the stream it was "
                             "built for")
        self._next_use[layer, expert] = self._next[layer][i]
        self._pos[layer] = i + 1

    def victim(self, layer: int, evictable: np.ndarray) -> int:
        return int(np.where(evictable, self._next_use[layer], -1).argmax())

    def prefetch(self, step: int, layer: int, resident: np.ndarray, budget: int) -> list[int]:
        return []
