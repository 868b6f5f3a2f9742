"""Evictions that return at once (CPU twin): a slot given back with `ExpertSlotPool.release` while a kernel still
reads its old expert is written by nothing before that kernel ends (the loader's copy waits on the link, a direct
`prepare_load` waits for it), its range stays mapped until then and is unmapped by a sweep or before its next map;
and `wait_ready` orders a reader once per list of numbered loads, never again for loads it is ordered after."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.runtime.conftest import MIXED, STRIDE, T, is_poison, load, stride_view
from tierplan.runtime.checksum import checksum
from tierplan.runtime.device import Device, HostEvent
from tierplan.runtime.errors import CorruptDataError
from tierplan.runtime.memory.host import HostBackend
from tierplan.runtime.memory.slots import ExpertSlotPool, ExpertState
from tierplan.runtime.transfer import TransferEngine
from tierplan.runtime.weights.loader import ExpertLoadHandler, StoreKind
from tierplan.runtime.weights.sources import SyntheticExpertSource
from tierplan.runtime.weights.stores import NvmeExpertStore, PinnedExpertStore


class Kernel(HostEvent):
    """A queued kernel still reading a slot: done once set; `waited` says someone has begun to wait for it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def synchronize(self, timeout_s: float | None = None) -> None:
        self.waited.set()
        super().synchronize(timeout_s)


@pytest.fixture()
def dev() -> Device:
    return Device("cpu")


@contextmanager
def one_slot(tmp_path: Path, dev: Device, kernel: Kernel,
             slot_window: bool) -> Iterator[tuple[PinnedExpertStore, NvmeExpertStore, ExpertSlotPool]]:
    """One layer of 4 experts over a single slot, with pinned and NVMe stores of them; `kernel` is let go before
    the pool closes (close waits for readers), on failure too."""
    src = SyntheticExpertSource(MIXED, 1, 4, seed=3)
    pinned = PinnedExpertStore(dev, src)
    nvme = NvmeExpertStore.build(tmp_path / "e.bin", src, dev)
    pool = ExpertSlotPool(HostBackend(), dev, 1, 4, MIXED.num_bytes, 1, slot_window=slot_window)
    try:
        yield pinned, nvme, pool
    finally:
        kernel.set()
        pool.close()
        pinned.close()
        nvme.close()


@pytest.mark.parametrize("store", [StoreKind.PINNED, StoreKind.NVME])
@pytest.mark.parametrize("map_in", ["beside_copy", "before_copy"])
def test_a_released_slot_is_copied_into_only_after_the_kernels_reading_its_old_expert(
        tmp_path: Path, dev: Device, map_in: str, store: StoreKind) -> None:
    kernel = Kernel()
    with one_slot(tmp_path, dev, kernel, slot_window=map_in == "beside_copy") as (pinned, nvme, pool):
        with TransferEngine(dev) as eng:
            loader = ExpertLoadHandler(pool, eng, pinned, nvme, map_in=map_in)
            loader.load_many(0, [0])[0].wait(T)
            old = pool.expert_tensor(0, 0).clone()
            pool.record_read(0, [0], kernel)
            pool.release(0, 0)  # returns with the kernel still running: nothing waited for it
            assert not kernel.waited.is_set()
            assert pool.state(0, 0) is ExpertState.ABSENT and pool.num_free_slots == 1 and pool.num_stale == 1
            fut = loader.load(0, 1, store)  # the one slot: expert 0's, still read
            assert kernel.waited.wait(T), "the copy into the reused slot never waited for the old expert's reader"
            # The copy is held on the link; the slot (seen through expert 0's range, still mapped) is untouched.
            assert torch.equal(stride_view(pool, 0, 0)[: MIXED.num_bytes], old)
            assert not fut.done()
            kernel.set()
            fut.wait(T)
            pool.wait_ready(0, [1])
            assert checksum(pool.expert_tensor(0, 1)) == pinned.checksum(0, 1)
            loader.close()
        assert pool.sweep_stale() == 0 and pool.num_stale == 1  # released this epoch: kept for a reload
        pool.ranges.epoch += 2  # two steps on (the engine counts them)
        assert pool.sweep_stale() == 1 and pool.num_stale == 0
        pool.check_invariants()


