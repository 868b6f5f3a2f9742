"""The books of the vLLM KV connector: which prefix hash sits on which of our tiers (vLLM scheduler process).

`KvCatalog` decides, for each full KV block vLLM computed, whether and where the connector keeps it (pinned CPU
first, then the NVMe file) within the plan's blocks per tier, and what makes room: the victim on a full tier is
the block the KV reuse predictor wants least (not in `retention`, least recently used first; then `retention`
from its end), moved one tier down or dropped. An incoming block that ranks below every block of a full tier goes
one tier down itself, or is not kept, so a retained block never makes way for a less wanted one. Every decision is
returned as an ordered list of `TierOp`s for the worker to carry out (`connector_worker.py`); the footprint after
each op is within the limits. Pure bookkeeping: never touches bytes, torch or vLLM objects.
"""

from __future__ import annotations

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
    last_use: int


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

    def __init__(self, capacity: dict[Tier, int]) -> None:
        self.capacity = {t: _check_limit(f"capacity[{t.value}]", capacity.get(t, 0)) for t in STORE_TIERS}
        self._limits = dict(self.capacity)
        self._rank: dict[str, int] = {}  # retention position: 0 = keep first
        self._entries: dict[str, _Entry] = {}
        self._count = dict.fromkeys(STORE_TIERS, 0)
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
        """The blocks on `tier`, the first to make way first."""
        return sorted(self.keys_on(tier), key=self._victim_key)

    def set_limits(self, cpu_blocks: int, nvme_blocks: int, retention: tuple[str, ...] = ()) -> list[TierOp]:
        """Install a plan's blocks per tier (held at the capacity) and keep-first order; the ops that bring the
        footprint within them (moves down, then drops), in the order to carry them out."""
        asked = {Tier.CPU: _check_limit("cpu_blocks", cpu_blocks), Tier.NVME: _check_limit("nvme_blocks", nvme_blocks)}
        for tier, n in asked.items():
            if n > self.capacity[tier]:
                self.stats.limits_clamped += 1
            self._limits[tier] = min(n, self.capacity[tier])
        self._rank = {key: i for i, key in enumerate(retention)}
        ops: list[TierOp] = []
        while self._count[Tier.NVME] > self._limits[Tier.NVME]:
            self._drop(self.victim_order(Tier.NVME)[0], ops)
        while self._count[Tier.CPU] > self._limits[Tier.CPU]:
            victim = self.victim_order(Tier.CPU)[0]
            if not self._place_below(victim, Tier.CPU, ops):
                self._drop(victim, ops)
        return ops

    def touch(self, keys: list[str]) -> None:
        """These blocks were used now (a prefix hit): they go last in least-recent-use order."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                self._clock += 1
                entry.last_use = self._clock

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

    def forget(self, key: str) -> None:
        """The worker does not hold this block (a store or move failed): remove it from the books."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._count[entry.tier] -= 1
            self.stats.forgotten += 1

    # ---- placement ----------------------------------------------------------------------------------
    def _place(self, key: str, tiers: tuple[Tier, ...], ops: list[TierOp]) -> bool:
        """Store the incoming `key` on the first of `tiers` that takes it."""
        for tier in tiers:
            if not self._limits[tier]:
                continue
            if self._count[tier] >= self._limits[tier]:
                victim = min(self.keys_on(tier), key=self._victim_key)
                if self._victim_key(key) <= self._victim_key(victim):
                    continue  # the incoming block is the one least wanted here: try the tier below
                if not self._place_below(victim, tier, ops):
                    self._drop(victim, ops)
            self._clock += 1
            self._entries[key] = _Entry(tier, self._clock)
            self._count[tier] += 1
            self.stats.stored += 1
            ops.append(TierOp(OpKind.STORE, key, tier))
            return True
        return False

    def _place_below(self, key: str, tier: Tier, ops: list[TierOp]) -> bool:
        """Move the stored `key` from `tier` down to the next tier with room (making room there by the same
        order); False if no tier below takes it."""
        below = STORE_TIERS[STORE_TIERS.index(tier) + 1:]
        for dst in below:
            if not self._limits[dst]:
                continue
            if self._count[dst] >= self._limits[dst]:
                victim = min(self.keys_on(dst), key=self._victim_key)
                if self._victim_key(key) <= self._victim_key(victim):
                    continue
                if not self._place_below(victim, dst, ops):
                    self._drop(victim, ops)
            entry = self._entries[key]
            self._count[entry.tier] -= 1
            entry.tier = dst
            self._count[dst] += 1
            self.stats.moved += 1
            ops.append(TierOp(OpKind.MOVE, key, dst))
            return True
        return False

    def _drop(self, key: str, ops: list[TierOp]) -> None:
        entry = self._entries.pop(key)
        self._count[entry.tier] -= 1
        self.stats.dropped += 1
        ops.append(TierOp(OpKind.DROP, key, entry.tier))
