"""Expert loads into the slot pool through the transfer engine (inference process).

pinned store -> slot: one host->device transfer. NVMe store -> slot: disk->host into a pinned staging
buffer, checksum verified there, then host->device. The slot is bound first (`prepare_load`), so a
refusal (no free slot, expert busy) raises before any byte moves; any later failure gives the slot back
(`complete_load(ok=False)`), is counted, and re-raises from `wait()`. Never picks what to load.
"""

from __future__ import annotations

import threading
from enum import Enum
from typing import Any

from runtime.device import AlignedHostBuffer
from runtime.errors import ConfigError, CorruptDataError
from runtime.future import OpFuture
from runtime.memory.slots import ExpertSlotPool
from runtime.transfer import Link, Priority, TrafficClass, TransferEngine, TransferHandle, TransferRequest
from runtime.weights.stores import NvmeExpertStore, PinnedExpertStore


class StoreKind(Enum):
    PINNED = "pinned"
    NVME = "nvme"


class ExpertLoadHandler:
    """Moves expert records from a store into pool slots (see module docstring)."""

    def __init__(
        self,
        pool: ExpertSlotPool,
        engine: TransferEngine,
        pinned: PinnedExpertStore | None = None,
        nvme: NvmeExpertStore | None = None,
        num_staging: int = 4,
    ) -> None:
        if pinned is None and nvme is None:
            raise ConfigError("ExpertLoadHandler needs a pinned store, an NVMe store, or both")
        for store in (pinned, nvme):
            if store is not None and store.format.num_bytes != pool.layout.expert_bytes:
                raise ConfigError(
                    f"store expert_bytes {store.format.num_bytes} != pool expert_bytes {pool.layout.expert_bytes}"
                )
        self.pool, self.engine, self.pinned, self.nvme = pool, engine, pinned, nvme
        self._staging: list[AlignedHostBuffer] = []
        self._cv = threading.Condition()
        if nvme is not None:
            self._staging = [engine.device.alloc_host(nvme.records.record_bytes) for _ in range(num_staging)]
        self._free_staging = list(self._staging)
        self._stats = {"loads_ok": 0, "loads_failed": 0, "corrupt_detected": 0, "bytes": 0}

    def _count(self, key: str, n: int = 1) -> None:
        with self._cv:
            self._stats[key] += n

    def stats(self) -> dict[str, int]:
        with self._cv:
            return dict(self._stats)

    def load(
        self,
        layer: int,
        expert: int,
        store: StoreKind = StoreKind.PINNED,
        priority: Priority = Priority.NORMAL,
        deadline_s: float | None = None,
    ) -> OpFuture:
        src_store = self.pinned if store is StoreKind.PINNED else self.nvme
        if src_store is None:
            raise ConfigError(f"load: no {store.value} store configured")
        # Reserve now (refusals raise before anything moves); map in the H2D worker right before the copy.
        dst = self.pool.prepare_load(layer, expert, map_now=False)
        fut = OpFuture(f"load of expert ({layer}, {expert}) from {store.value}")

        def finish(h: TransferHandle | None, error: BaseException | None, staging: Any = None) -> None:
            try:  # whatever fails here, the future completes and the outcome is counted
                if staging is not None:
                    self._give_staging(staging)
                event = h.device_event() if (error is None and h is not None) else None
                self.pool.complete_load(layer, expert, error is None, event=event)
            except Exception as exc:
                error = error or exc
            finally:
                self._count("loads_ok" if error is None else "loads_failed")
                if error is None:
                    self._count("bytes", dst.numel())
                fut.set_result(error)

        def h2d(src: Any, staging: Any = None) -> None:
            self.engine.submit(TransferRequest(
                Link.H2D, TrafficClass.EXPERT, src, dst, priority, deadline_s,
                before_issue=lambda: self.pool.map_reserved(layer, expert),
                on_done=lambda h: finish(h, h.error, staging),
            ))

        if store is StoreKind.PINNED:
            assert self.pinned is not None
            try:
                h2d(self.pinned.expert(layer, expert))
            except Exception:  # refused before any byte moved: give the slot back
                self.pool.complete_load(layer, expert, ok=False)
                raise
            return fut

        assert self.nvme is not None
        nvme = self.nvme
        staging = self._take_staging()

        def after_disk(h: TransferHandle) -> None:
            if h.error is not None:
                finish(None, h.error, staging)
                return
            try:
                nvme.verify(layer, expert, staging.tensor)
            except CorruptDataError as exc:
                self._count("corrupt_detected")
                finish(None, exc, staging)
                return
            try:
                h2d(staging.tensor[: dst.numel()], staging)
            except Exception as exc:
                finish(None, exc, staging)

        try:
            self.engine.submit(TransferRequest(
                Link.DISK2H, TrafficClass.EXPERT, nvme.region(layer, expert), staging.tensor, priority,
                deadline_s, on_done=after_disk,
            ))
        except Exception:
            self._give_staging(staging)
            self.pool.complete_load(layer, expert, ok=False)
            raise
        return fut

    def _take_staging(self) -> AlignedHostBuffer:
        with self._cv:
            while not self._free_staging:
                self._cv.wait()
            return self._free_staging.pop()

    def _give_staging(self, buf: AlignedHostBuffer) -> None:
        with self._cv:
            self._free_staging.append(buf)
            self._cv.notify()

    def close(self) -> None:
        for b in self._staging:
            b.close()
