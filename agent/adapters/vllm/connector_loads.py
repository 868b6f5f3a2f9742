"""A step's loads of the vLLM KV connector as one batch (vLLM worker process).

The blocks a step loads back are read together: CPU-tier blocks straight from our pinned host memory, NVMe-tier
blocks submitted to the transfer engine's disk link as one list (its disk workers read them in parallel) into
page-aligned buffers of its own, `num_buffers` at a time. Every block is checked against the checksum the runtime
took when it was written before `sink` sees it, and held by the runtime (no move, no free) while it is read. Runs
on the engine thread (vLLM reads the blocks in the forward that follows); never decides what to load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierplan.runtime.checksum import checksum
from tierplan.runtime.device import AlignedHostBuffer, Device
from tierplan.runtime.errors import CorruptDataError, RuntimeTierError
from tierplan.runtime.kv import KVBlockManager, KVTierStores, Tier
from tierplan.runtime.transfer import Link, TrafficClass, TransferEngine, TransferRequest

Sink = Callable[[int, "torch.Tensor | RuntimeTierError"], None]  # (position in the batch, checked bytes or error)


class BatchReader:
    def __init__(self, manager: KVBlockManager, stores: KVTierStores, engine: TransferEngine, device: Device,
                 num_buffers: int = 4) -> None:
        self.manager, self.stores, self.engine = manager, stores, engine
        self._bufs: list[AlignedHostBuffer] = []
        if stores.nvme_file is not None:
            self._bufs = [device.alloc_host(stores.block_bytes) for _ in range(num_buffers)]
        self.num_batches = 0  # disk batches submitted
        self.num_disk_reads = 0

    def _checked(self, block_id: int, data: torch.Tensor) -> torch.Tensor | RuntimeTierError:
        expected, spec = self.manager.checksum(block_id), self.manager.location(block_id)
        if expected is not None and spec.tier in self.manager.verify_tiers and checksum(data) != expected:
            return CorruptDataError(f"load: KV block {block_id} on tier {spec.tier.value} index {spec.index}: "
                                    f"checksum mismatch, expected {expected:#018x}")
        return data

    def read(self, block_ids: list[int], sink: Sink) -> None:
        """Call `sink(i, bytes)` for every block (bytes valid during the call only) or `sink(i, error)`."""
        disk: list[tuple[int, int]] = []
        for i, bid in enumerate(block_ids):
            try:
                self.manager.acquire(bid)
            except RuntimeTierError as exc:
                sink(i, exc)
                continue
            if self.manager.location(bid).tier is Tier.NVME and self._bufs:
                disk.append((i, bid))
                continue
            try:
                sink(i, self._checked(bid, self.stores.memory(self.manager.location(bid))))
            finally:
                self.manager.release(bid)
        for start in range(0, len(disk), max(1, len(self._bufs))):
            self._read_disk(disk[start:start + len(self._bufs)], sink)

    def _read_disk(self, batch: list[tuple[int, int]], sink: Sink) -> None:
        reqs = [TransferRequest(Link.DISK2H, TrafficClass.KV, self.stores.region(self.manager.location(bid)),
                                buf.tensor[:self.stores.block_bytes])
                for (_, bid), buf in zip(batch, self._bufs, strict=False)]
        try:
            handles = self.engine.submit_many(reqs)
        except RuntimeTierError as exc:
            handles, error = None, exc
        self.num_batches += 1
        self.num_disk_reads += len(batch)
        for k, ((i, bid), buf) in enumerate(zip(batch, self._bufs, strict=False)):
            try:
                if handles is None:
                    sink(i, error)
                    continue
                try:
                    handles[k].wait()
                except RuntimeTierError as exc:
                    sink(i, exc)
                    continue
                sink(i, self._checked(bid, buf.tensor[:self.stores.block_bytes]))
            finally:
                self.manager.release(bid)

    def close(self) -> None:
        for buf in self._bufs:
            buf.close()
        self._bufs = []
