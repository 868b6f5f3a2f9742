"""Expert loads into the slot pool through the transfer engine (inference process).

pinned store -> slot: one host->device transfer. NVMe store -> slot: disk->host into a pinned staging
buffer, checksum verified there, then host->device. The slot is bound first (`prepare_load`), so a
refusal (no free slot, expert busy) raises before any byte moves; any later failure gives the slot back
(`complete_load(ok=False)`), is counted, and re-raises from `wait()`. Never picks what to load.

Where the expert's range is mapped (`map_in`):
  "worker": by the host->device link's worker right before the copy, which then writes through the range.
  "mapper": the copy writes through the slot's window (a pool made with `slot_window=True`) and starts at
    once, while this handler's mapper thread maps the expert's range beside it, in (priority, deadline,
    arrival) order. Whichever of the two ends last publishes the expert. Measured on the H200, a remap costs
    ~100-200 µs while copies run, as much as a 9 MiB copy: in the worker it left the link idle between copies.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, get_args

from runtime.device import AlignedHostBuffer
from runtime.errors import ConfigError, CorruptDataError
from runtime.future import OpFuture
from runtime.memory.slots import ExpertSlotPool, ExpertState
from runtime.transfer import Link, Priority, TrafficClass, TransferEngine, TransferHandle, TransferRequest
from runtime.weights.stores import NvmeExpertStore, PinnedExpertStore


class StoreKind(Enum):
    PINNED = "pinned"
    NVME = "nvme"


MapIn = Literal["worker", "mapper"]
MAP_IN: tuple[str, ...] = get_args(MapIn)  # the values, for checks and messages


class _Mapper:
    """One thread running map jobs in (priority, deadline, arrival) order (inference process). A job reports
    its own outcome; one that raises anyway is counted in `errors`, never dropped silently. If the thread
    cannot start (binding the device fails) every queued and later job is failed with that error."""

    def __init__(self, bind: Callable[[], None]) -> None:
        self._heap: list[tuple[int, float, int, Callable[[], None], Callable[[BaseException], None]]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closing = False
        self._dead: BaseException | None = None
        self._bind = bind
        self.busy_s = 0.0
        self.errors = 0
        self.last_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tierplan-mapper", daemon=True)
        self._thread.start()

    def put(self, priority: Priority, deadline_s: float | None, job: Callable[[], None],
            fail: Callable[[BaseException], None]) -> None:
        """Queue `job`; `fail(error)` is called instead if the mapper dies before running it."""
        with self._cv:
            if self._dead is not None:
                raise ConfigError(f"expert loader's mapper thread failed: {self._dead!r}")
            if self._closing:
                raise ConfigError("expert loader is closed")
            deadline = float("inf") if deadline_s is None else deadline_s
            heapq.heappush(self._heap, (int(priority), deadline, next(self._seq), job, fail))
            self._cv.notify()

    def _run(self) -> None:
        try:
            self._bind()
        except BaseException as exc:
            with self._cv:
                self._dead, self.errors, self.last_error = exc, self.errors + 1, exc
                queued, self._heap = self._heap, []
            for *_, fail in queued:
                fail(exc)
            return
        while True:
            with self._cv:
                while not self._heap and not self._closing:
                    self._cv.wait()
                if not self._heap:
                    return
                *_, job, _fail = heapq.heappop(self._heap)
            t0 = time.perf_counter()
            try:
                job()
            except BaseException as exc:  # jobs report their own errors; anything else is counted here
                self.errors += 1
                self.last_error = exc
            self.busy_s += time.perf_counter() - t0

    def close(self) -> None:
        """Run every queued job, then stop."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()


class _Join:
    """The independent parts of one load (the copy; with the mapper, also the map): the last part to end
    calls `then(handle, error, staging)` exactly once; a second part's error is kept as a note on the first."""

    def __init__(self, parts: int, then: Callable[[TransferHandle | None, BaseException | None, Any], None]) -> None:
        self._left, self._then, self._lock = parts, then, threading.Lock()
        self._error: BaseException | None = None
        self._handle: TransferHandle | None = None
        self._staging: Any = None

    def part_done(self, error: BaseException | None = None, handle: TransferHandle | None = None,
                  staging: Any = None) -> None:
        with self._lock:
            if error is not None and self._error is not None and error is not self._error:
                self._error.add_note(f"another part of the load failed too: {error!r}")
            self._error = self._error or error
            self._handle = handle or self._handle
            self._staging = staging if staging is not None else self._staging
            self._left -= 1
            last = self._left == 0
        if last:
            self._then(self._handle, self._error, self._staging)


