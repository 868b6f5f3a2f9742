"""On-demand expert residency for the reference engine (inference process).

`ensure(layer, experts)` loads every missing expert through the expert loader, evicting residents the
`victim_order` policy ranks first (the agent plugs its policy in with `set_victim_order`; the default is
least-recently-used), never an expert the current layer needs, never a pinned one. Hits, misses and the
time spent waiting for missing experts (`stalls_ms`, the expert-miss stall) are counted; on a GPU the
current stream is ordered after each load (RAW).

Loads started ahead of need (`load_async`, e.g. a plan's prefetch) are remembered, so `ensure` waits for
such an expert instead of loading it twice; `evict` keeps the recency books in step with the pool, and
`pin`/`unpin` keep `capacity` (how many experts one `ensure` may ask for) to the slots pins leave free.
Experts loaded around this class straight through the loader are still found as eviction candidates (as
the least recently used). Under a layer limit (the pool's `limits`, which the agent sets from a plan's caps)
a missing expert takes the place of one of its own layer's, so the layer never holds more slots than its
limit; `chunks` keeps each group a layer computes at once within `capacity_of(layer)` (a plugged
`chunk_order`, e.g. the agent's scan rule, may group them otherwise). Mechanism only: the ranking and the
grouping are the policy's, never this module's.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable

from runtime.errors import CapacityError, ConfigError
from runtime.future import OpFuture
from runtime.memory.slots import ExpertSlotPool, ExpertState
from runtime.transfer import Priority
from runtime.weights.loader import ExpertLoadHandler, StoreKind

Key = tuple[int, int]  # (pool layer, expert)
VictimOrder = Callable[[list[Key]], list[Key]]
ChunkOrder = Callable[[int, list[int], int], list[list[int]]]  # (layer, needed ascending, capacity_of) -> groups


def lru_victim_order(candidates: list[Key]) -> list[Key]:
    """The default ranking: candidates already arrive least recently used first."""
    return candidates


class OnDemandExperts:
    """Implements `runtime.engine.moe.ExpertProvider` over a slot pool and a loader."""

    def __init__(self, pool: ExpertSlotPool, loader: ExpertLoadHandler, store: StoreKind = StoreKind.PINNED,
                 victim_order: VictimOrder | None = None) -> None:
        self.pool, self.loader, self.store = pool, loader, store
        self._num_pinned = 0  # pins made through pin(); each takes a slot away from on-demand use
        self._lru: OrderedDict[Key, None] = OrderedDict()  # least recently used first
        self._inflight: dict[Key, OpFuture] = {}  # loads started by load_async, not yet seen by ensure
        self.victim_order: VictimOrder = victim_order or lru_victim_order
        self.chunk_order: ChunkOrder | None = None  # None: consecutive runs of capacity_of(layer)
        self.fast_path_layers = 0  # MoE layers computed without ensure (all resident, no host sync)
        self.hits = 0
        self.misses = 0
        self.stalls_ms = 0.0  # wall time ensure() spent making room for and waiting on missing experts
        self.num_stalls = 0

    @property
    def capacity(self) -> int:
        """Experts one `ensure` may ask for at once: the slots not held by pins (at least one)."""
        return max(1, self.pool.num_slots - self._num_pinned)

    def capacity_of(self, layer: int) -> int:
        """Experts of `layer` one `ensure` may ask for: `capacity`, and under a layer limit no more than the
        limit leaves beside the layer's pinned experts (at least one)."""
        limit = self.pool.limits.get(layer)
        if limit is None:
            return self.capacity
        num_pinned = sum(self.pool.is_pinned(layer, e) for e in self.pool.resident_experts(layer))
        return max(1, min(self.capacity, limit - num_pinned))

    def chunks(self, layer: int, needed: list[int]) -> list[list[int]]:
        """Groups of `needed` made resident one after another (`ExpertProvider.chunks`); a plugged chunk order
        must cover `needed` once, each group within `capacity_of(layer)` (ConfigError otherwise)."""
        n = self.capacity_of(layer)
        if self.chunk_order is None:
            return [needed[i : i + n] for i in range(0, len(needed), n)]
        groups = self.chunk_order(layer, needed, n)
        if sorted(e for g in groups for e in g) != sorted(needed) or any(not 0 < len(g) <= n for g in groups):
            raise ConfigError(f"chunk_order for layer {layer}: {groups} must cover {needed} once, in non-empty "
                              f"groups of at most capacity_of(layer)={n}")
        return groups

    # ---- policy hook ------------------------------------------------------------------------------
    def _loader(self, layer: int, expert: int) -> ExpertLoadHandler:
        if self.loader is None:
            raise ConfigError(f"expert ({layer}, {expert}) is not resident and this engine has no store to load it "
                              "from (EngineConfig.experts_on_device keeps every expert resident: evict none)")
        return self.loader

    def done_reading(self, layer: int, experts: list[int]) -> None:
        """Record the compute stream's position as a reader of these slots (I4: unmap waits for it)."""
        self.pool.record_read(layer, experts, self.pool.device.record_event())

    def all_resident(self, layer: int) -> bool:
        """Every expert of `layer` holds a slot (e.g. a fully resident model): compute needs no `ensure`."""
        if self.pool.num_slots < self.pool.layout.num_experts:
            return False
        if self.pool.num_resident(layer) == self.pool.layout.num_experts:
            self.fast_path_layers += 1
            self.pool.wait_published()  # a load published once issued may still be copying (I3)
            return True
        return False

    def set_victim_order(self, fn: VictimOrder | None) -> None:
        """Plug a ranking in (the agent's local policy); None restores least-recently-used."""
        self.victim_order = fn or lru_victim_order

    def set_chunk_order(self, fn: ChunkOrder | None) -> None:
        """Plug a grouping of a layer's needed experts in (the agent's scan rule); None: consecutive runs."""
        self.chunk_order = fn

    # ---- what the engine calls --------------------------------------------------------------------
    def ensure(self, layer: int, experts: list[int]) -> None:
        if len(experts) > self.capacity:
            raise CapacityError(f"layer {layer} needs {len(experts)} experts at once; the pool has {self.capacity}")
        want = set(experts)
        for e in experts:
            key = (layer, e)
            if self.pool.is_resident(layer, e):
                self.hits += 1
                self._inflight.pop(key, None)
            else:
                self.misses += 1
                t0 = time.perf_counter()
                try:
                    if not self._wait_inflight(key):
                        self._make_room(layer, e, want)
                        self._loader(layer, e).load(layer, e, self.store).wait()
                finally:
                    self.stalls_ms += (time.perf_counter() - t0) * 1e3
                    self.num_stalls += 1
            self._lru[key] = None
            self._lru.move_to_end(key)
        self.pool.wait_ready(layer, experts)

    def _wait_inflight(self, key: Key) -> bool:
        """True once an earlier `load_async` of `key` landed; False if there was none or it failed."""
        fut = self._inflight.pop(key, None)
        if fut is None:
            return False
        try:
            fut.wait()
        except Exception:  # counted by the loader (and the agent); the caller loads the expert on demand
            return False
        return self.pool.is_resident(*key)

    def _make_room(self, layer: int, expert: int, want: set[int]) -> None:
        limit = self.pool.limits.get(layer)
        if limit is not None and self.pool.num_bound(layer) >= limit:  # the layer is at its limit: one of its own
            self._evict_one(layer, expert, want, same_layer=True)
        if self.pool.num_free_slots > 0:
            return
        self._evict_one(layer, expert, want, same_layer=False)

    def _evict_one(self, layer: int, expert: int, want: set[int], same_layer: bool) -> None:
        cands = self._candidates(layer, want, same_layer)
        if not cands and self._inflight:  # slots held by loads started ahead: once landed they can be evicted
            for fut in self._inflight.values():
                with contextlib.suppress(Exception):  # counted by the loader and whoever started it
                    fut.wait()
            if not same_layer and self.pool.num_free_slots > 0:
                return
            cands = self._candidates(layer, want, same_layer)
        ranked = self.victim_order(cands) if cands else []
        if not ranked:
            where = f"layer {layer} is at its limit of {self.pool.limits.get(layer)} slots and" if same_layer else \
                "all slots are"
            raise CapacityError(f"no evictable expert for ({layer}, {expert}): {where} pinned, loading or in use")
        self.evict(*ranked[0])

    def _candidates(self, layer: int, want: set[int], same_layer: bool = False) -> list[Key]:
        return [k for k in self.residents_lru() if not (k[0] == layer and k[1] in want)
                and not self.pool.is_pinned(*k) and (k[0] == layer or not same_layer)]

    # ---- what the agent calls ---------------------------------------------------------------------
    def residents_lru(self) -> list[Key]:
        """Resident experts, least recently used first; ones never touched here come first of all."""
        states = {k: self.pool.state(*k) for k in self._lru}
        for k, st in states.items():
            if st is ExpertState.ABSENT:  # unmapped around us: forget it
                del self._lru[k]
        tracked = [k for k, st in states.items() if st is ExpertState.RESIDENT]
        num_bound = sum(st is not ExpertState.ABSENT for st in states.values())
        if num_bound + self.pool.num_free_slots >= self.pool.num_slots:
            return tracked  # every bound slot is accounted for: nothing was loaded around us
        seen = set(tracked)
        untracked = [(layer, e) for layer in range(self.pool.layout.num_layers)
                     for e in self.pool.resident_experts(layer) if (layer, e) not in seen]
        return untracked + tracked

    def load_async(self, layer: int, expert: int, priority: Priority = Priority.NORMAL,
                   deadline_s: float | None = None) -> OpFuture:
        """Start loading an absent expert through the loader (refusals raise before anything changes)."""
        self._inflight = {k: f for k, f in self._inflight.items() if not f.done()}
        fut = self._loader(layer, expert).load(layer, expert, self.store, priority, deadline_s)
        key = (layer, expert)
        self._inflight[key] = fut
        self._lru[key] = None
        self._lru.move_to_end(key)  # asked for on purpose: as fresh as a use
        return fut

    def pin(self, layer: int, expert: int) -> None:
        """Pin a resident expert (never evicted until unpinned); a no-op if it already is."""
        if not self.pool.is_pinned(layer, expert):
            self.pool.pin(layer, expert)
            self._num_pinned += 1

    def unpin(self, layer: int, expert: int) -> None:
        if self.pool.is_pinned(layer, expert):
            self.pool.unpin(layer, expert)
            self._num_pinned -= 1

    def evict(self, layer: int, expert: int) -> None:
        """Unmap a resident expert (after its readers finish) and forget its recency."""
        self.pool.unmap(layer, expert)
        self._lru.pop((layer, expert), None)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0
