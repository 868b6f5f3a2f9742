"""Paged KV cache of the reference engine over the three KV tiers (inference process).

One block holds every layer's K and V for `block_tokens` tokens (GQA: [L, 2, T, Hkv, D]; MLA: the
compressed latent [L, T, R + P]), so one block id names one unit of placement. Kernels only read blocks on
the GPU tier: before a step, `ensure_seqs_on_gpu` brings the batch's blocks back (spilling idle blocks GPU -> CPU
-> NVMe to make room). Each sequence's GPU indices (`gpu_rows`) are kept between steps while no block moved or went
(the manager's `epoch`), so a decode step looks up only its new blocks: every block of the batch was looked up
twice a step, and the H100's decode steps took ~0.5 us of host time per block of context (phase runs 64-68, steps
with graph_gpu_ms). Moving bytes is the KV handler's job; which blocks to spill is a policy passed in
(`victim_order`, which the agent plugs in with `set_victim_order`; by default the oldest block first), never
decided here beyond "not in use by this step". A step's missing blocks are fetched as one list: room made for
all of them, every move issued, then waited for together.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from tierplan.runtime.device import Device
from tierplan.runtime.engine.config import AttentionKind, ModelSpec
from tierplan.runtime.errors import CapacityError, ConfigError
from tierplan.runtime.future import wait_every
from tierplan.runtime.kv import KVBlockManager, KVTierStores, KVTransferHandler, Tier
from tierplan.runtime.nvme import DIRECT_ALIGN_BYTES
from tierplan.runtime.staging import StagingPool
from tierplan.runtime.transfer import TransferEngine
from tierplan.runtime.weights.format import dtype_from_name

SPILL_ORDER = (Tier.GPU, Tier.CPU, Tier.NVME)
BlockOrder = Callable[[list[int]], list[int]]  # candidate blocks -> the same blocks, first to spill first


def oldest_first(blocks: list[int]) -> list[int]:
    """The default ranking: blocks in the manager's order (allocation order)."""
    return blocks


def block_shape(spec: ModelSpec, block_tokens: int) -> tuple[int, ...]:
    if spec.attention is AttentionKind.MLA:
        return (spec.num_layers, block_tokens, spec.kv_lora_rank + spec.qk_rope_head_dim)
    return (spec.num_layers, 2, block_tokens, spec.num_kv_heads, spec.head_dim)