@pytest.mark.parametrize("failing", ["another expert", "the released expert (its kept range)"])
def test_a_load_that_fails_in_a_reused_slot_keeps_the_old_readers_guards(tmp_path: Path, dev: Device,
                                                                        failing: str) -> None:
    """A failed load (a corrupt NVMe record) gives the slot back with its guards: the next copy into it still
    waits for the kernel reading the slot's old expert, and no range is unmapped under that kernel."""
    import os

    kernel = Kernel()
    with one_slot(tmp_path, dev, kernel, slot_window=True) as (pinned, nvme, pool):
        with TransferEngine(dev) as eng:
            loader = ExpertLoadHandler(pool, eng, pinned, nvme)
            loader.load_many(0, [0])[0].wait(T)
            old = pool.expert_tensor(0, 0).clone()
            pool.record_read(0, [0], kernel)
            pool.release(0, 0)
            bad = 0 if failing.startswith("the released") else 1
            off = nvme.region(0, bad).offset_bytes + 100
            fd = os.open(tmp_path / "e.bin", os.O_RDWR)
            os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 1]), off)
            os.close(fd)
            with pytest.raises(CorruptDataError):
                loader.load(0, bad, StoreKind.NVME).wait(T)
            assert not kernel.query() and pool.num_stale >= 1  # expert 0's range: still mapped under its reader
            fut = loader.load_many(0, [2])[0]
            assert kernel.waited.wait(T), "the copy after a failed load did not wait for the slot's old reader"
            assert not fut.done() and torch.equal(stride_view(pool, 0, 0)[: MIXED.num_bytes], old)
            kernel.set()
            fut.wait(T)
            pool.wait_ready(0, [2])
            assert checksum(pool.expert_tensor(0, 2)) == pinned.checksum(0, 2)
            loader.close()
        pool.check_invariants()


def test_release_leaves_the_range_mapped_until_its_readers_finish_then_a_sweep_poisons_it(env) -> None:
    pool = env.pool()  # poisoned absent ranges, 4 slots
    data = torch.arange(STRIDE, dtype=torch.int64).to(torch.uint8)[:5000]
    load(pool, 0, 2, data)
    kernel = Kernel()
    env.events.append(kernel)
    pool.record_read(0, [2], kernel)
    pool.release(0, 2)
    assert pool.state(0, 2) is ExpertState.ABSENT and pool.num_free_slots == 4
    assert pool.sweep_stale() == 0 and pool.num_stale == 1  # still read: stays mapped
    kernel.set()
    assert pool.sweep_stale() == 1 and pool.num_stale == 0
    assert is_poison(stride_view(pool, 0, 2))  # I5 once swept
    pool.check_invariants()


def test_a_poisoned_pool_unmaps_a_released_range_nothing_reads_at_once(env) -> None:
    pool = env.pool()  # poisoned absent ranges
    load(pool, 0, 1, torch.full((5000,), 9, dtype=torch.uint8))
    pool.release(0, 1)  # no reader recorded
    assert pool.num_stale == 0 and is_poison(stride_view(pool, 0, 1))  # I5 without waiting for a sweep
    pool.check_invariants()


def test_prepare_load_of_a_released_slot_waits_for_the_old_readers(env) -> None:
    pool = env.pool()
    for e in range(4):  # every slot bound
        load(pool, 0, e, torch.full((5000,), e, dtype=torch.uint8))
    kernel = Kernel()
    env.events.append(kernel)
    pool.record_read(0, [1], kernel)
    pool.release(0, 1)
    got: list[torch.Tensor] = []
    th = threading.Thread(target=lambda: got.append(pool.prepare_load(1, 0)))
    th.start()
    assert kernel.waited.wait(T)
    assert not got  # the caller would write the slot at once: not before the kernel ends
    kernel.set()
    th.join(T)
    assert got and pool.state(1, 0) is ExpertState.LOADING


