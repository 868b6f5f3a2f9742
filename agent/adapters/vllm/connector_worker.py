"""The byte side of the vLLM KV connector: vLLM's KV blocks into our CPU and NVMe tiers and back (vLLM worker
process).

One stored block is one vLLM KV block of every attention layer, the layers' bytes laid end to end (padded to the
4 KiB our tiers need), so one key names one unit of placement, as in our engine's paged cache. The bytes live in
our runtime's tiers (`KVTierStores`: pinned host memory and an O_DIRECT file), booked by its `KVBlockManager`
(whose limits are the plan's, so the runtime itself refuses a block past them) and moved by its
`KVTransferHandler`; every read is checked against the checksum taken when the block was written, so the bytes
put back into vLLM's cache are the bytes taken out, or the load fails (any read error: the block is freed and
forgotten) and vLLM computes the block again. A step with a failed load starts a failure epoch: every store, of
every request, is skipped (counted) from that step until a step's `ack_epoch` says the scheduler processed the
failure's report (async scheduling builds a step or more before it does), so nothing computed over wrong bytes is
ever kept; the scheduler's rewind then governs what is stored again. Spills (CPU tier to NVMe file) run in the
background (`connector_spills.py`) and finish by the next step's ops (a store needing the room one still holds waits in
one of `NUM_DEFERRED` host buffers); a step's loads are read as one batch (`connector_loads.py`) before its
forward, and stores into the tiers, drops and the copies out of vLLM's cache run on the engine thread.
Carries out the scheduler side's `WorkerStep`s in order; never decides what to keep.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from tierplan.agent.adapters.vllm.connector_catalog import STORE_TIERS, OpKind, TierOp
from tierplan.agent.adapters.vllm.connector_layout import KvLayout, WorkerStats
from tierplan.agent.adapters.vllm.connector_loads import BatchReader
from tierplan.agent.adapters.vllm.connector_meta import BlockLoad, WorkerReport, WorkerStep
from tierplan.agent.adapters.vllm.connector_spills import SpillQueue
from tierplan.runtime.device import AlignedHostBuffer, Device, DeviceKind
from tierplan.runtime.errors import CapacityError, CorruptDataError, RuntimeTierError
from tierplan.runtime.kv import KVBlockManager, KVTierStores, KVTransferHandler, Tier
from tierplan.runtime.transfer import TransferEngine

NUM_DEFERRED = 8  # host buffers for stores waiting on a spill (blocks outside the tiers, beside the staging buffers)


class KvTierWorker:
    """Our CPU/NVMe tiers behind one vLLM worker's KV cache; `register` first, then `load`/`apply` per step."""

    def __init__(self, capacity: dict[Tier, int], nvme_path: Path | None, direct_io: bool = True) -> None:
        self.capacity = {t: capacity.get(t, 0) for t in STORE_TIERS}
        if self.capacity[Tier.NVME] and nvme_path is None:
            raise ValueError("KvTierWorker: an NVMe tier needs a file path")
        self.nvme_path = nvme_path
        self.direct_io = direct_io
        self.stats = WorkerStats()
        self.layout: KvLayout | None = None
        self._kv: dict[str, torch.Tensor] = {}
        self._blocks: dict[str, int] = {}  # key -> our runtime's block id
        self._limits = dict(self.capacity)
        self._report = WorkerReport()
        self.spills = SpillQueue(self._move_done)
        self._step_failed: set[int] = set()  # vLLM block ids whose load failed this step
        # The step of this worker's latest failed load (or one more than the last epoch, for unnumbered steps).
        # Per-request tracking cannot see every block computed over a bad one (a sharer, a step already scheduled),
        # so every store waits until the scheduler acknowledges the epoch.
        self.epoch = 0
        # Stores whose room a spill in flight still holds: their bytes wait in a host buffer of ours until it is done.
        self._deferred: dict[str, tuple[Tier, AlignedHostBuffer]] = {}
        self._free_bufs: list[AlignedHostBuffer] = []
        self._engine: TransferEngine | None = None
        self._stores: KVTierStores | None = None
        self.manager: KVBlockManager | None = None
        self.handler: KVTransferHandler | None = None
        self._reader: BatchReader | None = None

    # ---- set-up -------------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Bind vLLM's per-layer caches and create the tiers for their block size."""
        self.close()
        self.layout = KvLayout.of(kv_caches)
        self._kv = {name: kv_caches[name] for name in self.layout.layer_names}
        kind = DeviceKind.CUDA if self.layout.device_type == "cuda" else DeviceKind.CPU
        first = self._kv[self.layout.layer_names[0]]
        device = Device(kind, first.device.index or 0) if kind is DeviceKind.CUDA else Device(kind)
        self._engine = TransferEngine(device, disk_workers=2)  # a step's NVMe loads are read two at a time
        caps = {Tier.GPU: 0, **self.capacity}
        try:
            self._stores = KVTierStores(device, self.layout.block_bytes, caps, self.nvme_path, direct_io=self.direct_io)
        except BaseException:
            self._engine.close()
            self._engine = None
            raise
        self.manager = KVBlockManager(caps, verify_tiers=frozenset(STORE_TIERS))  # every read is checked
        self.handler = KVTransferHandler(self.manager, self._stores, self._engine, num_staging=2)
        self._reader = BatchReader(self.manager, self._stores, self._engine, device)
        nvme = self._stores.nvme_file
        self.stats.nvme_fallback_reason = None if nvme is None else nvme.fallback_reason
        self._buf = torch.zeros(self.layout.block_bytes, dtype=torch.uint8)  # [B] host bytes of one block
        if self.capacity[Tier.NVME]:  # spills happen: stores waiting on them need somewhere to wait
            self._free_bufs = [device.alloc_host(self.layout.block_bytes) for _ in range(NUM_DEFERRED)]

    def _require(self) -> tuple[KvLayout, KVBlockManager, KVTransferHandler]:
        if self.layout is None or self.manager is None or self.handler is None:
            raise RuntimeError("KvTierWorker: register(kv_caches) was not called")
        return self.layout, self.manager, self.handler

    # ---- bytes between vLLM's cache and a host buffer -----------------------------------------------
    def _layer_bytes(self, name: str, block_id: int) -> torch.Tensor:
        return self._kv[name][block_id].reshape(-1).view(torch.uint8)  # [bytes of one layer's block]

    def gather(self, block_id: int) -> torch.Tensor:
        """vLLM block `block_id` of every layer, end to end, in a host buffer [block_bytes] (reused per call)."""
        layout, _, _ = self._require()
        off = 0
        for name, n in zip(layout.layer_names, layout.bytes_per_layer, strict=True):
            self._buf[off:off + n].copy_(self._layer_bytes(name, block_id))
            off += n
        return self._buf

    def scatter(self, data: torch.Tensor, block_id: int) -> None:
        layout, _, _ = self._require()
        off = 0
        for name, n in zip(layout.layer_names, layout.bytes_per_layer, strict=True):
            self._layer_bytes(name, block_id).copy_(data[off:off + n])
            off += n

    # ---- one step -----------------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        """A failure counter: in this worker's stats and in the report the scheduler hears this step."""
        setattr(self.stats, name, getattr(self.stats, name) + n)
        self._report.counts[name] = self._report.counts.get(name, 0) + n

    def load(self, loads: tuple[BlockLoad, ...]) -> None:
        """Put the step's stored blocks into vLLM's cache, read as one batch (`connector_loads.py`). A block missing
        here or failing its read (its checksum, or any I/O error) is reported (vLLM computes it again), freed and
        forgotten; a spill of one of them still in flight is finished first."""
        _, manager, _ = self._require()
        self.spills.poll()
        if self._deferred and not self.spills.pending():
            self._complete_deferred()
        self._settle([ld.key for ld in loads])
        todo: list[tuple[BlockLoad, int, Tier]] = []
        failed: list[BlockLoad] = []
        for ld in loads:
            bid = self._blocks.get(ld.key)
            if bid is None:
                failed.append(ld)
            else:
                todo.append((ld, bid, manager.location(bid).tier))

        def sink(i: int, got: torch.Tensor | RuntimeTierError) -> None:
            ld, _, tier = todo[i]
            if isinstance(got, RuntimeTierError):
                if isinstance(got, CorruptDataError):
                    self._count("corrupt_loads")
                failed.append(ld)  # freed below, once the reader let go of it
                return
            self.scatter(got, ld.block_id)
            self.stats.loads_per_tier[tier.value] += 1

        if self._reader is not None:
            self._reader.read([bid for _, bid, _ in todo], sink)
        for ld in failed:
            self._fail_load(ld)

    def _fail_load(self, ld: BlockLoad) -> None:
        self._count("failed_loads")
        self._free(ld.key)
        self._report.failed_load_block_ids.add(ld.block_id)
        self._report.failed_keys.add(ld.key)
        self._step_failed.add(ld.block_id)
        if ld.req_id:
            self._report.failed_from[ld.req_id] = min(ld.index, self._report.failed_from.get(ld.req_id, ld.index))

    def _note_failures(self, step: WorkerStep) -> None:
        """This step's failed loads: a new epoch, and per request the first block index computed over one."""
        if not self._step_failed:
            return
        self.epoch = max(self.epoch + 1, step.seq)
        self._report.epoch = self.epoch
        failed_from = self._report.failed_from
        for req_id, ids in step.req_blocks.items():
            first = next((j for j, b in enumerate(ids) if b in self._step_failed), None)
            if first is not None:
                failed_from[req_id] = min(first, failed_from.get(req_id, first))
        self._step_failed = set()

    def apply(self, step: WorkerStep) -> None:
        """Finish the previous step's spills, install the step's limits, then carry out its ops in order,
        checking the footprint after each. While a failure epoch is not acknowledged, every store is skipped and
        reported (the books forget its key)."""
        _, manager, _ = self._require()
        self._settle_all()
        self._note_failures(step)
        paused = self.epoch > step.ack_epoch
        self._limits = {Tier.CPU: step.cpu_blocks, Tier.NVME: step.nvme_blocks}
        manager.set_limits({t: min(n, self.capacity[t]) for t, n in self._limits.items() if self.capacity[t]})
        for op in step.ops:
            before = self.blocks_per_tier()
            if op.kind is OpKind.STORE and paused:
                self._count("poisoned_stores")
                self._report.failed_keys.add(op.key)
                continue
            self._do(op, step)
            self._check_footprint(before)

    def _fail_store(self, key: str) -> None:
        self._count("failed_stores")
        self._report.failed_keys.add(key)

    def _do(self, op: TierOp, step: WorkerStep) -> None:
        _, manager, handler = self._require()
        if op.kind is OpKind.STORE:
            if op.key not in step.store_blocks:
                self._fail_store(op.key)
                return
            if op.key in self._blocks or op.key in self._deferred:  # books that lost track of it: new bytes win
                self._discard(op.key)
                self.stats.overwrites += 1
            try:
                bid = manager.allocate(op.tier)
            except CapacityError:
                self._store_after_spills(op, step)
                return
            except RuntimeTierError:
                self._fail_store(op.key)
                return
            self._write(op.key, op.tier, bid, self.gather(step.store_blocks[op.key]))
        elif op.kind is OpKind.MOVE:
            self._settle([op.key])
            bid = self._blocks.get(op.key)
            try:
                if bid is None:
                    raise KeyError(op.key)
                self.spills.start(op.key, handler.move(bid, op.tier))  # its bytes stay safe where they are
            except (RuntimeTierError, KeyError):
                self._move_failed(op.key)
        elif self._discard(op.key):
            self.stats.drops += 1

    def _write(self, key: str, tier: Tier, bid: int, data: torch.Tensor) -> None:
        _, manager, handler = self._require()
        try:
            handler.write(bid, data)
        except RuntimeTierError:
            manager.free(bid)
            self._fail_store(key)
            return
        self._blocks[key] = bid
        self.stats.stores_per_tier[tier.value] += 1

    def _store_after_spills(self, op: TierOp, step: WorkerStep) -> None:
        """The tier is full: of blocks spilling out of it (their room comes free once the spill is done), or of
        blocks the books did not count (a failure). The bytes wait in a buffer of ours, or for the spills."""
        _, manager, _ = self._require()
        if not self.spills.pending():
            self._fail_store(op.key)
            return
        if self._free_bufs:
            buf = self._free_bufs.pop()
            buf.tensor[:self._buf.numel()].copy_(self.gather(step.store_blocks[op.key]))
            self._deferred[op.key] = (op.tier, buf)
            self.stats.deferred_stores += 1
            return
        self.stats.spill_waits += 1
        self._settle_all()
        try:
            bid = manager.allocate(op.tier)
        except RuntimeTierError:
            self._fail_store(op.key)
            return
        self._write(op.key, op.tier, bid, self.gather(step.store_blocks[op.key]))

    def _complete_deferred(self) -> None:
        """Stores waiting on spills, in order, once those are done (their room is free now, or they fail)."""
        _, manager, _ = self._require()
        for key, (tier, buf) in list(self._deferred.items()):
            del self._deferred[key]
            try:
                try:
                    bid = manager.allocate(tier)
                except RuntimeTierError:
                    self._fail_store(key)
                    continue
                self._write(key, tier, bid, buf.tensor[:self._buf.numel()])
            finally:
                self._free_bufs.append(buf)

    def _settle(self, keys: list[str]) -> None:
        """Finish what these keys wait on: their spills, or every spill if one of them is a deferred store."""
        if any(k in self._deferred for k in keys):
            self._settle_all()
        else:
            self.spills.settle(keys)

    def _settle_all(self) -> None:
        self.spills.settle_all()
        if self._deferred:
            self._complete_deferred()

    def _discard(self, key: str) -> bool:
        """Forget the key's bytes wherever they are (a deferred store's buffer goes back)."""
        held = self._deferred.pop(key, None)
        if held is not None:
            self._free_bufs.append(held[1])
            return True
        self.spills.settle([key])
        return self._free(key)

    def _move_done(self, key: str, error: BaseException | None) -> None:
        if error is None:
            self.stats.moves += 1
        else:
            self._move_failed(key)

    def _move_failed(self, key: str) -> None:
        # The block stayed where it was (or never was): drop it so the books and the bytes agree.
        self._count("failed_moves")
        self._free(key)
        self._report.failed_keys.add(key)

    def _free(self, key: str) -> bool:
        bid = self._blocks.pop(key, None)
        if bid is None or self.manager is None:
            return False
        self.manager.free(bid)
        return True

    def _check_footprint(self, before: dict[str, int]) -> None:
        """A tier that grew past its limit is a broken promise (counted; the runtime should have refused it). A
        tier still above a smaller plan's limit while the step's drops and moves bring it down is not."""
        _, manager, _ = self._require()
        self.stats.footprint_checks += 1
        for tier in STORE_TIERS:
            used = manager.num_used(tier)
            peak = self.stats.peak_blocks_per_tier
            peak[tier.value] = max(peak[tier.value], used)
            if used > self._limits[tier] and used > before[tier.value]:
                self.stats.limit_violations += 1

    def finish_spills(self) -> None:
        """Wait for every spill in flight and the stores waiting on them (the next step's ops do it anyway)."""
        self._settle_all()

    # ---- reporting and shutdown ---------------------------------------------------------------------
    def take_report(self) -> WorkerReport:
        report, self._report = self._report, WorkerReport()
        return report

    def blocks_per_tier(self) -> dict[str, int]:
        if self.manager is None:
            return {t.value: 0 for t in STORE_TIERS}
        return {t.value: self.manager.num_used(t) for t in STORE_TIERS}

    def holds(self, key: str) -> bool:
        return key in self._blocks or key in self._deferred

    def read_block(self, key: str) -> torch.Tensor:
        """A checked host copy of a stored block (tests compare it with vLLM's cache)."""
        _, _, handler = self._require()
        self._settle([key])
        return handler.read(self._blocks[key])

    def close(self) -> None:
        """Finish transfers, release host memory and remove the NVMe file (its blocks die with the process)."""
        if self.handler is not None:
            self._settle_all()
            self.handler.close()
        if self._reader is not None:
            self._reader.close()
        if self._stores is not None:
            self._stores.close()
        if self._engine is not None:
            self._engine.close()
        if self._stores is not None and self.nvme_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.nvme_path)
        self.handler = self.manager = self._stores = self._engine = self._reader = None
        self._blocks.clear()
        self._kv = {}  # vLLM's cache tensors: theirs to free
        for buf in self._free_bufs + [b for _, b in self._deferred.values()]:
            buf.close()
        self._free_bufs, self._deferred = [], {}

