"""On-demand expert residency for the reference engine (inference process).

`ensure(layer, experts)` loads every missing expert through the expert loader, evicting residents the
`victim_order` policy ranks first (the agent supplies it; the default is least-recently-used), never an
expert the current layer needs, never a pinned one. Hits and misses are counted; on a GPU the current
stream is ordered after each load (RAW). Mechanism: the ranking is the policy's, not this module's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from runtime.errors import CapacityError
from runtime.memory.slots import ExpertSlotPool
from runtime.weights.loader import ExpertLoadHandler, StoreKind

VictimOrder = Callable[[list[tuple[int, int]]], list[tuple[int, int]]]


class OnDemandExperts:
    """Implements `runtime.engine.moe.ExpertProvider` over a slot pool and a loader."""

    def __init__(self, pool: ExpertSlotPool, loader: ExpertLoadHandler, store: StoreKind = StoreKind.PINNED,
                 victim_order: VictimOrder | None = None) -> None:
        self.pool, self.loader, self.store = pool, loader, store
        self.capacity = pool.num_slots
        self._lru: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.victim_order: VictimOrder = victim_order or (lambda cands: cands)  # cands arrive in LRU order
        self.hits = 0
        self.misses = 0

    def ensure(self, layer: int, experts: list[int]) -> None:
        if len(experts) > self.capacity:
            raise CapacityError(f"layer {layer} needs {len(experts)} experts at once; the pool has {self.capacity}")
        want = set(experts)
        for e in experts:
            key = (layer, e)
            if self.pool.is_resident(layer, e):
                self.hits += 1
            else:
                self.misses += 1
                if self.pool.num_free_slots == 0:
                    cands = [k for k in self._lru if not (k[0] == layer and k[1] in want)
                             and not self.pool.is_pinned(*k)]
                    if not cands:
                        raise CapacityError(f"no evictable expert for ({layer}, {e}): all slots pinned or in use")
                    victim = self.victim_order(cands)[0]
                    self.pool.unmap(*victim)
                    self._lru.pop(victim, None)
                self.loader.load(layer, e, self.store).wait()
            self._lru[key] = None
            self._lru.move_to_end(key)
        self.pool.wait_ready(layer, experts)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0