def test_an_expert_reloaded_while_its_old_range_is_still_mapped_is_remapped_after_its_readers(env) -> None:
    pool = env.pool(slot_window=True)
    load(pool, 0, 3, torch.full((5000,), 7, dtype=torch.uint8))
    kernel = Kernel()
    env.events.append(kernel)
    pool.record_read(0, [3], kernel)
    pool.release(0, 3)
    pool.prepare_loads(0, [3], via_window=True)
    th = threading.Thread(target=pool.map_reserved, args=(0, 3))
    th.start()
    assert kernel.waited.wait(T)
    kernel.set()
    th.join(T)
    assert not th.is_alive() and pool.num_stale == 0 and pool.ranges.num_forced == 1
    pool.complete_load(0, 3, True)
    pool.check_invariants()


def test_wait_ready_waits_once_per_list_of_numbered_loads_and_never_again(env, monkeypatch) -> None:
    pool = env.pool()
    waited: list[HostEvent] = []
    monkeypatch.setattr(pool.device, "stream_wait", lambda ev, stream=None: waited.append(ev))
    src_a, src_b = object(), object()
    evs = [HostEvent(done=True) for _ in range(4)]
    for e, order in enumerate([(src_a, 0), (src_a, 1), (src_b, 0), None]):  # (0, 3): a load with no order
        pool.prepare_load(0, e)
        pool.complete_load(0, e, True, evs[e], order=order)
    pool.wait_ready(0, [0, 1, 2])
    assert waited == [evs[1], evs[2]]  # the last of each source's list
    waited.clear()
    pool.wait_ready(0, [0, 1])
    pool.wait_ready(0, [1, 2])
    assert waited == [] and pool.ready_waits == 2
    pool.wait_ready(0, [3])  # waited for on its own, each time
    pool.wait_ready(0, [0, 3])
    assert waited == [evs[3], evs[3]]


def test_lru_victims_walked_from_the_oldest_end_match_a_full_ranking(dev: Device) -> None:
    """The default LRU picks its victims by walking the recency books and stopping early; any other order ranks
    every candidate. With an order that ranks like LRU but is not the default object, the same random requests
    (experts loaded around the class and released around it included) leave the same experts resident, each
    reading its own bytes, also where a reload took the slot its released range still mapped (no remap)."""
    import random

    from tierplan.runtime.engine.experts import OnDemandExperts

    rigs = []
    for order in (None, lambda cands: list(cands)):
        pinned = PinnedExpertStore(dev, SyntheticExpertSource(MIXED, 3, 6, seed=4))
        pool = ExpertSlotPool(HostBackend(), dev, 3, 6, MIXED.num_bytes, 7, slot_window=True)
        eng = TransferEngine(dev)
        loader = ExpertLoadHandler(pool, eng, pinned)
        rigs.append((pinned, pool, eng, loader, OnDemandExperts(pool, loader, victim_order=order)))
    rng = random.Random(5)
    try:
        for step in range(60):
            layer = rng.randrange(3)
            want = sorted(rng.sample(range(5), rng.randint(1, 4)))
            for _pinned, pool, _eng, loader, experts in rigs:
                if step % 4 == 1:  # around the class: a release, then expert 5 loaded straight through the loader
                    other = (layer + 1) % 3
                    if pool.resident_experts(other):
                        pool.release(other, pool.resident_experts(other)[0])
                    if pool.num_free_slots and not pool.is_resident(other, 5):
                        loader.load_many(other, [5])[0].wait(T)
                experts.ensure(layer, want)
            views = [{(la, e) for la in range(3) for e in pool.resident_experts(la)} for _p, pool, *_ in rigs]
            assert views[0] == views[1], step
            for pinned, pool, *_ in rigs:  # every resident expert reads its own bytes through its range
                for la, e in views[0]:
                    pool.wait_ready(la, [e])
                    assert checksum(pool.expert_tensor(la, e)) == pinned.checksum(la, e), (step, la, e)
        kept = [pool.ranges.num_kept for _p, pool, *_ in rigs]
        assert min(kept) > 0, kept  # reloads into the slot a released range still mapped took no map
    finally:
        for pinned, pool, eng, loader, _experts in rigs:
            loader.close()
            eng.close()
            pool.close()
            pinned.close()


