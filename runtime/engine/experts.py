"""On-demand expert residency for the reference engine (inference process).

`ensure(layer, experts)` loads every missing expert through the expert loader as one list (`load_many`),
evicting residents the `victim_order` policy ranks first, ranked once per list (the agent plugs its policy in
with `set_victim_order`, its ranks served from the recency books' index, recency.py; the default is
least-recently-used; `ScanVictimOrder`, victims.py, is the scan rule),
never an expert the current layer needs, never a pinned one. Hits, misses and the time spent waiting for missing experts
(`stalls_ms`, the expert-miss stall) are counted; on a GPU the current stream is ordered after the layer's
loads (RAW: one wait per list, `ExpertSlotPool.wait_ready`).
Victims are released, not unmapped (`ExpertSlotPool.release`): the engine thread never waits for the kernels
still reading them; the loads that reuse their slots are ordered after those kernels on the device.

Loads started ahead of need (`load_async`, e.g. a plan's prefetch, or `prefetch`, a piecewise step's
layer-ahead window, which never evicts what `soon` names) are remembered, so `ensure` waits for such an
expert instead of loading it twice; `evict` keeps the recency books in step with the pool, `pin`/`unpin` keep
`capacity` (how many experts one `ensure` may ask for) to the slots pins leave free. Experts loaded around this
class are eviction candidates too (the least recently used). Under a layer limit (the pool's `limits`, which the
agent sets from a plan's caps) a missing expert takes the place of one of its own layer's, so the layer never
holds more slots than its limit, and a prefetch never passes it; `chunks` keeps each group a layer computes at
once within `capacity_of(layer)` (a plugged `chunk_order`, e.g. the agent's scan rule, may group them otherwise).
Mechanism only: the ranking and the grouping are the policy's, never this module's.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence

from tierplan.runtime.engine.recency import RecencyBooks
from tierplan.runtime.engine.victims import ChunkOrder, Key, VictimOrder, VictimRanks, lru_victim_order
from tierplan.runtime.errors import CapacityError, ConfigError
from tierplan.runtime.future import OpFuture, wait_all
from tierplan.runtime.memory.slots import ExpertSlotPool, ExpertState
from tierplan.runtime.transfer import Priority
from tierplan.runtime.weights.loader import ExpertLoadHandler, StoreKind


class OnDemandExperts:
    """Implements `runtime.engine.moe.ExpertProvider` over a slot pool and a loader."""

    def __init__(self, pool: ExpertSlotPool, loader: ExpertLoadHandler, store: StoreKind = StoreKind.PINNED,
                 victim_order: VictimOrder | None = None) -> None:
        self.pool, self.loader, self.store = pool, loader, store
        self._num_pinned = 0  # pins made through pin(); each takes a slot away from on-demand use
        self.books = RecencyBooks(pool)  # every expert tracked here, least recently used first
        self._inflight: dict[Key, OpFuture] = {}  # loads started by load_async, not yet seen by ensure
        self._unpublished: dict[Key, OpFuture] = {}  # ensure(table=True)'s loads, maybe not mapped yet
        self.victim_order: VictimOrder = victim_order or lru_victim_order
        self.victim_ranks: VictimRanks | None = None  # the plugged order's ranks, when it has them
        self.chunk_order: ChunkOrder | None = None  # None: consecutive runs of capacity_of(layer)
        self.fast_path_layers = 0  # MoE layers computed without ensure (all resident, no host sync)
        self.hits = 0
        self.misses = 0
        self.stalls_ms = 0.0  # wall time ensure() spent making room for and waiting on missing experts
        self.num_stalls = 0
        # Host wall ms of ensure's parts (evicting victims, submitting the list, waiting for it to publish, ordering
        # the stream after the layer's loads) and of recording the layer's reads (done_reading).
        self.phase_ms = dict.fromkeys(("evict", "submit", "published", "order", "record"), 0.0)
        self.prefetched = 0  # loads started by prefetch (a piecewise step's layer-ahead window)
        self.prefetch_hits = 0  # experts ensure found loading or loaded ahead (counted in hits too)
        # Loaded ahead (load_async, prefetch) and not yet asked for by their layer: a landed load leaves
        # _inflight at the next load_async, and its first use is still a prefetch hit.
        self._ahead: set[Key] = set()
        self._step_keys: set[Key] = set()  # experts the current forward asked for
        self.last_union = 0  # how many experts the last forward asked for
        # Experts a piecewise step needs in its coming layers: victims are never taken from them.
        self.soon: frozenset[Key] = frozenset()

    @property
    def capacity(self) -> int:
        """Experts one `ensure` may ask for at once: the slots not held by pins (at least one)."""
        return max(1, self.pool.num_slots - self._num_pinned)

    def capacity_of(self, layer: int, experts: Sequence[int] = ()) -> int:
        """Experts of `layer` one `ensure` may ask for: `capacity`, and under a layer limit no more than the
        limit leaves beside the layer's pinned experts (at least one); pinned ones among `experts` (the set
        asked for at once) hold their slot already and do not count against it."""
        limit = self.pool.limits.get(layer)
        if limit is None:
            return self.capacity
        num_pinned = self.pool.num_pinned(layer) - sum(self.pool.is_pinned(layer, e) for e in set(experts))
        return max(1, min(self.capacity, limit - num_pinned))

    def _layer_room(self, layer: int) -> int | None:  # slots `layer` may still bind under its limit (None: no limit)
        limit = self.pool.limits.get(layer)
        return None if limit is None else max(0, limit - self.pool.num_bound(layer))

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
        t0 = time.perf_counter()
        self.pool.record_read(layer, experts, self.pool.device.record_event())
        self.phase_ms["record"] += (time.perf_counter() - t0) * 1e3

    def all_resident(self, layer: int) -> bool:
        """Every expert of `layer` holds a slot (e.g. a fully resident model): compute needs no `ensure`."""
        if self.pool.num_slots < self.pool.layout.num_experts:
            return False
        if self.pool.num_resident(layer) == self.pool.layout.num_experts:
            self.fast_path_layers += 1
            self.pool.map_for_read(layer, range(self.pool.layout.num_experts))  # the layer is read through its range
            self.pool.wait_published()  # a load published once issued may still be copying (I3)
            return True
        return False

    def set_victim_order(self, fn: VictimOrder | None, ranks: VictimRanks | None = None) -> None:
        """Plug a ranking in (the agent's local policy) with its ranks if it has them; None restores LRU."""
        self.victim_order = fn or lru_victim_order
        self.victim_ranks = ranks if fn is not None else None
        self.books.plug(self.victim_ranks)

    def set_chunk_order(self, fn: ChunkOrder | None) -> None:  # the agent's scan rule; None: consecutive runs
        self.chunk_order = fn

    # ---- what the engine calls --------------------------------------------------------------------
    def ensure(self, layer: int, experts: list[int], table: bool = False) -> None:
        """Make every listed expert of `layer` resident and order the compute stream after its load. The misses
        load as one list (`load_many`: one transfer, one future each); loads started ahead are waited for.
        table: the caller reads through the pool's slot table (a piecewise step's GEMMs): a miss is ready once
        its copy is issued, before its range is mapped, and the table names each listed expert's slot."""
        if len(experts) > self.capacity_of(layer, experts):
            raise CapacityError(f"layer {layer} needs {len(experts)} experts at once; it may hold "
                                f"{self.capacity_of(layer, experts)} (the pool's free slots and the layer's limit)")
        want = set(experts)
        missing = []
        for e in experts:
            key = (layer, e)
            self._step_keys.add(key)
            if key in self._inflight or not self._usable(key, table):
                missing.append(e)
            else:
                self.hits += 1
                if key in self._ahead:
                    self._ahead.discard(key)
                    self.prefetch_hits += 1
                self.books.touch(key)
        if missing:
            t0 = time.perf_counter()
            try:
                todo = []
                for e in missing:
                    self._ahead.discard((layer, e))
                    if self._wait_inflight((layer, e)):
                        self.hits += 1
                        self.prefetch_hits += 1
                    else:
                        self.misses += 1
                        todo.append(e)
                self._load_list(layer, todo, want, table)
            finally:  # the list's loads that landed are used now, also when another failed (else untracked)
                self.stalls_ms += (time.perf_counter() - t0) * 1e3
                self.num_stalls += 1
                for e in missing:
                    self.books.touch((layer, e))
        t0 = time.perf_counter()
        self.pool.wait_ready(layer, experts, issued_ok=table)
        if table:
            self.pool.sync_table(layer, experts)
        else:  # a reader through the ranges (maps_on_read pools publish loads unmapped)
            self.pool.map_for_read(layer, experts)
        self.phase_ms["order"] += (time.perf_counter() - t0) * 1e3

    def _usable(self, key: Key, table: bool) -> bool:
        """Whether the expert is resident for this reader: a table reader may read a load of `ensure(table=True)`
        whose copy is issued; any other reader waits for its publication (a failed one loads again)."""
        fut = self._unpublished.get(key)
        if fut is not None:
            if table and not fut.done():
                return True
            del self._unpublished[key]
            with contextlib.suppress(Exception):  # counted by the loader; the expert is loaded again below
                fut.wait()
        return self.pool.is_resident(*key)

    def _load_list(self, layer: int, experts: list[int], want: set[int], table: bool = False) -> None:
        """Free a slot for each of `experts` (victims by the plugged order), then load them as one list."""
        if not experts:
            return
        t0 = time.perf_counter()
        room = self._layer_room(layer)
        if room is not None and len(experts) > room:  # at the layer's limit: its own experts make the room
            self._evict_for(layer, want, len(experts) - room, same_layer=True)
        self._evict_for(layer, want, len(experts) - self.pool.num_free_slots)
        t1 = time.perf_counter()
        loader = self._loader(layer, experts[0])
        # at_once: the step waits for the whole list, issued here whole (no in-flight bound, no hand-off).
        if self.store is StoreKind.PINNED and table:  # ready once issued; published later
            pub, futs = loader.load_many_issued(layer, experts, at_once=True)
            self._unpublished.update(zip([(layer, e) for e in experts], pub, strict=True))
        elif self.store is StoreKind.PINNED:
            futs = loader.load_many(layer, experts, at_once=True)
        else:
            futs = [loader.load(layer, e, self.store) for e in experts]
        self.books.own_binds += len(futs)
        t2 = time.perf_counter()
        wait_all(futs)  # the last first: one wake-up per list, not one per expert (each takes the worker's GIL)
        t3 = time.perf_counter()
        for phase, dt in (("evict", t1 - t0), ("submit", t2 - t1), ("published", t3 - t2)):
            self.phase_ms[phase] += dt * 1e3

    def _evict_for(self, layer: int, want: set[int], num: int, same_layer: bool = False) -> None:
        """Evict `num` residents for `layer`'s list: candidates listed and ranked once for the whole list (a
        per-victim ranking walks every resident each time, host time comparable to a small expert's copy:
        bench/results/design_notes.md), outside `soon` first; what that cannot cover goes through `_make_room`
        one at a time (it waits for loads in flight).
        same_layer: only `layer`'s own residents (the layer is at its limit)."""
        if num <= 0:
            return
        ranked = self._ranked(layer, want, num, same_layer=same_layer)
        if len(ranked) < num:
            seen = set(ranked)
            ranked += [k for k in self._ranked(layer, want, num + len(seen), honor_soon=False, same_layer=same_layer)
                       if k not in seen]
        for key in ranked[:num]:
            self.evict(*key)
        for _i in range(num - min(num, len(ranked))):
            self._make_room(layer, -1, want, free_needed=self.pool.num_free_slots + 1, same_layer=same_layer)

    def begin_step(self) -> None:
        """A new forward starts: the last one's union of experts becomes `last_union` (the scan rule reads it)."""
        if self._step_keys:
            self.last_union = len(self._step_keys)
        self._step_keys = set()
        self.soon = frozenset()
        self._unpublished = {k: f for k, f in self._unpublished.items() if not f.done()}
        self.pool.ranges.epoch += 1  # ranges released two steps ago are swept, the last step's kept for reloads

    def prefetch(self, layer: int, experts: list[int]) -> int:
        """Start loading the absent ones of `experts` as one list into free slots or in place of victims outside
        `soon` and the current step's layer; never waits for bytes. Returns how many loads started (fewer
        when nothing more may be evicted)."""
        todo = [e for e in experts if self.pool.state(layer, e) is ExpertState.ABSENT
                and (layer, e) not in self._inflight]
        want = set(experts)
        room = self._layer_room(layer)
        if room is not None:  # a prefetch never passes the layer's limit, nor evicts the layer's own experts
            todo = todo[:room]
        free = self.pool.num_free_slots
        victims = self._ranked(layer, want, len(todo) - free)
        for key in victims:
            self.evict(*key)
        n = min(len(todo), free + len(victims))
        if not n:
            return 0
        futs = self._loader(layer, todo[0]).load_many(layer, todo[:n])
        self.books.own_binds += n
        for e, fut in zip(todo[:n], futs, strict=True):
            self._inflight[(layer, e)] = fut
            self._ahead.add((layer, e))
            self.books.touch((layer, e))
        self.prefetched += n
        return n

    def drain(self) -> int:
        """Wait for every load started ahead (`load_async`, `prefetch`) to land or fail, so the pool's slots are
        settled (an agent applying a plan calls it before it evicts over a new cap). Returns how many it waited
        for; failures are counted by the loader and whoever started the load."""
        futs = list(self._inflight.values())
        for fut in futs:
            with contextlib.suppress(Exception):
                fut.wait()
        return len(futs)

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

    def _make_room(self, layer: int, expert: int, want: set[int], free_needed: int = 1,
                   same_layer: bool = False) -> None:
        if not same_layer and self.pool.num_free_slots >= free_needed:
            return
        ranked = self._ranked(layer, want, 1, same_layer=same_layer)
        # Loads in flight are evictable once published: wait for them (this class's step lists, then prefetches,
        # each oldest first) only until one will do: the whole set can be a layer's misses still being mapped.
        for fut in [] if ranked else [*self._unpublished.values(), *self._inflight.values()]:
            with contextlib.suppress(Exception):  # counted by the loader and whoever started it
                fut.wait()
            if not same_layer and self.pool.num_free_slots >= free_needed:
                return
            if ranked := self._ranked(layer, want, 1, same_layer=same_layer):
                break
        if not ranked:  # `soon` is a preference: a layer's own needs come first
            ranked = self._ranked(layer, want, 1, honor_soon=False, same_layer=same_layer)
        if not ranked:
            where = (f"layer {layer} is at its limit of {self.pool.limits.get(layer)} slots and its experts are"
                     if same_layer else "all slots are")
            raise CapacityError(f"no evictable expert for ({layer}, {expert}): {where} pinned, loading or in use")
        self.evict(*ranked[0])

    def _ranked(self, layer: int, want: set[int], num: int, honor_soon: bool = True,
                same_layer: bool = False) -> list[Key]:
        """The first `num` victims for `layer`'s list in the plugged order. LRU (the default) walks the recency
        books from their oldest end and stops there, plugged ranks are served from the books' index (listing
        every resident per list costs more host time than a small expert's copy); another order, or ranks that
        do not hold this time, rank every candidate."""
        if num <= 0:
            return []
        ranks = self.victim_ranks
        if self.victim_order is not lru_victim_order and (ranks is None or not ranks.ranks_hold()):
            return self.victim_order(self._candidates(layer, want, honor_soon, same_layer))[:num]
        out = self._victims(num, frozenset((layer, e) for e in want), honor_soon, layer if same_layer else None)
        if ranks is not None:
            ranks.saw_victims(out)
        return out

    def ranked_victims(self, num: int, layer: int | None = None, protect: frozenset[Key] = frozenset()) -> list[Key]:
        """The first `num` evictable experts outside `protect` (of `layer` only, when given) by the plugged ranks
        (the agent's prefetch makes room with it); ConfigError if the plugged order has none."""
        if self.victim_ranks is None:
            raise ConfigError("ranked_victims: the plugged victim order has no ranks (set_victim_order(fn, ranks))")
        return self._victims(num, protect, False, layer)

    def _victims(self, num: int, protect: frozenset[Key], honor_soon: bool, layer: int | None) -> list[Key]:
        """Resident, unpinned experts outside `protect` (and `soon` when honoured), of `layer` only when given, by
        the books: their ranks when plugged, else from the oldest end."""
        if num <= 0:
            return []
        self.books.track_loads_around()
        ranks, gone = self.victim_ranks, []

        def eligible(k: Key) -> bool:
            if k in protect or (honor_soon and k in self.soon) or (layer is not None and k[0] != layer):
                return False
            st = self.pool.state(*k)
            if st is ExpertState.ABSENT:
                gone.append(k)  # unmapped around us: forget it
            return (st is ExpertState.RESIDENT and not self.pool.is_pinned(*k)
                    and not (ranks is not None and ranks.keeps(k)))

        if ranks is None:
            out = list(itertools.islice(filter(eligible, self.books.lru), num))
        else:
            out = self.books.ranked(num, eligible, layer)
        for k in gone:
            self.books.forget(k)
        return out

    def _candidates(self, layer: int, want: set[int], honor_soon: bool = True, same_layer: bool = False) -> list[Key]:
        return [k for k in self.residents_lru() if not (k[0] == layer and k[1] in want)
                and not self.pool.is_pinned(*k) and not (honor_soon and k in self.soon)
                and (k[0] == layer or not same_layer)]

    # ---- what the agent calls ---------------------------------------------------------------------
    def residents_lru(self) -> list[Key]:
        """Resident experts, least recently used first; ones never touched here come first of all (one pass)."""
        return self.books.residents_lru()

    def load_async(self, layer: int, expert: int, priority: Priority = Priority.NORMAL,
                   deadline_s: float | None = None) -> OpFuture:
        """Start loading an absent expert through the loader (refusals raise before anything changes)."""
        self._inflight = {k: f for k, f in self._inflight.items() if not f.done()}
        fut = self._loader(layer, expert).load(layer, expert, self.store, priority, deadline_s)
        self.books.own_binds += 1
        key = (layer, expert)
        self._inflight[key] = fut
        self._ahead.add(key)
        self.books.touch(key)  # asked for on purpose: as fresh as a use
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
        """Give a resident expert's slot back and forget its recency. The slot is free at once; whatever writes it
        next is ordered after its readers (the pool's I4), so this never waits for them."""
        self.pool.release(layer, expert)
        self.books.forget((layer, expert))

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0
