"""KV block books (inference process): which tier and index each block sits at, refcounts, checksums, moves.

Pure bookkeeping, modelled on vLLM v1 `kv_offload`'s manager: no bytes are touched here. A move is two
phases: `prepare_move` reserves the destination index and marks the block in flight; `complete_move(ok)`
either switches the block to the destination and frees the source index, or frees the destination and
leaves the block where it was. Readers hold a refcount (`acquire`/`release`); a block that is read or in
flight can be neither moved nor freed. Every refusal is decided before any state changes.
`set_limits` bounds the blocks a tier may hold below its capacity (the agent installs a plan's KV blocks
per tier): allocations and moves into a tier at its limit are refused and `num_free` counts only the room
under it, so whoever makes room spills instead of growing past it.
`epoch` counts location changes (completed moves, frees): a reader may keep the locations it looked up while it
stays the same. Thread-safe with one lock. Never moves bytes, never decides which block goes where.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from tierplan.runtime.errors import BusyError, CapacityError, ConfigError, DoubleFreeError, UnknownBlockError
from tierplan.runtime.kv.spec import KVBlockSpec, KVMove, Tier


@dataclass
class _Block:
    spec: KVBlockSpec
    refcount: int = 0
    move: KVMove | None = None
    checksum: int | None = None


def _check_capacity(capacity: dict[Tier, int]) -> dict[Tier, int]:
    """Every tier with its block count (0 = absent); ConfigError for a non-Tier key or a bad count."""
    out = dict.fromkeys(Tier, 0)
    for tier, n in capacity.items():
        if not isinstance(tier, Tier):
            raise ConfigError(f"capacity: key {tier!r} is not a Tier (expected one of {[t.value for t in Tier]})")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"capacity[{tier.value}]: expected an int >= 0 blocks, got {n!r}")
        out[tier] = n
    return out


class KVBlockManager:
    """Block table of the KV tiers: ids are never reused, indices are reserved before bytes move.

    `verify_tiers`: the tiers whose blocks are checked when they leave them, against the checksum of the bytes as
    they last reached the host bound for one of these tiers (the handler's `_check_host_bytes`). A tier not named
    is trusted while a block sits there: with the default (NVMe), a block spilled to the CPU is hashed only when it
    moves on to NVMe, so bytes that changed on the CPU before that are hashed as they are. Name the CPU too to
    check it (every spill to it is then hashed on the link's worker, ~34 us a 256 KiB block on the CI box)."""

    def __init__(self, capacity: dict[Tier, int], verify_tiers: frozenset[Tier] = frozenset({Tier.NVME})) -> None:
        self._capacity = _check_capacity(capacity)
        bad = [t for t in verify_tiers if not isinstance(t, Tier)]
        if bad:
            raise ConfigError(f"verify_tiers: {bad!r} are not Tiers (expected a frozenset of Tier)")
        self.verify_tiers = frozenset(verify_tiers)
        self._lock = threading.Lock()
        # Popped from the end, so the lowest index goes out first.
        self._free_indices = {t: list(range(n - 1, -1, -1)) for t, n in self._capacity.items()}
        self._blocks: dict[int, _Block] = {}
        self._next_id = itertools.count()
        self._num_ids = 0  # every id < _num_ids was handed out once; the ones not in _blocks were freed
        self._limits: dict[Tier, int] = {}  # set_limits: at most this many used indices; absent tier: capacity
        # Bumped whenever a block's location changes (a completed move) or a block goes (free): a reader that
        # cached locations while it held a value may reuse them until it changes (allocations move nothing).
        self.epoch = 0

    # ---- lookups (call with the lock held) ---------------------------------------------------------
    def _was_freed(self, block_id: object) -> bool:
        return isinstance(block_id, int) and not isinstance(block_id, bool) and 0 <= block_id < self._num_ids

    def _describe_missing(self, block_id: object) -> str:
        if self._was_freed(block_id):
            return f"KV block {block_id} was freed"
        return f"KV block {block_id!r} was never allocated (ids handed out: 0..{self._num_ids - 1})"

    def _get(self, block_id: int) -> _Block:
        blk = self._blocks.get(block_id) if isinstance(block_id, int) else None
        if blk is None:
            raise UnknownBlockError(self._describe_missing(block_id))
        return blk

    def _check_tier(self, tier: Tier, what: str) -> None:
        if not isinstance(tier, Tier):
            raise ConfigError(f"{what}: expected a Tier, got {tier!r}")
        if self._capacity[tier] == 0:
            raise ConfigError(f"{what}: tier {tier.value} has capacity 0 (absent in this manager)")

    def _room_locked(self, tier: Tier) -> int:
        """Indices a new block or move may take on `tier`: free ones, but none past the tier's limit."""
        free = len(self._free_indices[tier])
        limit = self._limits.get(tier)
        return free if limit is None else max(0, min(free, limit - (self._capacity[tier] - free)))

    def _full(self, tier: Tier) -> str:
        limit = self._limits.get(tier)
        if limit is not None and limit < self._capacity[tier]:
            return f"at its limit of {limit} blocks (set_limits: the applied plan; capacity {self._capacity[tier]})"
        return f"full ({self._capacity[tier]} of {self._capacity[tier]} indices used or reserved by moves)"

    # ---- limits -------------------------------------------------------------------------------------
    def set_limits(self, limits: dict[Tier, int] | None) -> None:
        """Replace the per-tier block limits (None or {} lifts them); ConfigError, changing nothing, for a
        non-Tier key or a count outside 0..capacity. Moves nothing: blocks over a new limit stay until moved."""
        new = dict(limits or {})
        for tier, n in new.items():
            if not isinstance(tier, Tier):
                raise ConfigError(f"set_limits: key {tier!r} is not a Tier (expected one of {[t.value for t in Tier]})")
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self._capacity[tier]:
                raise ConfigError(f"set_limits[{tier.value}]: expected an int in 0..{self._capacity[tier]} "
                                  f"(the tier's capacity), got {n!r}")
        with self._lock:
            self._limits = new

    def limits(self) -> dict[Tier, int]:
        """The limits `set_limits` installed (a copy: `set_limits` of it restores them)."""
        with self._lock:
            return dict(self._limits)

    def limit(self, tier: Tier) -> int:
        """The most blocks `tier` may hold now: its limit, else its capacity."""
        with self._lock:
            return self._limits.get(tier, self._capacity[tier])

    # ---- allocation ---------------------------------------------------------------------------------
    def allocate(self, tier: Tier) -> int:
        """A new block id with a reserved index on `tier` (no bytes, no checksum yet)."""
        with self._lock:
            self._check_tier(tier, "allocate")
            free = self._free_indices[tier]
            if not self._room_locked(tier):
                raise CapacityError(f"allocate: tier {tier.value} is {self._full(tier)}")
            block_id = next(self._next_id)
            self._num_ids = block_id + 1
            self._blocks[block_id] = _Block(KVBlockSpec(tier, free.pop()))
            return block_id

    def free(self, block_id: int) -> None:
        """Give the block's index back; refused while the block is read (refcount > 0) or in flight."""
        with self._lock:
            blk = self._blocks.get(block_id) if isinstance(block_id, int) else None
            if blk is None:
                if self._was_freed(block_id):
                    raise DoubleFreeError(f"free: KV block {block_id} was already freed")
                raise UnknownBlockError(f"free: {self._describe_missing(block_id)}")
            if blk.move is not None:
                raise BusyError(f"free: KV block {block_id} is moving {blk.move.src} -> {blk.move.dst}")
            if blk.refcount > 0:
                raise BusyError(f"free: KV block {block_id} is held by {blk.refcount} reader(s); expected 0")
            del self._blocks[block_id]
            self._free_indices[blk.spec.tier].append(blk.spec.index)
            self.epoch += 1

    # ---- readers ------------------------------------------------------------------------------------
    def acquire(self, block_id: int) -> None:
        """Hold the block where it is (no move, no free) until `release`; refused while it is in flight."""
        with self._lock:
            blk = self._get(block_id)
            if blk.move is not None:
                # The source index is freed when the move completes, so a reader could see it reused.
                raise BusyError(f"acquire: KV block {block_id} is moving {blk.move.src} -> {blk.move.dst}")
            blk.refcount += 1

    def release(self, block_id: int) -> None:
        with self._lock:
            blk = self._get(block_id)
            if blk.refcount == 0:
                raise ConfigError(f"release: KV block {block_id} has refcount 0; expected a matching acquire")
            blk.refcount -= 1

    def refcount(self, block_id: int) -> int:
        with self._lock:
            return self._get(block_id).refcount

    # ---- location and checksums ---------------------------------------------------------------------
    def location(self, block_id: int) -> KVBlockSpec:
        """Where the block's bytes are now (the source, while a move is in flight)."""
        with self._lock:
            return self._get(block_id).spec

    def locations(self, block_ids: list[int]) -> list[KVBlockSpec]:
        """`location` of each block, in order, under one lock: a step looks up every block of its batch (8,208
        at b8 16K on qwen3's 8 layers), where a lock and a call a block took ~10 ms a step on this project's CPU
        box. UnknownBlockError names the first unknown block."""
        with self._lock:
            blocks = self._blocks
            try:
                return [blocks[b].spec for b in block_ids]
            except (KeyError, TypeError):
                for b in block_ids:
                    self._get(b)  # raises for the first unknown one
                raise

    def is_moving(self, block_id: int) -> bool:
        with self._lock:
            return self._get(block_id).move is not None

    def checksum(self, block_id: int) -> int | None:
        """xxh3-64 of the block's bytes as last written or seen on the host; None when unknown."""
        with self._lock:
            return self._get(block_id).checksum

    def set_checksum(self, block_id: int, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"set_checksum: KV block {block_id}: expected an int or None, got {value!r}")
        with self._lock:
            self._get(block_id).checksum = value

    # ---- moves --------------------------------------------------------------------------------------
    def prepare_move(self, block_id: int, dst: Tier) -> KVMove:
        """Reserve an index on `dst` and mark the block in flight; the bytes are the caller's to move."""
        with self._lock:
            blk = self._get(block_id)
            self._check_tier(dst, f"prepare_move of KV block {block_id}")
            if blk.move is not None:
                raise BusyError(f"prepare_move: KV block {block_id} is already moving {blk.move.src} -> {blk.move.dst}")
            if blk.refcount > 0:
                raise BusyError(f"prepare_move: KV block {block_id} is held by {blk.refcount} reader(s); expected 0")
            if dst is blk.spec.tier:
                raise ConfigError(f"prepare_move: KV block {block_id} is already on {dst.value} ({blk.spec})")
            free = self._free_indices[dst]
            if not self._room_locked(dst):
                raise CapacityError(f"prepare_move: KV block {block_id} to {dst.value}: tier {self._full(dst)}")
            move = KVMove(block_id, blk.spec, KVBlockSpec(dst, free.pop()))
            blk.move = move
            return move

    def complete_move(self, move: KVMove, ok: bool) -> None:
        """ok: the block now sits at `move.dst`, the source index is freed; not ok: the reservation is undone."""
        if not isinstance(ok, bool):
            raise ConfigError(f"complete_move: ok must be a bool, got {ok!r}")
        with self._lock:
            blk = self._get(move.block_id)
            if blk.move is None:
                raise ConfigError(f"complete_move: KV block {move.block_id} has no move in flight (got {move})")
            if blk.move != move:
                raise BusyError(f"complete_move: KV block {move.block_id} is in flight as {blk.move}, not {move}")
            blk.move = None
            if ok:
                self._free_indices[move.src.tier].append(move.src.index)
                blk.spec = move.dst
                self.epoch += 1
            else:
                self._free_indices[move.dst.tier].append(move.dst.index)

    # ---- introspection ------------------------------------------------------------------------------
    @property
    def capacity(self) -> dict[Tier, int]:
        return dict(self._capacity)

    def num_free(self, tier: Tier) -> int:
        """Indices of `tier` neither holding a block nor reserved by a move, and under its limit (0 for an absent
        tier)."""
        with self._lock:
            return self._room_locked(tier)

    def num_used(self, tier: Tier) -> int:
        with self._lock:
            return self._capacity[tier] - len(self._free_indices[tier])

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier: capacity, used (= blocks + reserved), free, blocks sitting there, reserved by moves in."""
        with self._lock:
            out = {}
            for tier, cap in self._capacity.items():
                blocks = sum(1 for b in self._blocks.values() if b.spec.tier is tier)
                reserved = sum(1 for b in self._blocks.values() if b.move is not None and b.move.dst.tier is tier)
                free = len(self._free_indices[tier])
                out[tier.value] = {
                    "capacity": cap,
                    "used": cap - free,
                    "free": free,
                    "blocks": blocks,
                    "reserved": reserved,
                }
            return out

    def blocks(self) -> list[int]:
        """Ids of the live blocks, oldest first."""
        with self._lock:
            return sorted(self._blocks)