def test_a_pool_full_of_loads_being_published_waits_for_the_oldest_only(dev: Device) -> None:
    """Every slot held by loads whose copies are issued but not yet published (a layer's misses whose ranges are
    still being mapped): `ensure` waits for the oldest one's publication, evicts it, loads its own expert, and
    leaves the younger load in flight untouched (waiting for all of them was most of a step at qwen3 F=0.25 B=16)."""
    from tierplan.runtime.engine.experts import OnDemandExperts

    src = SyntheticExpertSource(MIXED, 1, 4, seed=3)
    pinned = PinnedExpertStore(dev, src)
    pool = ExpertSlotPool(HostBackend(), dev, 1, 4, MIXED.num_bytes, 2)
    eng = TransferEngine(dev)
    loader = ExpertLoadHandler(pool, eng, pinned=pinned, map_in="before_copy")
    ex = OnDemandExperts(pool, loader)
    waited: list[int] = []

    class Publication:  # the loader's future of a load in flight: waiting for it publishes it
        def __init__(self, expert: int) -> None:
            self.expert = expert

        def done(self) -> bool:
            return pool.state(0, self.expert) is ExpertState.RESIDENT

        def wait(self, timeout_s: float | None = None) -> None:
            waited.append(self.expert)
            pool.map_reserved(0, self.expert)
            pool.complete_load(0, self.expert, True)

    try:
        pool.prepare_loads(0, [0, 1])
        for e in (0, 1):
            ex._unpublished[(0, e)] = Publication(e)  # type: ignore[assignment]
            ex.books.touch((0, e))
        ex.ensure(0, [2])
        assert waited == [0]
        assert [pool.state(0, e) for e in range(3)] == [ExpertState.ABSENT, ExpertState.LOADING,
                                                        ExpertState.RESIDENT]
        want = torch.empty(MIXED.num_bytes, dtype=torch.uint8)
        src.fill(0, 2, want)
        assert torch.equal(pool.expert_tensor(0, 2), want)
    finally:
        eng.close()
        pool.close()
        pinned.close()


def test_a_slot_keeps_each_streams_last_reader_and_its_next_load_follows_them(dev: Device) -> None:
    """On a GPU a stream's events end in the order they were recorded, so a slot keeps only the last reader of each
    stream (no event is queried per read): the next load of the slot is guarded by that last reader of every
    stream that read it, and not by an earlier one the last supersedes. On the CPU twin (no streams) each reader
    is kept until it is done."""

    class Streams(Device):  # the CPU twin with named streams, as a GPU keys its readers
        def stream_key(self, stream=None):  # type: ignore[override]
            return stream or "compute"

    pool = ExpertSlotPool(HostBackend(), Streams("cpu"), 1, 4, MIXED.num_bytes, 1)
    data = torch.zeros(MIXED.num_bytes, dtype=torch.uint8)
    try:
        load(pool, 0, 0, data)
        first, last, side = Kernel(), Kernel(), Kernel()
        pool.record_read(0, [0], first)
        pool.record_read(0, [0], last)
        pool.record_read(0, [0], side, stream="side")
        pool.release(0, 0)
        pool.prepare_loads(0, [1])
        assert pool.load_guards(0, [1]) == [[last, side]]
    finally:
        for k in (first, last, side):
            k.set()
        pool.close()
    cpu = ExpertSlotPool(HostBackend(), dev, 1, 4, MIXED.num_bytes, 1)
    try:
        load(cpu, 0, 0, data)
        first, last = Kernel(), Kernel()
        cpu.record_read(0, [0], first)
        cpu.record_read(0, [0], last)
        cpu.release(0, 0)
        cpu.prepare_loads(0, [1])
        assert cpu.load_guards(0, [1]) == [[first, last]]
    finally:
        first.set()
        last.set()
        cpu.close()
