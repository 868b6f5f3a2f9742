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
the least recently used). Mechanism only: the ranking is the policy's, never this module's.
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
        self.fast_path_layers = 0  # MoE layers computed without ensure (all resident, no host sync)
        self.hits = 0
        self.misses = 0
        self.stalls_ms = 0.0  # wall time ensure() spent making room for and waiting on missing experts
        self.num_stalls = 0

    @property
    def capacity(self) -> int:
        """Experts one `ensure` may ask for at once: the slots not held by pins (at least one)."""
        return max(1, self.pool.num_slots - self._num_pinned)

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
        if self.pool.num_free_slots > 0:
            return
        cands = self._candidates(layer, want)
        if not cands and self._inflight:  # slots held by loads started ahead: once landed they can be evicted
            for fut in self._inflight.values():
                with contextlib.suppress(Exception):  # counted by the loader and whoever started it
                    fut.wait()
            if self.pool.num_free_slots > 0:
                return
            cands = self._candidates(layer, want)
        ranked = self.victim_order(cands) if cands else []
        if not ranked:
            raise CapacityError(f"no evictable expert for ({layer}, {expert}): all slots pinned, loading or in use")
        self.evict(*ranked[0])

    def _candidates(self, layer: int, want: set[int]) -> list[Key]:
        return [k for k in self.residents_lru() if not (k[0] == layer and k[1] in want)
                and not self.pool.is_pinned(*k)]

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
