"""Expert loads into the slot pool through the transfer engine (inference process).

pinned store -> slot: one host->device transfer. NVMe store -> slot: disk->host into a pinned staging buffer,
checksum verified there, then host->device. The slot is bound first (`prepare_load`), so a refusal (no free slot,
expert busy) raises before any byte moves; any later failure gives the slot back (`complete_load(ok=False)`), is
counted, and re-raises from `wait()`. Never picks what to load.

When the host->device link's worker maps the expert's range (`map_in`):
  "beside_copy" (the default): the copy writes through the slot's window (a pool made with `slot_window=True`) and
    starts at once; the worker maps the expert's range beside it, as an idle job (`TransferEngine.submit_idle`) in
    its waits for the copies, in (priority, deadline, arrival) order: a remap costs host time comparable to a
    copy's link time (bench/results/design_notes.md). A range the pool kept mapped to its slot needs no map.
  "before_copy": the worker maps the range right before issuing the copy, which then writes through the range.
  "on_read": the copy goes through the slot window and nothing maps the range: readers through the pool's slot
    table need none, and a reader through the ranges maps what it reads first (`ExpertSlotPool.map_for_read`,
    on its own thread). The link's worker then makes no driver call but the copies (needs a pool made with
    `maps_on_read=True`).
When a load is published (`publish`):
  "done": once its copy is done (and its range mapped): then any reader may use it.
  "issued": once its copy is issued (and its range mapped), with the copy's event: readers order their stream
    with `ExpertSlotPool.wait_ready`, which the engine always does; the host never waits for the bytes.
Copies are numbered as issued (all on the host->device link's bulk stream, in that order: expert chunks never take
the urgent stream), so `wait_ready` orders a reader once per list. A list its caller waits for in full (`at_once`:
a step's misses) is issued whole on the caller's thread (`TransferEngine.submit_now`), the rest by the worker.
A slot released while work still read its old expert (`ExpertSlotPool.release`) is copied into only after that work
(its `load_guards` order the link's stream; such segments go last), and the pool's stale ranges are swept on the
link's worker (`sweep_stale`).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from tierplan.runtime.errors import ConfigError, CorruptDataError
from tierplan.runtime.future import OpFuture
from tierplan.runtime.memory.slots import ExpertSlotPool, ExpertState
from tierplan.runtime.staging import StagingLease, StagingPool
from tierplan.runtime.transfer import Link, Priority, TrafficClass, TransferEngine, TransferHandle, TransferRequest
from tierplan.runtime.weights.load_modes import PUBLISH, WINDOWED, MapIn, Publish, StoreKind, map_in_error
from tierplan.runtime.weights.stores import NvmeExpertStore, PinnedExpertStore


class _Load:
    """One expert load in flight (inference process). Before it is published the copy must be done (publish
    "done") or issued (publish "issued": its event orders readers), and with map_in="beside_copy" the map too; a failure
    gives the slot back only once the copy no longer writes it. Concluded (published or refused) once, then
    settled (staging freed, no longer in flight) once its copy has ended."""

    __slots__ = ("concluded", "copy_open", "copy_signaled", "error", "event", "expert", "fut", "issued", "layer",
                 "lock", "order", "parts_left", "premapped", "settled", "staging")

    def __init__(self, layer: int, expert: int, fut: OpFuture, parts: int) -> None:
        self.layer, self.expert, self.fut = layer, expert, fut
        self.issued = OpFuture(f"copy of expert ({layer}, {expert}) issued")  # set before fut (or with its error)
        self.staging: StagingLease | None = None
        self.lock = threading.Lock()
        self.parts_left = parts
        self.copy_signaled = False  # the copy's part of parts_left has been counted
        self.copy_open = True  # the copy may still write the slot
        self.error: BaseException | None = None
        self.event: Any = None  # the copy's event once issued (None on a CPU)
        self.order: int | None = None  # the copy's place in the loader's issue order (with its event)
        self.premapped = False  # the range maps the slot already (the pool kept a released expert's mapping)
        self.concluded = self.settled = False


class ExpertLoadHandler:
    """Moves expert records from a store into pool slots (see module docstring)."""

    def __init__(
        self,
        pool: ExpertSlotPool,
        engine: TransferEngine,
        pinned: PinnedExpertStore | None = None,
        nvme: NvmeExpertStore | None = None,
        num_staging: int = 4,
        map_in: MapIn = "beside_copy",
        publish: Publish = "issued",
        staging: StagingPool | None = None,
    ) -> None:
        if (why := map_in_error("ExpertLoadHandler.map_in", map_in)) is not None:
            raise ConfigError(why)
        if publish not in PUBLISH:
            raise ConfigError(f"ExpertLoadHandler.publish must be 'done' or 'issued', got {publish!r}")
        if map_in in WINDOWED and not pool.slot_window:
            raise ConfigError(f"ExpertLoadHandler(map_in={map_in!r}) needs a pool made with slot_window=True "
                              "(copies go through the slot window); map_in='before_copy' needs none")
        if (map_in == "on_read") != pool.maps_on_read:
            raise ConfigError(f"ExpertLoadHandler(map_in={map_in!r}) and a pool made with maps_on_read="
                              f"{pool.maps_on_read}: map_in='on_read' goes with maps_on_read=True, any other with "
                              "False")
        if pinned is None and nvme is None:
            raise ConfigError("ExpertLoadHandler needs a pinned store, an NVMe store, or both")
        for store in (pinned, nvme):
            if store is not None and store.format.num_bytes != pool.layout.expert_bytes:
                raise ConfigError(f"store expert_bytes {store.format.num_bytes} != pool expert_bytes "
                                  f"{pool.layout.expert_bytes}")
        self.pool, self.engine, self.pinned, self.nvme = pool, engine, pinned, nvme
        # NVMe reads stage through host buffers: from `staging` when given (a pool shared with the KV handler,
        # closed by its owner), else from `num_staging` record-sized buffers of the loader's own.
        self._record_bytes = nvme.records.record_bytes if nvme is not None else 0
        if staging is not None and staging.buffer_bytes < self._record_bytes:
            raise ConfigError(f"ExpertLoadHandler: the shared staging buffers hold {staging.buffer_bytes} bytes, an "
                              f"expert record {self._record_bytes}")
        self._own_staging = staging is None
        self._staging = staging if staging is not None else (
            StagingPool(engine.device, self._record_bytes, num_staging) if nvme is not None else None)
        self._cv = threading.Condition()
        self.map_in, self.publish = map_in, publish
        self._inflight = 0  # loads started and not yet settled (close() waits for them)
        self._issued = itertools.count()  # numbers copies as they are issued (worker or submit_now, one lock)
        self._sweep_queued = False  # a sweep of the pool's stale ranges waits among the link's idle jobs
        self._closed = False
        self._stats = dict.fromkeys(("loads_ok", "loads_failed", "corrupt_detected", "bytes", "failed_after_publish",
                                     "guarded"), 0)  # guarded: copies ordered after a reused slot's old readers
        self.last_error: BaseException | None = None

    def _count(self, key: str, n: int = 1) -> None:
        with self._cv:
            self._stats[key] += n

    def stats(self) -> dict[str, int]:
        """Loads ok / failed, NVMe corruptions caught, bytes, copies failed after publishing (a CUDA error)."""
        with self._cv:
            return dict(self._stats)

    def _begin(self, layer: int, experts: list[int], store: StoreKind) -> tuple[list[_Load], Any, list[int]]:
        """Reserve slots for all of `experts` or none (refusals raise, nothing moves); the loads, the range the
        copies write (the layer's range or the slot window) and each one's byte offset in it."""
        windowed = self.map_in in WINDOWED
        with self._cv:
            if self._closed:
                raise ConfigError("load: the expert loader is closed")
            dsts = self.pool.prepare_loads(layer, experts, via_window=windowed)
            self._inflight += len(experts)
        src, parts = store.value, 1 + (self.map_in == "beside_copy")  # the copy, and the map beside it
        loads = [_Load(layer, e, OpFuture(f"load of expert ({layer}, {e}) from {src}"), parts) for e in experts]
        for ld, mapped in zip(loads, self.pool.mapped(layer, experts), strict=True):
            ld.premapped = mapped
        return loads, dsts[0][0], [off for _t, off in dsts]

    def _abandon(self, loads: list[_Load]) -> None:
        """A submission was refused before any byte moved: give every slot back."""
        for ld in loads:
            self.pool.complete_load(ld.layer, ld.expert, ok=False)
        with self._cv:
            self._inflight -= len(loads)
            self._cv.notify_all()

    def _h2d_request(self, loads: list[_Load], src: Any, dst: Any, segments: list[tuple[int, int, int]],
                     priority: Priority, deadline_s: float | None, guards: list[list[Any]]) -> TransferRequest:
        """One host->device transfer whose segment i fills loads[i] (with map_in="before_copy", maps it first),
        ordered after guards[i] (the work still reading its slot's old expert)."""
        pool = self.pool
        return TransferRequest(
            Link.H2D, TrafficClass.EXPERT, src, dst, priority, deadline_s, segments=segments,
            segment_after=guards if any(guards) else None,
            before_segment=None if self.map_in != "before_copy" else
            (lambda i: None if loads[i].premapped else pool.map_reserved(loads[i].layer, loads[i].expert)),
            on_segment_issued=lambda i, ev: self._step(loads[i], copy_issued=True, event=ev),
            on_segment_done=lambda i, error: self._step(loads[i], copy_end=True, error=error))

    def load(self, layer: int, expert: int, store: StoreKind = StoreKind.PINNED, priority: Priority = Priority.NORMAL,
             deadline_s: float | None = None) -> OpFuture:
        if store is StoreKind.PINNED:
            if self.pinned is None:
                raise ConfigError("load: no pinned store configured")
            return self.load_many(layer, [expert], priority, deadline_s)[0]
        if self.nvme is None:
            raise ConfigError(f"load: no {store.value} store configured")
        nvme = self.nvme
        (ld,), dst, (dst_off,) = self._begin(layer, [expert], store)
        n = self.pool.layout.expert_bytes
        assert self._staging is not None  # there is an NVMe store
        staging = ld.staging = self._staging.take(self._record_bytes)

        def after_disk(h: TransferHandle) -> None:
            if h.error is not None:
                self._step(ld, copy_end=True, error=h.error)
                return
            try:
                nvme.verify(layer, expert, staging.tensor)
            except Exception as exc:  # corruption, or anything else: the load still completes with it
                if isinstance(exc, CorruptDataError):
                    self._count("corrupt_detected")
                self._step(ld, copy_end=True, error=exc)
                return
            try:
                self.engine.submit(self._h2d_request([ld], staging.tensor, dst, [(0, dst_off, n)], priority,
                                                     deadline_s, self.pool.load_guards(layer, [expert])))
            except Exception as exc:
                self._step(ld, copy_end=True, error=exc)

        try:
            self.engine.submit(TransferRequest(
                Link.DISK2H, TrafficClass.EXPERT, nvme.region(layer, expert), staging.tensor, priority,
                deadline_s, on_done=after_disk,
            ))
        except Exception:
            self._give_staging(staging)
            self._abandon([ld])
            raise
        self._start_maps([ld], priority, deadline_s)
        self._queue_sweep()
        return ld.fut

    def load_many(self, layer: int, experts: list[int], priority: Priority = Priority.NORMAL,
                  deadline_s: float | None = None, at_once: bool = False) -> list[OpFuture]:
        """at_once: the caller waits for the whole list (a step's misses): issued whole on this thread
        (`TransferEngine.submit_now`), not queued for the link's worker."""
        return [ld.fut for ld in self._load_many(layer, experts, priority, deadline_s, at_once)]

    def load_many_issued(self, layer: int, experts: list[int], priority: Priority = Priority.NORMAL,
                         deadline_s: float | None = None, at_once: bool = False
                         ) -> tuple[list[OpFuture], list[OpFuture]]:
        """`load_many`, with a second future per expert, done once its copy is issued (the pool knows the
        copy's event: `note_issued`), before its range is mapped: a slot-table reader needs no more."""
        loads = self._load_many(layer, experts, priority, deadline_s, at_once)
        return [ld.fut for ld in loads], [ld.issued for ld in loads]

    def _load_many(self, layer: int, experts: list[int], priority: Priority,
                   deadline_s: float | None, at_once: bool = False) -> list[_Load]:
        """Several experts of one layer from the pinned store, in list order: slots for all or none, one transfer
        of a segment each (issued here with at_once, else queued); beside_copy: one map job at a time follows."""
        if self.pinned is None:
            raise ConfigError("load_many: no pinned store configured")
        if not experts:
            return []
        pinned, n = self.pinned, self.pool.layout.expert_bytes
        loads, dst, dst_offs = self._begin(layer, experts, StoreKind.PINNED)
        listed = loads
        guards = self.pool.load_guards(layer, experts)
        segments = [(src_off, off, n) for src_off, off in zip(pinned.offsets(layer, experts), dst_offs, strict=True)]
        if any(guards):  # copies that must wait for a reused slot's readers go last: the rest need not wait
            self._count("guarded", sum(map(bool, guards)))
            idx = sorted(range(len(loads)), key=lambda i: bool(guards[i]))
            loads, segments, guards = [loads[i] for i in idx], [segments[i] for i in idx], [guards[i] for i in idx]
        try:
            req = self._h2d_request(loads, pinned.buffer, dst, segments, priority, deadline_s, guards)
            (self.engine.submit_now if at_once else self.engine.submit)(req)  # at_once: issued on this thread
        except Exception:  # refused before any byte moved: give every slot back
            self._abandon(loads)
            raise
        self._start_maps(loads, priority, deadline_s)
        self._queue_sweep()
        return listed

    def _step(self, ld: _Load, *, copy_issued: bool = False, copy_end: bool = False, map_end: bool = False,
              error: BaseException | None = None, event: Any = None) -> None:
        """A part of a load ended (on the link's worker, its retire thread or a submit_now caller): publish it once
        every part before publishing has, give the slot back on failure once the copy is over, settle it at the
        end. Whatever fails here, the future completes exactly once, the slot is never left LOADING, it is counted."""
        with ld.lock:
            if event is not None:
                ld.event, ld.order = event, next(self._issued)  # in issue order: under the link's issue lock
            if copy_issued and not ld.issued.done():
                self.pool.note_issued(ld.layer, ld.expert, ld.event, None if ld.order is None else (self, ld.order))
                ld.issued.set_result(None)
            if error is not None:
                if ld.error is None:
                    ld.error = error
                elif error is not ld.error:
                    ld.error.add_note(f"another part of the load failed too: {error!r}")
            if copy_end:
                ld.copy_open = False
            if not ld.copy_signaled and ((copy_issued and self.publish == "issued") or copy_end):
                ld.copy_signaled = True
                ld.parts_left -= 1
            if map_end:
                ld.parts_left -= 1
            if ld.concluded:
                if copy_end and error is not None:  # publish="issued": the copy failed after publishing
                    self._failed_after_publish(ld, error)
            elif ld.parts_left == 0:
                if ld.error is None:
                    self._publish(ld)
                if ld.error is not None and not ld.copy_open:
                    self._refuse(ld)
            if ld.concluded and not ld.copy_open and not ld.settled:
                ld.settled = True
                self._settle(ld)

    def _publish(self, ld: _Load) -> None:
        try:
            self.pool.complete_load(ld.layer, ld.expert, True, event=ld.event,
                                    order=None if ld.order is None else (self, ld.order))
        except Exception as exc:
            ld.error = exc
            return
        ld.concluded = True
        with self._cv:
            self._stats["loads_ok"] += 1
            self._stats["bytes"] += self.pool.layout.expert_bytes
        ld.fut.set_result(None)

    def _refuse(self, ld: _Load) -> None:
        error = ld.error
        assert error is not None
        ld.concluded = True
        if not ld.issued.done():
            ld.issued.set_result(error)
        try:
            if self.pool.state(ld.layer, ld.expert) is ExpertState.LOADING:
                self.pool.complete_load(ld.layer, ld.expert, ok=False)
        except Exception as again:
            error.add_note(f"giving the slot back failed too: {again!r}")
        with self._cv:
            self._stats["loads_failed"] += 1
            self.last_error = error
        ld.fut.set_result(error)

    def _failed_after_publish(self, ld: _Load, error: BaseException) -> None:
        """The copy of a published expert failed (a CUDA error, which also poisons the context): counted, kept
        in `last_error`, and the expert is unmapped if its readers allow it."""
        with self._cv:
            self._stats["loads_failed"] += 1
            self._stats["failed_after_publish"] += 1
            self.last_error = error
        try:
            self.pool.unmap(ld.layer, ld.expert, wait=False)
        except Exception as again:
            error.add_note(f"unmapping the published expert failed too: {again!r}")

    def _settle(self, ld: _Load) -> None:
        if ld.staging is not None:
            self._give_staging(ld.staging)
        with self._cv:
            self._inflight -= 1
            self._cv.notify_all()

    def _start_maps(self, loads: list[_Load], priority: Priority, deadline_s: float | None, i: int = 0) -> None:
        """map_in="beside_copy": map the expert ranges beside their copies, as idle jobs of the host->device worker: one
        job maps loads[i]'s range and queues the next, so a list costs one queued job at a time and a more urgent
        list's maps still go first. Ranges that map their slot already need none."""
        if self.map_in != "beside_copy":
            return
        if i == 0 and any(ld.premapped for ld in loads):
            for ld in (ld for ld in loads if ld.premapped):
                self._step(ld, map_end=True)
            if not (loads := [ld for ld in loads if not ld.premapped]):
                return

        def job() -> None:
            ld = loads[i]
            try:
                try:
                    self.pool.map_reserved(ld.layer, ld.expert)
                except Exception as exc:
                    self._step(ld, map_end=True, error=exc)
                else:
                    self._step(ld, map_end=True)
            finally:  # the rest of the list is mapped whatever happened to this one
                if i + 1 < len(loads):
                    self._start_maps(loads, priority, deadline_s, i + 1)

        def fail(exc: BaseException) -> None:
            for ld in loads[i:]:
                self._step(ld, map_end=True, error=exc)

        try:
            self.engine.submit_idle(Link.H2D, job, priority, deadline_s)
        except Exception as exc:  # the copies are under way: these loads complete with this error once they land
            fail(exc)

    def _queue_sweep(self) -> None:
        """`sweep_stale` as an idle job of the link's worker at the lowest priority (after the maps queued before),
        one queued at a time; what it leaves (readers still running) a later one unmaps, or the pool's close."""
        if not self.pool.num_stale:
            return
        with self._cv:
            if self._sweep_queued:
                return
            self._sweep_queued = True

        def job() -> None:
            with self._cv:
                self._sweep_queued = False
            self.pool.sweep_stale()

        try:
            self.engine.submit_idle(Link.H2D, job, Priority.LOW)
        except Exception:  # closing: the pool's close unmaps what is left
            with self._cv:
                self._sweep_queued = False

    def _give_staging(self, buf: StagingLease) -> None:
        self._staging.give(buf)  # type: ignore[union-attr]  # there is an NVMe store

    def close(self, timeout_s: float = 60.0) -> None:
        """Refuse new loads, wait for those in flight (the transfer engine must still run, and runs their map
        jobs), then free staging. Raises TimeoutError (staging kept) if loads are still in flight after timeout_s."""
        with self._cv:
            self._closed = True
            if not self._cv.wait_for(lambda: self._inflight == 0, timeout_s):
                raise TimeoutError(f"expert loader close: {self._inflight} load(s) still in flight after {timeout_s} s")
        if self._own_staging and self._staging is not None:
            self._staging.close()
        self._staging = None
