"""Moves KV block bytes between tiers through the transfer engine (inference process).

The byte-moving half of the KV tiers, modelled on vLLM v1 `kv_offload`'s worker/handler: the manager
reserves (`prepare_move`), this handler copies, then reports `complete_move(ok)`. Every copy is a KV-class
request on the engine's links: GPU<->CPU over H2D/D2H, CPU<->NVMe over H2DISK/DISK2H, GPU<->NVMe in two
hops through a page-aligned staging buffer. Hops are chained by the engine's `on_done` callbacks, so no
link worker ever blocks on another link. Checksums (xxh3 of host bytes) are taken when bytes reach the host
bound for a tier in `manager.verify_tiers` and verified when they come from one; a mismatch fails the move and
the block stays where it was. Never decides which block goes where, never hashes device memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tierplan.runtime.checksum import checksum
from tierplan.runtime.device import Event
from tierplan.runtime.errors import BusyError, ConfigError, CorruptDataError, TransferError
from tierplan.runtime.future import OpFuture
from tierplan.runtime.kv.hops import HOP_PLANS, End
from tierplan.runtime.kv.manager import KVBlockManager
from tierplan.runtime.kv.spec import KVBlockSpec, KVMove, Tier
from tierplan.runtime.kv.stores import KVTierStores
from tierplan.runtime.staging import StagingClosed, StagingLease, StagingPool
from tierplan.runtime.transfer import (
    Buffer,
    Link,
    Priority,
    TrafficClass,
    TransferEngine,
    TransferHandle,
    TransferRequest,
)

PAIRS = tuple(f"{a.value}->{b.value}" for a in Tier for b in Tier if a is not b)
_SEGMENTED = frozenset({(Tier.GPU, Tier.CPU), (Tier.CPU, Tier.GPU)})  # one memory link: a list is one request


class KVMoveFuture(OpFuture):
    """One asynchronous block move: `wait()` returns once the block sits at `move.dst`, or raises the
    move's error if it stayed at `move.src`."""

    def __init__(self, move: KVMove) -> None:
        super().__init__(f"KV move of block {move.block_id} ({move.pair})")
        self.move = move



@dataclass
class _Hop:
    link: Link
    src: Buffer
    dst: Buffer
    after: Event | None = None  # device work that must finish before the copy reads `src`
    lands_on_host: torch.Tensor | None = None  # checksummed or verified once this hop is done


@dataclass
class _MoveJob:
    move: KVMove
    future: KVMoveFuture
    priority: Priority
    deadline_s: float | None
    staging: StagingLease | None = None
    hops: list[_Hop] = field(default_factory=list)