class PagedKVCache:
    """Block tables per sequence over `KVTierStores`; see the module docstring."""

    def __init__(self, spec: ModelSpec, device: Device, engine: TransferEngine, block_tokens: int,
                 capacity: dict[Tier, int], nvme_path: str | os.PathLike[str] | None = None,
                 staging: StagingPool | None = None) -> None:
        self.spec, self.device, self.block_tokens = spec, device, block_tokens
        self.dtype = dtype_from_name(spec.dtype)
        self.shape = block_shape(spec, block_tokens)
        self.block_bytes = math.prod(self.shape) * self.dtype.itemsize
        if self.block_bytes % DIRECT_ALIGN_BYTES:
            raise ConfigError(
                f"KV block of {block_tokens} tokens is {self.block_bytes} bytes for {spec.name}; it must be a "
                f"multiple of {DIRECT_ALIGN_BYTES} (O_DIRECT): choose another block_tokens"
            )
        if capacity.get(Tier.GPU, 0) <= 0:
            raise ConfigError("PagedKVCache needs GPU-tier capacity > 0")
        # One scratch GPU block past the capacity: padding rows of a CUDA-graph batch write their K/V there.
        self.stores = KVTierStores(device, self.block_bytes, capacity, nvme_path, gpu_scratch_blocks=1)
        self.manager = KVBlockManager(capacity)
        self.handler = KVTransferHandler(self.manager, self.stores, engine, staging=staging)  # shared, or its own
        self.scratch_slot = capacity[Tier.GPU]  # GPU index of the scratch block (no sequence ever owns it)
        self.gpu = self.stores.gpu_tensor.view(self.dtype).view(capacity[Tier.GPU] + 1, *self.shape)  # [N+1, *block]
        self.tables: dict[int, list[int]] = {}
        self.spills = 0
        self.fetches = 0
        self.gpu_hits = 0  # blocks a step needed that were already on the GPU
        self.misses_by_tier = {Tier.CPU: 0, Tier.NVME: 0}  # blocks fetched back, by where they were
        self.fetch_s = 0.0  # time steps spent waiting for fetched blocks (the KV-miss stall)
        self.victim_order: BlockOrder = oldest_first
        # GPU indices of each sequence's first len(row) blocks, valid while the manager's epoch is `_rows_epoch`
        # (tables only grow at their end; a sequence's blocks go only with it, which bumps the epoch).
        self._rows: dict[int, np.ndarray] = {}
        self._rows_epoch = -1

    def set_victim_order(self, fn: BlockOrder | None) -> None:
        """Plug a spill ranking in (the agent's policy); None restores oldest-first."""
        self.victim_order = fn or oldest_first

    # ---- bookkeeping ------------------------------------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)

    def blocks_of(self, seq_id: int) -> list[int]:
        return self.tables.get(seq_id, [])

    def touch(self, seq_id: int) -> None:
        """The sequence (re)joins the running batch now (a swap-in): it ranks newest in `newest_sequences_first`,
        as it sits last in the scheduler's running list, the first to be preempted."""
        if seq_id in self.tables:
            self.tables[seq_id] = self.tables.pop(seq_id)

    def newest_sequences_first(self, blocks: list[int]) -> list[int]:
        """`blocks` in the order a cut of the GPU share should spill them: those no sequence holds, then the
        blocks of the sequence that started (or was swapped back in: `touch`) last, whole sequences at a time.
        The scheduler preempts the newest running sequence first, so a plan's spill in this order takes the
        blocks its next preemptions park anyway; oldest first took those of sequences that kept running, and the
        next step fetched them back (H100 run 47, b128 16K 40 GiB: 2,075 blocks spilled at the plan change,
        1,758 fetched back at the next step)."""
        rank = {b: r for r, seq in enumerate(reversed(self.tables)) for b in self.tables[seq]}
        return sorted(blocks, key=lambda b: rank.get(b, -1))

    def tier_usage(self) -> dict[str, int]:
        return {t.value: self.manager.num_used(t) for t in Tier}

    def _make_room(self, tier: Tier, protect: set[int], victim_order: BlockOrder | None = None, n: int = 1) -> None:
        """Free `n` slots on `tier` by pushing unprotected blocks one tier down (recursively), moved together."""
        short = n - self.manager.num_free(tier)
        if short <= 0:
            return
        nxt = SPILL_ORDER.index(tier) + 1
        if nxt >= len(SPILL_ORDER):
            raise CapacityError(f"KV tiers full: no room on {tier.value} and no tier below it")
        down = SPILL_ORDER[nxt]
        here = [b for b in self.manager.blocks() if b not in protect and self.manager.location(b).tier is tier]
        if len(here) < short:
            raise CapacityError(f"KV tier {tier.value} is full of blocks this step needs ({len(protect)} protected)")
        self._make_room(down, protect, victim_order, short)
        victims = (victim_order or self.victim_order)(here)[:short]
        self._move_all(victims, down)
        self.spills += len(victims)

    def _move_all(self, blocks: list[int], dst: Tier) -> None:
        """Issue every move (one request per memory pair: `move_list`), then wait for all (`wait_every`: the
        first error in list order re-raised once all have ended, each failed block staying where it was)."""
        wait_every(self.handler.move_list(blocks, dst))

    # ---- what the engine calls --------------------------------------------------------------------
    def grow(self, seq_id: int, num_tokens: int, protect: Iterable[int] = (),
             victim_order: BlockOrder | None = None) -> None:
        """Give the sequence enough blocks for `num_tokens` tokens; new blocks are allocated on the GPU."""
        table = self.tables.setdefault(seq_id, [])
        if not self.needs_blocks(seq_id, num_tokens):
            return  # most decode steps: no set of the step's blocks built per sequence (8,000 at b8 16K)
        keep = set(protect) | set(table)
        while len(table) < self.num_blocks_for(num_tokens):
            self._make_room(Tier.GPU, keep, victim_order)
            b = self.manager.allocate(Tier.GPU)
            table.append(b)
            keep.add(b)

    def needs_blocks(self, seq_id: int, num_tokens: int) -> bool:
        """Whether `grow(seq_id, num_tokens)` would allocate (most decode steps: no)."""
        return len(self.blocks_of(seq_id)) < self.num_blocks_for(num_tokens)

    def _known_rows(self) -> dict[int, np.ndarray]:
        """The cached rows, emptied first if a block moved or went since they were looked up."""
        epoch = self.manager.epoch  # read before any lookup: a move completing meanwhile shows at the next call
        if epoch != self._rows_epoch:
            self._rows, self._rows_epoch = {}, epoch
        return self._rows

    def _cached(self, rows: dict[int, np.ndarray], seq_id: int, num_blocks: int) -> int:
        """How many leading blocks of the sequence's table `rows` holds (a row longer than the table, which no
        path makes, is dropped: looked up again whole)."""
        row = rows.get(seq_id)
        if row is not None and len(row) > num_blocks:
            del rows[seq_id]
            return 0
        return 0 if row is None else len(row)

    @staticmethod
    def _extend(rows: dict[int, np.ndarray], seq_id: int, have: int, indices: list[int]) -> None:
        """The sequence's kept row, of `have` leading blocks, followed by these blocks' GPU indices."""
        new = np.asarray(indices, dtype=np.int32)
        rows[seq_id] = np.concatenate((rows[seq_id], new)) if have else new

    def ensure_seqs_on_gpu(self, seq_ids: list[int], victim_order: BlockOrder | None = None) -> None:
        """`ensure_on_gpu` over every block of these sequences, looking up only those no cached row holds (on the
        GPU since the last move) and caching what it finds; one elsewhere: the whole list through `ensure_on_gpu`."""
        rows = self._known_rows()
        tables = [self.blocks_of(s) for s in seq_ids]
        have = [self._cached(rows, s, len(t)) for s, t in zip(seq_ids, tables, strict=True)]
        locs = self.manager.locations([b for t, n in zip(tables, have, strict=True) for b in t[n:]])
        gpu = Tier.GPU
        if not all(loc.tier is gpu for loc in locs):
            self.ensure_on_gpu([b for t in tables for b in t], victim_order)
            return
        self.gpu_hits += sum(len(t) for t in tables)
        at = 0
        for s, t, n in zip(seq_ids, tables, have, strict=True):
            if len(t) > n:
                self._extend(rows, s, n, [loc.index for loc in locs[at : at + len(t) - n]])
                at += len(t) - n

    def gpu_rows(self, seq_ids: list[int]) -> list[np.ndarray]:
        """`gpu_indices` of each sequence as int32 arrays, kept between calls while no block moves or goes (the rows
        handed out are the cache's: read them, never write them)."""
        rows = self._known_rows()
        out = []
        for s in seq_ids:
            blocks = self.blocks_of(s)
            n = self._cached(rows, s, len(blocks))
            if n < len(blocks):
                self._extend(rows, s, n, self._indices(s, blocks[n:]))
            out.append(rows[s] if blocks else np.zeros(0, dtype=np.int32))
        return out

    def ensure_on_gpu(self, block_ids: Iterable[int], victim_order: BlockOrder | None = None) -> None:
        """Bring every listed block to the GPU tier (kernels read only there), the missing ones as one list."""
        need = list(block_ids)
        t0 = time.perf_counter()
        gpu = Tier.GPU  # a local: an enum member read through its class costs ~0.3 us, thousands of times a step
        locs = self.manager.locations(need)
        if all(loc.tier is gpu for loc in locs):
            self.gpu_hits += len(need)
            return
        missing = []
        for b, loc in zip(need, locs, strict=True):
            if loc.tier is not gpu:
                self.misses_by_tier[loc.tier] += 1
                missing.append(b)
        self.gpu_hits += len(need) - len(missing)
        protect = set(need)
        self._make_room(Tier.GPU, protect, victim_order, len(missing))
        self._move_all(missing, Tier.GPU)
        self.fetches += len(missing)
        self.fetch_s += time.perf_counter() - t0

    def spill(self, block_ids: Iterable[int], tier: Tier) -> None:
        """Move blocks to `tier` now (a plan's, a preemption's or a test's decision), as one list like a step's
        fetches: room made for all, every move issued, then waited for together. One move at a time paid the
        whole submit -> copy -> retire -> wake round trip per block (0.17-0.50 ms a block on the H100/H200 hosts
        where a plan change spilled ~1,000: bench/results/phase_h200.md); issued together they overlap. A block
        that fails stays where it was; the others still move, and the first error is raised once all have ended."""
        blocks = [b for b in dict.fromkeys(block_ids) if self.manager.location(b).tier is not tier]
        if not blocks:
            return
        self._make_room(tier, set(blocks), n=len(blocks))
        try:
            self._move_all(blocks, tier)
        finally:
            self.spills += sum(self.manager.location(b).tier is tier for b in blocks)

    def gpu_indices(self, seq_id: int) -> list[int]:
        """GPU-tier indices of the sequence's blocks, in order (all must be on the GPU: kernels read only there)."""
        return self._indices(seq_id, self.blocks_of(seq_id))

    def _indices(self, seq_id: int, blocks: list[int]) -> list[int]:
        locs, gpu = self.manager.locations(blocks), Tier.GPU
        if any(loc.tier is not gpu for loc in locs):
            b, loc = next((b, loc) for b, loc in zip(blocks, locs, strict=True) if loc.tier is not gpu)
            raise ConfigError(f"sequence {seq_id}: block {b} is on {loc.tier.value}; call ensure_on_gpu first")
        return [loc.index for loc in locs]

    def gpu_slots(self, seq_id: int) -> torch.Tensor:
        """`gpu_indices` as a device tensor [num_blocks] int64."""
        return torch.tensor(self.gpu_indices(seq_id), dtype=torch.int64, device=self.device.torch_device)

    def mark_written(self, seq_id: int, start_token: int, end_token: int) -> None:
        """Kernels wrote tokens [start, end): the touched blocks' checksums are stale now."""
        table = self.blocks_of(seq_id)
        for i in range(start_token // self.block_tokens, self.num_blocks_for(end_token)):
            self.handler.mark_dirty(table[i])

    def free(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)
        for b in self.tables.pop(seq_id, []):
            self.manager.free(b)

    def close(self) -> None:
        self.handler.close()
        self.stores.close()