class ExpertLoadHandler:
    """Moves expert records from a store into pool slots (see module docstring)."""

    def __init__(
        self,
        pool: ExpertSlotPool,
        engine: TransferEngine,
        pinned: PinnedExpertStore | None = None,
        nvme: NvmeExpertStore | None = None,
        num_staging: int = 4,
        map_in: MapIn = "worker",
    ) -> None:
        if map_in not in MAP_IN:
            raise ConfigError(f"ExpertLoadHandler.map_in must be 'worker' or 'mapper', got {map_in!r}")
        if map_in == "mapper" and not pool.slot_window:
            raise ConfigError("ExpertLoadHandler(map_in='mapper') needs a pool made with slot_window=True "
                              "(copies go through the slot window while the mapper maps)")
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
        self.map_in = map_in
        self._inflight = 0  # loads started and not yet completed (close() waits for them)
        self._closed = False
        self._mapper = _Mapper(engine.device.bind_thread) if map_in == "mapper" else None
        self._stats = {"loads_ok": 0, "loads_failed": 0, "corrupt_detected": 0, "bytes": 0}

    def _count(self, key: str, n: int = 1) -> None:
        with self._cv:
            self._stats[key] += n

    def stats(self) -> dict[str, int]:
        """Loads ok / failed, NVMe corruptions caught, bytes loaded, and map jobs that raised (never expected)."""
        with self._cv:
            return {**self._stats, "mapper_errors": 0 if self._mapper is None else self._mapper.errors}

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
        windowed = self._mapper is not None
        with self._cv:
            if self._closed:
                raise ConfigError("load: the expert loader is closed")
            # Reserve now (refusals raise before anything moves); map beside the copy or right before it.
            dst = self.pool.prepare_load(layer, expert, map_now=False, via_window=windowed)
            self._inflight += 1
        fut = OpFuture(f"load of expert ({layer}, {expert}) from {store.value}")

        def finish(h: TransferHandle | None, error: BaseException | None, staging: Any = None) -> None:
            self._finish(layer, expert, dst.numel(), fut, h, error, staging)

        join = _Join(2 if windowed else 1, finish)

        def h2d(src: Any, staging: Any = None) -> None:
            self.engine.submit(TransferRequest(
                Link.H2D, TrafficClass.EXPERT, src, dst, priority, deadline_s,
                before_issue=None if windowed else (lambda: self.pool.map_reserved(layer, expert)),
                on_done=lambda h: join.part_done(h.error, h, staging),
            ))

        if store is StoreKind.PINNED:
            assert self.pinned is not None
            try:
                h2d(self.pinned.expert(layer, expert))
            except Exception:  # refused before any byte moved: give the slot back
                self.pool.complete_load(layer, expert, ok=False)
                self._load_ended()
                raise
            self._start_map(layer, expert, priority, deadline_s, join)
            return fut

        assert self.nvme is not None
        nvme = self.nvme
        staging = self._take_staging()

        def after_disk(h: TransferHandle) -> None:
            if h.error is not None:
                join.part_done(h.error, None, staging)
                return
            try:
                nvme.verify(layer, expert, staging.tensor)
            except Exception as exc:  # corruption, or anything else: the load still completes with it
                if isinstance(exc, CorruptDataError):
                    self._count("corrupt_detected")
                join.part_done(exc, None, staging)
                return
            try:
                h2d(staging.tensor[: dst.numel()], staging)
            except Exception as exc:
                join.part_done(exc, None, staging)

        try:
            self.engine.submit(TransferRequest(
                Link.DISK2H, TrafficClass.EXPERT, nvme.region(layer, expert), staging.tensor, priority,
                deadline_s, on_done=after_disk,
            ))
        except Exception:
            self._give_staging(staging)
            self.pool.complete_load(layer, expert, ok=False)
            self._load_ended()
            raise
        self._start_map(layer, expert, priority, deadline_s, join)
        return fut

    def load_many(self, layer: int, experts: list[int], priority: Priority = Priority.NORMAL,
                  deadline_s: float | None = None) -> list[OpFuture]:
        """Load several experts of one layer from the pinned store (a prefetch list), one future each, copied in
        list order. Slots are reserved for all or, if any expert is refused, for none (nothing moves); the
        copies go to the link in one submission, so the submitting thread holds the GIL briefly and the link's
        worker starts at once."""
        if self.pinned is None:
            raise ConfigError("load_many: no pinned store configured")
        pinned, pool, windowed = self.pinned, self.pool, self._mapper is not None
        with self._cv:
            if self._closed:
                raise ConfigError("load_many: the expert loader is closed")
            dsts = pool.prepare_loads(layer, experts, via_window=windowed)
            self._inflight += len(experts)
        futs = [OpFuture(f"load of expert ({layer}, {e}) from pinned") for e in experts]
        joins: list[_Join] = []
        src, n = pinned.buffer, pool.layout.expert_bytes

        def request(e: int, dst: Any, dst_off: int, fut: OpFuture) -> TransferRequest:
            # by byte range of the store's buffer and the pool's range: no tensor views per expert
            join = None
            if windowed:  # two parts: this copy through the slot window, and the mapper's map
                join = _Join(2, lambda h, error, _staging: self._finish(layer, e, n, fut, h, error))
                joins.append(join)
            return TransferRequest(
                Link.H2D, TrafficClass.EXPERT, src, dst, priority, deadline_s,
                before_issue=None if windowed else (lambda: pool.map_reserved(layer, e)),
                on_done=(lambda h: join.part_done(h.error, h)) if join is not None
                else (lambda h: self._finish(layer, e, n, fut, h, h.error)),
                num_bytes=n, src_offset_bytes=pinned.offset(layer, e), dst_offset_bytes=dst_off)

        try:
            self.engine.submit_many([request(e, d, off, f) for e, (d, off), f in zip(experts, dsts, futs, strict=True)])
        except Exception:  # refused before any byte moved: give every slot back
            for e in experts:
                pool.complete_load(layer, e, ok=False)
                self._load_ended()
            raise
        for e, join in zip(experts, joins, strict=False):  # the mapper's parts (none without it)
            self._start_map(layer, e, priority, deadline_s, join)
        return futs

    def _finish(self, layer: int, expert: int, num_bytes: int, fut: OpFuture, h: TransferHandle | None,
                error: BaseException | None, staging: Any = None) -> None:
        """A load's last part ended (the link's worker or retire thread, or the mapper): publish or give the slot back.
        Whatever fails here, the future completes, the slot is not left LOADING, and it is counted."""
        try:
            if staging is not None:
                self._give_staging(staging)
            event = h.device_event() if (error is None and h is not None) else None
            self.pool.complete_load(layer, expert, error is None, event=event)
        except Exception as exc:
            error = error or exc
            if self.pool.state(layer, expert) is ExpertState.LOADING:
                try:
                    self.pool.complete_load(layer, expert, ok=False)
                except Exception as again:
                    error.add_note(f"giving the slot back failed too: {again!r}")
        finally:
            with self._cv:
                self._stats["loads_ok" if error is None else "loads_failed"] += 1
                if error is None:
                    self._stats["bytes"] += num_bytes
                self._inflight -= 1
                self._cv.notify_all()
            fut.set_result(error)

    def _start_map(self, layer: int, expert: int, priority: Priority, deadline_s: float | None, join: _Join) -> None:
        """With the mapper: queue the map of the expert's range (the load's second part)."""
        if self._mapper is None:
            return

        def job() -> None:
            try:
                self.pool.map_reserved(layer, expert)
            except Exception as exc:
                join.part_done(exc)
                return
            join.part_done()

        try:
            self._mapper.put(priority, deadline_s, job, join.part_done)
        except Exception as exc:  # the copy is under way: the load completes with this error once it lands
            join.part_done(exc)

    def _take_staging(self) -> AlignedHostBuffer:
        with self._cv:
            while not self._free_staging:
                self._cv.wait()
            return self._free_staging.pop()

    def _give_staging(self, buf: AlignedHostBuffer) -> None:
        with self._cv:
            self._free_staging.append(buf)
            self._cv.notify()

    def mapper_busy_s(self) -> float:
        """Seconds the mapper thread spent mapping (0 with map_in="worker")."""
        return 0.0 if self._mapper is None else self._mapper.busy_s

    def _load_ended(self) -> None:
        with self._cv:
            self._inflight -= 1
            self._cv.notify_all()

    def close(self, timeout_s: float = 60.0) -> None:
        """Refuse new loads, wait for those in flight (the transfer engine must still run), stop the mapper,
        then free staging. Raises TimeoutError (staging kept) if loads are still in flight after timeout_s."""
        with self._cv:
            self._closed = True
            if not self._cv.wait_for(lambda: self._inflight == 0, timeout_s):
                raise TimeoutError(f"expert loader close: {self._inflight} load(s) still in flight "
                                   f"after {timeout_s} s")
        if self._mapper is not None:
            self._mapper.close()
        for b in self._staging:
            b.close()
        self._staging = []
