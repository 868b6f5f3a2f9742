"""The books of the vLLM KV connector: which prefix hash sits on which of our tiers (vLLM scheduler process).

`KvCatalog` decides, for each full KV block vLLM computed, whether and where the connector keeps it (pinned CPU
first, then the NVMe file) within the plan's blocks per tier, and what makes room: the victim on a full tier is
the block the KV reuse predictor wants least (not in `retention`, least recently used first; then `retention`
from its end), moved one tier down or dropped. An incoming block that ranks below every block of a full tier goes
one tier down itself, or is not kept, so a retained block never makes way for a less wanted one. Every decision is
returned as an ordered list of `TierOp`s for the worker to carry out (`connector_worker.py`); the footprint after
each op is within the limits. Finding a victim costs O(log n) (a heap of last uses per tier, stale items skipped)
plus the retained blocks of the tier. Pure bookkeeping: never touches bytes, torch or vLLM objects.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from tierplan.runtime.kv.spec import Tier

STORE_TIERS = (Tier.CPU, Tier.NVME)  # the tiers the connector keeps blocks on, nearest first


class OpKind(Enum):
    STORE = "store"  # copy the block from vLLM's cache into `tier`
    MOVE = "move"  # move the stored block down to `tier`
    DROP = "drop"  # forget the stored block (it sat on `tier`)


@dataclass(frozen=True)
class TierOp:
    kind: OpKind
    key: str
    tier: Tier


@dataclass
class _Entry:
    tier: Tier
    last_use: int  # the catalog's logical clock: orders uses exactly
    used_s: float  # the clock's time of that use: the age a reuse event reports


@dataclass
class CatalogStats:
    stored: int = 0
    moved: int = 0
    dropped: int = 0
    not_kept: int = 0  # incoming blocks ranked below everything on every tier with room for none
    forgotten: int = 0  # entries the worker could not carry out (its failures), removed from the books
    limits_clamped: int = 0  # plan limits above a tier's capacity, held at the capacity


def _check_limit(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"KvCatalog: {name} must be an int >= 0 blocks, got {value!r}")
    return value


class KvCatalog:
    """Prefix hash -> tier for the connector's stored blocks; see the module docstring."""

    def __init__(self, capacity: dict[Tier, int], clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.capacity = {t: _check_limit(f"capacity[{t.value}]", capacity.get(t, 0)) for t in STORE_TIERS}
        self._limits = dict(self.capacity)
        self._asked: tuple[int, int] | None = None
        self._retention: tuple[str, ...] = ()
        self._rank: dict[str, int] = {}  # retention position: 0 = keep first
        self._entries: dict[str, _Entry] = {}
        self._count = dict.fromkeys(STORE_TIERS, 0)
        # Per tier: (last_use, key) of its blocks not retained, stale items left in until they reach the top.
        self._heap: dict[Tier, list[tuple[int, str]]] = {t: [] for t in STORE_TIERS}
        self._kept: dict[Tier, set[str]] = {t: set() for t in STORE_TIERS}  # its retained blocks
        self._clock = 0
        self.stats = CatalogStats()

    # ---- lookups ------------------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def tier_of(self, key: str) -> Tier | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.tier

    def lookup(self, keys: list[str]) -> list[Tier]:
        """The tiers of the leading run of `keys` held here (stops at the first one missing); changes nothing."""
        out = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            out.append(entry.tier)
        return out

    def footprint(self) -> dict[Tier, int]:
        return dict(self._count)

    @property
    def limits(self) -> dict[Tier, int]:
        return dict(self._limits)

    def keys_on(self, tier: Tier) -> list[str]:
        return [k for k, e in self._entries.items() if e.tier is tier]

    # ---- policy -------------------------------------------------------------------------------------
    def _victim_key(self, key: str) -> tuple[int, int]:
        """Sort key, first victim first: not retained by least recent use, then retained from the list's end."""
        rank = self._rank.get(key)
        if rank is None:
            entry = self._entries.get(key)
            return (0, entry.last_use if entry is not None else self._clock + 1)  # an incoming key is the newest
        return (1, -rank)

    def victim_order(self, tier: Tier) -> list[str]:
        """The blocks on `tier`, the first to make way first (O(n log n): for reports and tests)."""
        return sorted(self.keys_on(tier), key=self._victim_key)

    def _victim(self, tier: Tier) -> str:
        """The first block of `tier` to make way (the tier holds at least one)."""
        heap = self._heap[tier]
        while heap:
            last_use, key = heap[0]
            entry = self._entries.get(key)
            if entry is not None and entry.tier is tier and entry.last_use == last_use and key not in self._rank:
                return key
            heapq.heappop(heap)
        return max(self._kept[tier], key=self._rank.__getitem__)

    def _index(self, key: str, entry: _Entry) -> None:
        if key in self._rank:
            self._kept[entry.tier].add(key)
            return
        heap = self._heap[entry.tier]
        heapq.heappush(heap, (entry.last_use, key))
        if len(heap) > 2 * self._count[entry.tier] + 64:  # too many stale items: rebuild from the live ones
            self._heap[entry.tier] = [(e.last_use, k) for k, e in self._entries.items()
                                      if e.tier is entry.tier and k not in self._rank]
            heapq.heapify(self._heap[entry.tier])

    def _reindex(self) -> None:
        self._heap = {t: [] for t in STORE_TIERS}
        self._kept = {t: set() for t in STORE_TIERS}
        for key, entry in self._entries.items():
            if key in self._rank:
                self._kept[entry.tier].add(key)
            else:
                self._heap[entry.tier].append((entry.last_use, key))
        for heap in self._heap.values():
            heapq.heapify(heap)

    def set_limits(self, cpu_blocks: int, nvme_blocks: int, retention: tuple[str, ...] = ()) -> list[TierOp]:
        """Install a plan's blocks per tier (held at the capacity) and keep-first order; the ops that bring the
        footprint within them (moves down, then drops), in the order to carry them out."""
        asked = {Tier.CPU: _check_limit("cpu_blocks", cpu_blocks), Tier.NVME: _check_limit("nvme_blocks", nvme_blocks)}
        if self._asked != (cpu_blocks, nvme_blocks):  # counted once per new limits, not once per step
            self._asked = (cpu_blocks, nvme_blocks)
            self.stats.limits_clamped += sum(n > self.capacity[t] for t, n in asked.items())
        for tier, n in asked.items():
            self._limits[tier] = min(n, self.capacity[tier])
        if tuple(retention) != self._retention:
            self._retention = tuple(retention)
            self._rank = {key: i for i, key in enumerate(self._retention)}
            self._reindex()
        ops: list[TierOp] = []
        while self._count[Tier.NVME] > self._limits[Tier.NVME]:
            self._drop(self._victim(Tier.NVME), ops)
        while self._count[Tier.CPU] > self._limits[Tier.CPU]:
            victim = self._victim(Tier.CPU)
            if not self._place_below(victim, Tier.CPU, ops):
                self._drop(victim, ops)
        return ops

    def touch(self, keys: list[str]) -> list[tuple[str, float, Tier]]:
        """These blocks were used now (a prefix hit): they go last in least-recent-use order. Returns, per block
        held, (key, seconds since its previous use, its tier): the reuse events of the KV reuse predictor."""
        now_s, events = self.clock(), []
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                events.append((key, max(0.0, now_s - entry.used_s), entry.tier))
                self._clock += 1
                entry.last_use, entry.used_s = self._clock, now_s
                self._index(key, entry)
        return events

    def admit(self, key: str) -> list[TierOp]:
        """Keep a block vLLM just computed: the ops that place it (and make room), or [] if it is not kept (or
        already held: then it is touched)."""
        if key in self._entries:
            self.touch([key])
            return []
        ops: list[TierOp] = []
        if not self._place(key, STORE_TIERS, ops):
            self.stats.not_kept += 1
        return ops

    def clear(self) -> list[TierOp]:
        """Forget every block (vLLM's reset of the prefix cache): the drops for the worker, in one list."""
        ops: list[TierOp] = []
        for key in list(self._entries):
            self._drop(key, ops)
        self._heap = {t: [] for t in STORE_TIERS}
        return ops

    def forget(self, key: str) -> Tier | None:
        """A worker does not hold this block (a store, move or load failed): remove it from the books; the tier it
        was booked on, or None if it was not."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._count[entry.tier] -= 1
        self._kept[entry.tier].discard(key)
        self.stats.forgotten += 1
        return entry.tier

    # ---- placement ----------------------------------------------------------------------------------
    def _room_for(self, key: str, tier: Tier, ops: list[TierOp]) -> bool:
        """Make room on `tier` for `key` (incoming or moving down) unless `key` is the block least wanted there."""
        if not self._limits[tier]:
            return False
        if self._count[tier] < self._limits[tier]:
            return True
        victim = self._victim(tier)
        if self._victim_key(key) <= self._victim_key(victim):
            return False  # `key` is the one least wanted here: try the tier below
        if not self._place_below(victim, tier, ops):
            self._drop(victim, ops)
        return True

    def _place(self, key: str, tiers: tuple[Tier, ...], ops: list[TierOp]) -> bool:
        """Store the incoming `key` on the first of `tiers` that takes it."""
        for tier in tiers:
            if not self._room_for(key, tier, ops):
                continue
            self._clock += 1
            entry = self._entries[key] = _Entry(tier, self._clock, self.clock())
            self._count[tier] += 1
            self._index(key, entry)
            self.stats.stored += 1
            ops.append(TierOp(OpKind.STORE, key, tier))
            return True
        return False

    def _place_below(self, key: str, tier: Tier, ops: list[TierOp]) -> bool:
        """Move the stored `key` from `tier` down to the next tier that takes it (making room there by the same
        order); False if none does."""
        for dst in STORE_TIERS[STORE_TIERS.index(tier) + 1:]:
            if not self._room_for(key, dst, ops):
                continue
            entry = self._entries[key]
            self._count[entry.tier] -= 1
            self._kept[entry.tier].discard(key)
            entry.tier = dst
            self._count[dst] += 1
            self._index(key, entry)
            self.stats.moved += 1
            ops.append(TierOp(OpKind.MOVE, key, dst))
            return True
        return False

    def _drop(self, key: str, ops: list[TierOp]) -> None:
        entry = self._entries.pop(key)
        self._count[entry.tier] -= 1
        self._kept[entry.tier].discard(key)
        self.stats.dropped += 1
        ops.append(TierOp(OpKind.DROP, key, entry.tier))