class KVTransferHandler:
    """Synchronous `write`/`read` of whole blocks and asynchronous `move` between tiers. Staging buffers come
    from `staging` when given (a pool shared with the expert loader, closed by its owner), else from a pool
    of `num_staging` block-sized buffers of its own."""

    def __init__(
        self, manager: KVBlockManager, stores: KVTierStores, engine: TransferEngine, num_staging: int = 8,
        staging: StagingPool | None = None,
    ) -> None:
        if isinstance(num_staging, bool) or not isinstance(num_staging, int) or num_staging < 1:
            raise ConfigError(f"KVTransferHandler: num_staging must be an int >= 1, got {num_staging!r}")
        if manager.capacity != stores.capacity:
            raise ConfigError(
                f"KVTransferHandler: manager capacity {_caps(manager.capacity)} != stores capacity "
                f"{_caps(stores.capacity)}"
            )
        if engine.device.torch_device != stores.device.torch_device:
            raise ConfigError(
                f"KVTransferHandler: engine runs on {engine.device.torch_device}, "
                f"stores live on {stores.device.torch_device}"
            )
        self.manager = manager
        self.stores = stores
        self.engine = engine
        self.block_bytes = stores.block_bytes
        if staging is not None and staging.buffer_bytes < self.block_bytes:
            raise ConfigError(f"KVTransferHandler: the shared staging buffers hold {staging.buffer_bytes} bytes, a "
                              f"KV block {self.block_bytes}")
        self._own_staging = staging is None
        self._staging = staging or StagingPool(stores.device, self.block_bytes, num_staging)
        self._staging_out = 0  # buffers taken (or being waited for) and not given back
        self._cv = threading.Condition()  # guards _staging_out, _num_inflight, _closed
        self._num_inflight = 0
        self._closed = False
        self._staging_closed = False
        self._stats_lock = threading.Lock()
        self._moves_ok = 0
        self._moves_failed = 0
        self._corrupt_detected = 0
        self._bytes_by_pair = dict.fromkeys(PAIRS, 0)

    # ---- staging ------------------------------------------------------------------------------------
    def _take_staging(self, what: str) -> StagingLease:
        """A free staging buffer; waits for one (moves in flight always give theirs back)."""
        with self._cv:
            if self._closed:
                raise ConfigError(f"{what}: KVTransferHandler is closed")
            self._staging_out += 1  # counted before waiting: close() waits for it either way
        try:
            return self._staging.take(self.block_bytes, refuse=lambda: self._closed)
        except StagingClosed:
            self._staging_returned()
            raise ConfigError(f"{what}: KVTransferHandler is closed") from None

    def _give_staging(self, buf: StagingLease) -> None:
        self._staging.give(buf)
        self._staging_returned()

    def _staging_returned(self) -> None:
        with self._cv:
            self._staging_out -= 1
            self._cv.notify_all()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ConfigError(f"{what}: KVTransferHandler is closed")

    # ---- checksums ----------------------------------------------------------------------------------
    def _verify(self, block_id: int, spec: KVBlockSpec, expected: int, data: torch.Tensor, what: str) -> None:
        got = checksum(data)
        if got != expected:
            with self._stats_lock:
                self._corrupt_detected += 1
            raise CorruptDataError(
                f"{what}: KV block {block_id} on tier {spec.tier.value} index {spec.index}: checksum "
                f"mismatch, expected {expected:#018x}, got {got:#018x}"
            )

    def _check_host_bytes(self, move: KVMove, data: Callable[[], torch.Tensor]) -> None:
        """Bytes of a moving block are on the host (`data()` views them): verify them if `src` is a verified
        tier; record their checksum if they have none and `dst` is one (the only place it will be compared). A
        block bound for a tier nobody verifies is not hashed until its bytes next reach the host on the way to
        one: a plan's cut spilled ~16,600 dirty GPU blocks to the CPU, and hashing each on the link worker (xxh3
        at ~8 GB/s on the CI box, ~34 us per 256 KiB block) was a share of the 75 us a block the cut took on the
        H100 host, for checksums that nothing read (bench/results/phase_h200.md, session 29). The view is made
        only to hash or verify: one a block cost a CPU -> GPU list ~7 us a block on that host (30 us a block to
        submit against 9 the other way, bench/results/h200/kvmoves_run01)."""
        verified = self.manager.verify_tiers
        if not verified:
            return
        expected = self.manager.checksum(move.block_id)
        if expected is None:
            if move.dst.tier in verified:
                self.manager.set_checksum(move.block_id, checksum(data()))
        elif move.src.tier in verified:
            self._verify(move.block_id, move.src, expected, data(), f"move {move.pair}")

    # ---- synchronous block I/O ----------------------------------------------------------------------
    def _copy(self, link: Link, src: Buffer, dst: Buffer, after: Event | None = None) -> None:
        self.engine.submit(TransferRequest(link, TrafficClass.KV, src, dst, after=after)).wait()

    def write(self, block_id: int, data: torch.Tensor) -> None:
        """Copy `data` (a CPU uint8 tensor of block_bytes) into the block wherever it lives; record its checksum."""
        if (
            not isinstance(data, torch.Tensor)
            or data.device.type != "cpu"
            or data.dtype != torch.uint8
            or data.numel() != self.block_bytes
        ):
            got = (
                f"{data.device.type} {data.dtype} tensor of {data.numel()} elements"
                if isinstance(data, torch.Tensor)
                else type(data).__name__
            )
            raise ConfigError(
                f"write of KV block {block_id}: expected a CPU uint8 tensor of {self.block_bytes} bytes, got {got}"
            )
        self._check_open(f"write of KV block {block_id}")
        flat = data.reshape(-1).contiguous()  # [B]
        self.manager.acquire(block_id)  # no move and no free while we copy
        try:
            spec = self.manager.location(block_id)
            value = checksum(flat)
            if spec.tier is Tier.CPU:
                self.stores.memory(spec).copy_(flat)
            else:
                buf = self._take_staging(f"write of KV block {block_id}")
                try:
                    buf.tensor.copy_(flat)
                    if spec.tier is Tier.GPU:  # after the kernels already queued that may read this index
                        self._copy(Link.H2D, buf.tensor, self.stores.memory(spec), self.stores.device.record_event())
                    else:
                        self._copy(Link.H2DISK, buf.tensor, self.stores.region(spec))
                finally:
                    self._give_staging(buf)
            self.manager.set_checksum(block_id, value)  # only once the bytes are in place
        finally:
            self.manager.release(block_id)

    def read(self, block_id: int) -> torch.Tensor:
        """A host copy [block_bytes] of the block; verified when its tier is in `manager.verify_tiers`."""
        self._check_open(f"read of KV block {block_id}")
        self.manager.acquire(block_id)
        try:
            spec = self.manager.location(block_id)
            expected = self.manager.checksum(block_id)
            if spec.tier is Tier.CPU:
                out = self.stores.memory(spec).clone()  # [B]
            else:
                buf = self._take_staging(f"read of KV block {block_id}")
                try:
                    if spec.tier is Tier.GPU:
                        src = self.stores.memory(spec)
                        self._copy(Link.D2H, src, buf.tensor, after=self.stores.device.record_event())
                    else:
                        self._copy(Link.DISK2H, self.stores.region(spec), buf.tensor)
                    out = buf.tensor.clone()  # [B]
                finally:
                    self._give_staging(buf)
        finally:
            self.manager.release(block_id)
        if expected is not None and spec.tier in self.manager.verify_tiers:
            self._verify(block_id, spec, expected, out, "read")
        return out

    def mark_dirty(self, block_id: int) -> None:
        """The engine wrote into the (GPU) block: its recorded checksum no longer holds."""
        if self.manager.is_moving(block_id):
            raise BusyError(f"mark_dirty: KV block {block_id} is in flight; writing into it races the move")
        self.manager.set_checksum(block_id, None)

    # ---- asynchronous moves -------------------------------------------------------------------------
    def _endpoint(self, end: End, job: _MoveJob) -> Buffer:
        """A hop's source or destination: the move's source or destination block (memory, or a file region on
        NVMe), or the move's staging buffer (taken on first use)."""
        if end is End.STAGE:
            if job.staging is None:
                job.staging = self._take_staging(f"move of KV block {job.move.block_id}")
            return job.staging.tensor  # [B]
        spec = job.move.src if end is End.SRC else job.move.dst
        return self.stores.region(spec) if spec.tier is Tier.NVME else self.stores.memory(spec)

    def _plan(self, job: _MoveJob) -> None:
        # Order every device-side copy after the work already queued on the caller's stream: a copy out of
        # the GPU after the kernels that wrote the block, a copy into it after the kernels that still read
        # the (freed, now reused) index.
        src, dst = job.move.src, job.move.dst
        after = self.stores.device.record_event() if Tier.GPU in (src.tier, dst.tier) else None
        for hop in HOP_PLANS[(src.tier, dst.tier)]:
            hop_dst = self._endpoint(hop.dst, job)
            job.hops.append(_Hop(hop.link, self._endpoint(hop.src, job), hop_dst, after if hop.after else None,
                                 hop_dst if hop.lands_on_host else None))  # type: ignore[arg-type]

    def move(
        self, block_id: int, dst: Tier, priority: Priority = Priority.NORMAL, deadline_s: float | None = None
    ) -> KVMoveFuture:
        """Start moving the block to `dst`; refusals raise here with nothing queued, failures come from wait().

        `deadline_s` is absolute, on the engine's clock. May wait for a free staging buffer (GPU<->NVMe).
        """
        self._check_open(f"move of KV block {block_id}")
        return self._start(self.manager.prepare_move(block_id, dst), Priority(priority), deadline_s)

    def _start(self, move: KVMove, priority: Priority, deadline_s: float | None) -> KVMoveFuture:
        """Run a reserved move hop by hop; a refusal (closed, no staging) undoes the reservation and raises."""
        job = _MoveJob(move, KVMoveFuture(move), priority, deadline_s)
        with self._cv:  # counted before any byte moves, so close() waits for it
            closed = self._closed
            self._num_inflight += 0 if closed else 1
        try:
            if closed:
                raise ConfigError(f"move of KV block {move.block_id}: KVTransferHandler is closed")
            self._plan(job)
        except BaseException:
            if job.staging is not None:
                self._give_staging(job.staging)
            self.manager.complete_move(move, ok=False)  # undo the reservation: the refusal changes nothing
            if not closed:
                with self._cv:
                    self._num_inflight -= 1
                    self._cv.notify_all()
            raise
        try:
            if move.src.tier is Tier.CPU:  # the bytes are on the host already: hash or verify them now
                self._check_host_bytes(move, lambda: self.stores.memory(move.src))
            self._submit_hop(job, 0)
        except Exception as exc:
            self._finish(job, exc)
        return job.future

    def move_list(self, block_ids: list[int], dst: Tier, priority: Priority = Priority.NORMAL,
                  deadline_s: float | None = None) -> list[KVMoveFuture]:
        """Start moving every listed block to `dst`: a future each, in list order. A block that cannot be
        reserved (busy, already there, no room) raises here and undoes the list's reservations, nothing queued;
        later failures (a copy, a checksum, a closed handler) come from that block's wait(), the block staying
        where it was while the others land. The blocks of a memory pair (GPU->CPU, CPU->GPU) go as one request,
        a segment a block: one device event, one queue entry and one hand-off for the list, where a request a
        block paid its own round trip. Moves through NVMe go hop by hop, as `move` does."""
        self._check_open(f"move of {len(block_ids)} KV blocks")
        priority = Priority(priority)
        moves: list[KVMove] = []
        try:
            for b in block_ids:
                moves.append(self.manager.prepare_move(b, dst))
        except BaseException:
            for m in reversed(moves):  # the free indices back in the order they were taken from
                self.manager.complete_move(m, ok=False)
            raise
        futures: dict[int, KVMoveFuture] = {}
        by_pair: dict[tuple[Tier, Tier], list[KVMove]] = {}
        for m in moves:
            by_pair.setdefault((m.src.tier, m.dst.tier), []).append(m)
        started: set[int] = set()  # blocks whose move has a future (it ends in `_finish`, or was refused and undone)
        try:
            for pair, group in by_pair.items():
                if pair in _SEGMENTED:
                    jobs = self._jobs(group, priority, deadline_s)
                    started.update(m.block_id for m in group)
                    self._submit_segmented(jobs)
                    futures.update((job.move.block_id, job.future) for job in jobs)
                    continue
                for m in group:
                    started.add(m.block_id)
                    try:
                        futures[m.block_id] = self._start(m, priority, deadline_s)
                    except Exception as exc:  # refused (undone) after the list's others were queued: its failure
                        futures[m.block_id] = failed = KVMoveFuture(m)
                        failed.set_result(exc)
                        with self._stats_lock:
                            self._moves_failed += 1
        except BaseException:  # e.g. interrupted waiting for staging: the moves not started give their reservation back
            for m in reversed(moves):
                if m.block_id not in started:
                    self.manager.complete_move(m, ok=False)
            raise
        return [futures[b] for b in block_ids]

    def _jobs(self, moves: list[KVMove], priority: Priority, deadline_s: float | None) -> list[_MoveJob]:
        """A job each for reserved moves, counted in flight (close() waits for them; each ends in `_finish`)."""
        jobs = [_MoveJob(m, KVMoveFuture(m), priority, deadline_s) for m in moves]
        with self._cv:
            closed = self._closed
            self._num_inflight += len(jobs)
        if closed:
            for job in jobs:
                self._finish(job, ConfigError(f"move of KV block {job.move.block_id}: KVTransferHandler is closed"))
        return jobs

    def _submit_segmented(self, jobs: list[_MoveJob]) -> None:
        """One request for single-hop memory moves of one pair, a segment a job."""
        jobs = [job for job in jobs if not job.future.done()]
        if jobs and jobs[0].move.src.tier is Tier.CPU:  # the bytes are on the host already: hash or verify them
            jobs = [job for job in jobs if self._host_bytes_ok(job)]
        if not jobs:
            return
        src_tier, dst_tier = jobs[0].move.src.tier, jobs[0].move.dst.tier
        (hop,) = HOP_PLANS[(src_tier, dst_tier)]
        b = self.block_bytes
        try:
            source, landed = self.stores.tier_tensor(src_tier), self.stores.tier_tensor(dst_tier)  # [N, B] each
        except Exception as exc:
            for job in jobs:
                self._finish(job, exc)
            return

        def segment_done(i: int, error: BaseException | None) -> None:  # on the link's worker or retire thread
            job = jobs[i]
            if error is not None:
                error = _transfer_error(job.move, hop.link, error)
            elif hop.lands_on_host:
                try:
                    self._check_host_bytes(job.move, lambda: landed[job.move.dst.index])
                except Exception as exc:
                    error = exc
            self._finish(job, error)

        try:
            self.engine.submit(TransferRequest(
                hop.link, TrafficClass.KV, source.view(-1), landed.view(-1),
                priority=jobs[0].priority, deadline_s=jobs[0].deadline_s, after=self.stores.device.record_event(),
                segments=[(job.move.src.index * b, job.move.dst.index * b, b) for job in jobs],
                on_segment_done=segment_done,
            ))
        except Exception as exc:  # nothing queued: every block stays where it was
            for job in jobs:
                self._finish(job, exc)

    def _host_bytes_ok(self, job: _MoveJob) -> bool:
        try:
            self._check_host_bytes(job.move, lambda: self.stores.memory(job.move.src))
        except Exception as exc:
            self._finish(job, exc)
            return False
        return True

    def _submit_hop(self, job: _MoveJob, i: int) -> None:
        hop = job.hops[i]
        req = TransferRequest(
            hop.link,
            TrafficClass.KV,
            hop.src,
            hop.dst,
            priority=job.priority,
            deadline_s=job.deadline_s,
            after=hop.after,
            on_done=lambda h: self._hop_done(job, i, h),
        )
        self.engine.submit(req)

    def _hop_done(self, job: _MoveJob, i: int, h: TransferHandle) -> None:
        """Runs on the link's worker or retire thread: check what landed, then queue the next hop or finish."""
        try:
            if h.error is not None:  # h.ok is still False inside on_done; the error is what counts
                raise _transfer_error(job.move, h.request.link, h.error)
            hop = job.hops[i]
            landed = hop.lands_on_host
            if landed is not None:
                self._check_host_bytes(job.move, lambda: landed)
            if i + 1 < len(job.hops):
                self._submit_hop(job, i + 1)
                return
        except Exception as exc:
            self._finish(job, exc)
            return
        self._finish(job, None)

    def _finish(self, job: _MoveJob, error: BaseException | None) -> None:
        try:
            self.manager.complete_move(job.move, ok=error is None)
        except Exception as exc:  # only if the books were changed behind our back; keep the first error
            error = error if error is not None else exc
        finally:
            if job.staging is not None:
                self._give_staging(job.staging)
                job.staging = None
            with self._stats_lock:
                if error is None:
                    self._moves_ok += 1
                    self._bytes_by_pair[job.move.pair] += self.block_bytes
                else:
                    self._moves_failed += 1
            with self._cv:
                self._num_inflight -= 1
                self._cv.notify_all()
            job.future.set_result(error)

    # ---- introspection and shutdown -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """moves_ok, moves_failed, corrupt_detected (reads and moves), bytes_by_pair ("gpu->cpu": bytes)."""
        with self._cv:
            num_inflight, num_staging_free = self._num_inflight, self._staging.num_free
        with self._stats_lock:
            return {
                "moves_ok": self._moves_ok,
                "moves_failed": self._moves_failed,
                "corrupt_detected": self._corrupt_detected,
                "bytes_by_pair": dict(self._bytes_by_pair),
                "moves_in_flight": num_inflight,
                "num_staging_free": num_staging_free,
            }

    def close(self, timeout_s: float | None = None) -> None:
        """Refuse new work, wait for moves in flight and staging to come back, then release staging memory.

        BusyError if that takes longer than `timeout_s` (the handler stays closed; call again to finish).
        """
        end_s = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            self._closed = True
        self._staging.wake()  # staging waiters wake up and refuse
        with self._cv:
            while self._num_inflight or self._staging_out:
                left_s = None if end_s is None else end_s - time.monotonic()
                if left_s is not None and left_s <= 0:
                    raise BusyError(
                        f"KVTransferHandler.close: {self._num_inflight} move(s) in flight, "
                        f"{self._staging_out} staging buffer(s) out "
                        f"after {timeout_s} s"
                    )
                self._cv.wait(left_s)
            if self._staging_closed:
                return
            self._staging_closed = True
        if self._own_staging:
            self._staging.close()

    def __enter__(self) -> KVTransferHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _transfer_error(move: KVMove, link: Link, error: BaseException) -> TransferError:
    """A move's failed copy, naming the block, its ends and the link (caused by the link's error)."""
    out = TransferError(f"move {move.pair} of KV block {move.block_id} ({move.src} -> {move.dst}): {link.value} "
                        f"transfer failed: {error}")
    out.__cause__ = error
    return out


def _caps(capacity: dict[Tier, int]) -> dict[str, int]:
    return {t.value: n for t, n in capacity.items()}
