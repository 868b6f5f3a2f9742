"""The recency books of the expert residency and its index of ranked victims (inference process, engine thread).

`OnDemandExperts` (experts.py) keeps here every expert it tracks, least recently used first, each with the
tick of its last use, so two experts' recency compares in O(1). A victim order that ranks by a rank of its
own (`VictimRanks`, victims.py: the agent's plan order) is served from one lazy heap per layer ordered by
(rank, recency): a query pops the victims it returns and the candidates it skips, then puts them back, instead
of listing and sorting every resident per list (H200 phase runs 08 and 10: that cost 0.16 ms a miss on the
engine thread, LRU's walk from the books' oldest end 0.02 ms).

The heaps are lazy. A use only moves the tick (nothing is pushed): an entry whose tick is older than its
expert's sorts too early, so when it surfaces it is pushed again with the current tick and sinks to its
place; an entry that surfaces with a current tick is therefore the true minimum. Entries of experts the
books forgot are dropped when they surface; the heaps are rebuilt when the ranks change (`rank_version`) or
when dead entries outnumber live ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator

from tierplan.runtime.engine.victims import Key, VictimRanks
from tierplan.runtime.memory.slots import ExpertSlotPool, ExpertState

Entry = tuple[int, float, float, Key]  # (unranked, rank or tick, tick, key): ranked ones first, then by recency


class RecencyBooks:
    """Tracked experts of `pool` in least-recently-used order (`lru`: key -> tick of its last use), and, while
    ranks are plugged, the heaps that rank them. Experts loaded around the residency are tracked too."""

    def __init__(self, pool: ExpertSlotPool) -> None:
        self.pool = pool
        self.own_binds = 0  # slot bindings made by the residency's own loads (the rest were made around it)
        self._around_seen = -1
        num_layers = pool.layout.num_layers
        self.lru: OrderedDict[Key, float] = OrderedDict()  # least recently used first
        self._next_tick = 0  # a use gets the next (largest) tick
        self._around_batches = 0  # batches of experts found loaded around the residency (track_loads_around)
        self._ranks: VictimRanks | None = None
        self._version: int | None = None  # the rank_version the heaps were built for (None: build before use)
        self._heaps: list[list[Entry]] = [[] for _ in range(num_layers)]
        self._entry_tick: dict[Key, float] = {}  # each tracked key's newest heap entry (older ones are dead)
        self._num_entries = 0

    def touch(self, key: Key) -> None:
        """`key` was used, or loaded on purpose: it becomes the most recently used."""
        new = key not in self.lru
        self.lru[key] = self._next_tick
        self.lru.move_to_end(key)
        self._next_tick += 1
        if new and self._ranks is not None:
            self._push(key)

    def forget(self, key: Key) -> None:
        self.lru.pop(key, None)
        self._entry_tick.pop(key, None)

    def track_loads_around(self) -> None:
        """Experts loaded around the residency (noticed by the pool's count of slot bindings) enter the books as
        the least recently used, ordered by key among every such expert not used since: as the full ranking,
        over `residents_lru`, ranks experts never tracked, so it and the index pick the same victims."""
        around = self.pool.remaps - self.own_binds
        if around == self._around_seen:
            return
        self._around_seen = around
        new = [k for k in self.residents_lru() if k not in self.lru]
        if not new:
            return
        self._around_batches += 1
        num_experts = self.pool.layout.num_experts
        below = self.pool.layout.num_layers * num_experts  # keeps every such tick under 0, the first use's
        for k in new:  # by key, then by batch (unique: an older heap entry of a key re-entered is dead)
            self.lru[k] = k[0] * num_experts + k[1] - below - self._around_batches * 1e-9
            if self._ranks is not None:
                self._push(k)
        for _, k in sorted(((t, k) for k, t in self.lru.items() if t < 0), reverse=True):
            self.lru.move_to_end(k, last=False)

    def residents_lru(self) -> list[Key]:
        """Resident experts, least recently used first; ones never tracked come first of all (one pass)."""
        pool = self.pool
        resident = {(layer, e) for layer in range(pool.layout.num_layers) for e in pool.resident_experts(layer)}
        for k in [k for k in self.lru if k not in resident]:
            if pool.state(*k) is ExpertState.ABSENT:  # unmapped around us: forget it
                self.forget(k)
        tracked = [k for k in self.lru if k in resident]
        if len(tracked) == len(resident):
            return tracked  # every resident is accounted for: nothing was loaded around us
        # Never tracked ones and those tracked as loaded around (ticks under 0) share one order, by key.
        head = resident - set(tracked) | {k for k in tracked if self.lru[k] < 0}
        return sorted(head) + [k for k in tracked if self.lru[k] >= 0]

    def plug(self, ranks: VictimRanks | None) -> None:
        """Rank victims by `ranks` from now on (None: no heaps are kept)."""
        self._ranks, self._version = ranks, None
        self._heaps = [[] for _ in self._heaps]
        self._entry_tick, self._num_entries = {}, 0

    def _entry(self, key: Key) -> Entry:
        tick = self.lru[key]
        rank = self._ranks.rank_of(key) if self._ranks is not None else None
        return (0, rank, tick, key) if rank is not None else (1, tick, tick, key)

    def _push(self, key: Key) -> None:
        entry = self._entry(key)
        heapq.heappush(self._heaps[key[0]], entry)
        self._entry_tick[key] = entry[2]
        self._num_entries += 1

    def _rebuild(self, version: int) -> None:
        self._heaps = [[] for _ in self._heaps]
        self._entry_tick = {}
        for key in self.lru:
            entry = self._entry(key)
            self._heaps[key[0]].append(entry)
            self._entry_tick[key] = entry[2]
        for heap in self._heaps:
            heapq.heapify(heap)
        self._num_entries, self._version = len(self.lru), version

    def ranked(self, num: int, eligible: Callable[[Key], bool], layer: int | None = None) -> list[Key]:
        """The first `num` experts `eligible` accepts, in (rank, recency) order, of `layer` only when given
        (fewer when the eligible ones run out). Nothing is removed: the caller evicts through `forget`."""
        if self._ranks is None:
            raise RuntimeError("RecencyBooks.ranked needs plugged ranks (plug)")
        if num <= 0:
            return []
        version = self._ranks.rank_version
        if version != self._version or self._num_entries > 2 * len(self.lru) + 64:
            self._rebuild(version)
        popped: list[Entry] = []
        try:
            layers = range(len(self._heaps)) if layer is None else (layer,)
            walks = [self._walk(lyr, eligible, popped) for lyr in layers]
            return [entry[3] for entry in itertools.islice(heapq.merge(*walks), num)]
        finally:
            for entry in popped:  # the victims too: their entries die when the caller forgets them
                heapq.heappush(self._heaps[entry[3][0]], entry)
            self._num_entries += len(popped)

    def _walk(self, layer: int, eligible: Callable[[Key], bool], popped: list[Entry]) -> Iterator[Entry]:
        """`layer`'s live entries in order, those `eligible` accepts yielded; every live one popped is listed in
        `popped` (to be put back)."""
        heap = self._heaps[layer]
        while heap:
            entry = heapq.heappop(heap)
            self._num_entries -= 1
            key, tick = entry[3], entry[2]
            if self._entry_tick.get(key) != tick:
                continue  # forgotten, or a newer entry of the key is in the heap
            if self.lru[key] != tick:  # used since it was pushed: it belongs further down
                self._push(key)
                continue
            popped.append(entry)
            if eligible(key):
                yield entry
