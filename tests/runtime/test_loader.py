"""The expert loader into slots (CPU twin): byte-exact loads from both stores, refusals, failures at every step,
prefetch lists, both map placements and both publish modes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.runtime.conftest import MIXED
from tierplan.runtime.checksum import checksum
from tierplan.runtime.device import Device
from tierplan.runtime.errors import BusyError, CapacityError, ConfigError, CorruptDataError
from tierplan.runtime.memory.host import HostBackend
from tierplan.runtime.memory.slots import ExpertSlotPool, ExpertState
from tierplan.runtime.transfer import TransferEngine
from tierplan.runtime.weights.loader import ExpertLoadHandler, StoreKind
from tierplan.runtime.weights.sources import SyntheticExpertSource
from tierplan.runtime.weights.stores import NvmeExpertStore, PinnedExpertStore


@pytest.fixture()
def dev() -> Device:
    return Device("cpu")


@pytest.fixture()
def engine(dev: Device):
    e = TransferEngine(dev)
    yield e
    e.close()


@pytest.fixture(params=["before_copy", "beside_copy", "before_copy/issued", "beside_copy/issued"])
def map_in(request: pytest.FixtureRequest) -> str:
    """Where a load's slot is mapped (by the link's worker before the copy, or beside it in the worker's waits)
    and, after a slash, when it is published (default: once its copy is done; "issued": once the copy is issued)."""
    return request.param


def _rig(tmp_path: Path, dev: Device, engine: TransferEngine, num_slots: int = 3, map_in: str = "before_copy"):
    where, _, publish = map_in.partition("/")
    src = SyntheticExpertSource(MIXED, 2, 6, seed=2)
    pinned = PinnedExpertStore(dev, src)
    nvme = NvmeExpertStore.build(tmp_path / "e.bin", src, dev)
    pool = ExpertSlotPool(HostBackend(), dev, 2, 6, MIXED.num_bytes, num_slots, scrub_on_unmap=True,
                          slot_window=where == "beside_copy")
    return pinned, nvme, pool, ExpertLoadHandler(pool, engine, pinned, nvme, num_staging=2, map_in=where,
                                                 publish=publish or "done")


def test_loader_is_byte_exact_from_both_stores_and_any_dtype(tmp_path: Path, dev: Device, engine, map_in) -> None:
    pinned, _nvme, pool, loader = _rig(tmp_path, dev, engine, num_slots=12, map_in=map_in)
    futs = [loader.load(layer, e, StoreKind.NVME if (layer + e) % 2 else StoreKind.PINNED)
            for layer in range(2) for e in range(6)]
    for f in futs:
        f.wait(10)
    for layer in range(2):
        for e in range(6):
            assert checksum(pool.expert_tensor(layer, e)) == pinned.checksum(layer, e)
    assert loader.stats()["loads_ok"] == 12 and engine.stats()["links"]["h2d"]["idle_job_errors"] == 0
    pool.close()


def test_loader_detects_flipped_nvme_bytes_and_gives_the_slot_back(tmp_path: Path, dev: Device, engine, map_in) -> None:
    pinned, nvme, pool, loader = _rig(tmp_path, dev, engine, map_in=map_in)
    off = nvme.region(1, 4).offset_bytes + 100
    fd = os.open(tmp_path / "e.bin", os.O_RDWR)
    os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 1]), off)
    os.close(fd)
    fut = loader.load(1, 4, StoreKind.NVME)
    with pytest.raises(CorruptDataError, match=r"expert \(1, 4\)"):
        fut.wait(10)
    assert pool.state(1, 4) is ExpertState.ABSENT and pool.num_free_slots == 3
    assert loader.stats()["corrupt_detected"] == 1
    loader.load(1, 4, StoreKind.PINNED).wait(10)  # the pinned copy is fine
    assert checksum(pool.expert_tensor(1, 4)) == pinned.checksum(1, 4)
    pool.close()


def test_loader_rejects_an_unknown_map_in_and_a_windowed_map_without_a_slot_window(tmp_path: Path, dev: Device,
                                                                             engine) -> None:
    with pytest.raises(ConfigError, match=r"map_in must be one of 'beside_copy', 'before_copy' or 'on_read', got "
                                          r"'gpu'"):
        _rig(tmp_path, dev, engine, map_in="gpu")
    for old, new in (("link", "beside_copy"), ("worker", "before_copy")):  # renamed, refused: never an alias
        with pytest.raises(ConfigError, match=rf"map_in '{old}' is an old name, no longer accepted: use '{new}'"):
            _rig(tmp_path, dev, engine, map_in=old)
    pinned, _nvme, pool, _loader = _rig(tmp_path, dev, engine)
    with pytest.raises(ConfigError, match="slot_window=True"):
        ExpertLoadHandler(pool, engine, pinned, map_in="beside_copy")
    with pytest.raises(ConfigError, match="slot_window=True"):
        ExpertLoadHandler(pool, engine, pinned)  # beside_copy is the default
    with pytest.raises(ConfigError, match="slot_window=True"):
        pool.prepare_load(0, 0, map_now=False, via_window=True)
    assert pool.num_free_slots == 3  # refused: nothing reserved
    pool.close()


def test_loader_refusals_move_nothing(tmp_path: Path, dev: Device, engine, map_in) -> None:
    pinned, _nvme, pool, loader = _rig(tmp_path, dev, engine, num_slots=1, map_in=map_in)
    loader.load(0, 0).wait(10)
    before = engine.stats()
    with pytest.raises(BusyError):
        loader.load(0, 0)
    with pytest.raises(CapacityError):
        loader.load(0, 1)
    assert engine.stats() == before and pool.num_free_slots == 0
    with pytest.raises(ConfigError, match="no nvme store"):
        ExpertLoadHandler(pool, engine, pinned=pinned, map_in=loader.map_in).load(0, 1, StoreKind.NVME)
    with pytest.raises(ConfigError, match="expert_bytes"):
        ExpertLoadHandler(ExpertSlotPool(HostBackend(), dev, 1, 1, 4096, 1), engine, pinned=pinned,
                          map_in="before_copy")
    pool.close()


def test_a_refused_submit_gives_the_slot_back(tmp_path: Path, dev: Device, map_in: str) -> None:
    """Regression: a pinned load whose submit was refused (engine closed) left the expert LOADING for good."""
    eng = TransferEngine(dev)
    _pinned, _nvme, pool, loader = _rig(tmp_path, dev, eng, num_slots=2, map_in=map_in)
    eng.close()
    from tierplan.runtime.errors import TransferError

    with pytest.raises(TransferError):
        loader.load(0, 1).wait(10)
    assert pool.state(0, 1) is ExpertState.ABSENT and pool.num_free_slots == 2
    loader.close()


def test_a_failing_map_fails_the_load_and_gives_the_slot_back(tmp_path: Path, dev: Device, engine, map_in,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The map fails (in the link worker before the copy, or beside a copy already under way): the load's
    future carries the error, the slot is free again, nothing stays LOADING, and the next load works."""
    pinned, _nvme, pool, loader = _rig(tmp_path, dev, engine, map_in=map_in)
    real = pool.map_reserved

    def broken(layer, expert):
        raise RuntimeError("cuMemMap failed (injected)")

    monkeypatch.setattr(pool, "map_reserved", broken)
    futs = [loader.load(0, e) for e in range(3)]
    for f in futs:
        with pytest.raises(Exception, match="injected"):
            f.wait(10)
    assert all(pool.state(0, e) is ExpertState.ABSENT for e in range(3)) and pool.num_free_slots == 3
    assert loader.stats()["loads_failed"] == 3 and engine.stats()["links"]["h2d"]["idle_job_errors"] == 0
    monkeypatch.setattr(pool, "map_reserved", real)
    loader.load(0, 1).wait(10)
    assert checksum(pool.expert_tensor(0, 1)) == pinned.checksum(0, 1)
    pool.check_invariants()
    loader.close()
    pool.close()
    pool.check_invariants()
    pool.close()


def test_a_failing_publish_still_completes_and_counts_the_load(tmp_path: Path, dev: Device, engine, map_in,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: an exception while publishing a finished copy hung wait() and was never counted."""
    _pinned, _nvme, pool, loader = _rig(tmp_path, dev, engine, map_in=map_in)
    real = pool.complete_load

    def broken(layer, expert, ok, event=None, order=None):
        real(layer, expert, False)
        raise RuntimeError("publish failed")

    monkeypatch.setattr(pool, "complete_load", broken)
    fut = loader.load(0, 2)
    with pytest.raises(RuntimeError, match="publish failed"):
        fut.wait(10)
    assert loader.stats()["loads_failed"] == 1 and pool.state(0, 2) is ExpertState.ABSENT
    pool.close()


def test_any_verify_error_and_any_publish_error_complete_the_load(tmp_path: Path, dev: Device, engine, map_in,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review): a non-corruption error in the NVMe verify hung the load; a publish that raised
    without giving the slot back left it LOADING."""
    _pinned, nvme, pool, loader = _rig(tmp_path, dev, engine, map_in=map_in)

    def verify(layer, expert, buf):
        raise OSError("read back failed (injected)")

    monkeypatch.setattr(nvme, "verify", verify)
    with pytest.raises(OSError, match="injected"):
        loader.load(0, 1, StoreKind.NVME).wait(10)
    assert pool.state(0, 1) is ExpertState.ABSENT and loader.stats()["corrupt_detected"] == 0

    def publish(layer, expert, ok, event=None, order=None):
        if ok:
            raise RuntimeError("publish failed (injected)")
        real(layer, expert, ok, event)

    real = pool.complete_load
    monkeypatch.setattr(pool, "complete_load", publish)
    with pytest.raises(RuntimeError, match="publish failed"):
        loader.load(0, 2).wait(10)
    assert pool.state(0, 2) is ExpertState.ABSENT and pool.num_free_slots == 3
    loader.close()
    pool.close()


def test_close_waits_for_loads_in_flight_and_then_refuses_new_ones(tmp_path: Path, dev: Device, map_in) -> None:
    """Regression (review): close() freed NVMe staging buffers while a load could still be reading into them."""
    import threading

    gate = threading.Event()
    eng = TransferEngine(dev)
    pinned, nvme, pool, loader = _rig(tmp_path, dev, eng, map_in=map_in)
    real = nvme.verify

    def slow_verify(layer, expert, buf):
        gate.wait(10)
        real(layer, expert, buf)

    nvme.verify = slow_verify  # type: ignore[method-assign]
    fut = loader.load(1, 3, StoreKind.NVME)
    closer = threading.Thread(target=loader.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and not fut.done()  # close is waiting for the load
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    fut.wait(10)
    assert checksum(pool.expert_tensor(1, 3)) == pinned.checksum(1, 3)
    with pytest.raises(ConfigError, match="closed"):
        loader.load(0, 0)
    assert pool.num_free_slots == 2  # the refused load reserved nothing
    eng.close()
    pool.close()


def test_load_many_is_byte_exact_and_reserves_all_or_nothing(tmp_path: Path, dev: Device, engine, map_in) -> None:
    """A prefetch list in one call: every expert lands byte-exact with its own future; a list with any refused
    expert (repeated, not absent, too many for the free slots, out of range) reserves and moves nothing."""
    pinned, _nvme, pool, loader = _rig(tmp_path, dev, engine, num_slots=4, map_in=map_in)
    futs = loader.load_many(1, [5, 0, 3])
    for f in futs:
        f.wait(10)
    for e in (5, 0, 3):
        assert checksum(pool.expert_tensor(1, e)) == pinned.checksum(1, e)
    before = engine.stats()
    for experts, err, match in (([1, 1], ConfigError, "repeat"), ([0, 0], ConfigError, "repeat"),
                                ([1, 0], BusyError, r"\(1, 0\) is resident"),
                                ([1, 2], CapacityError, "2 experts need slots, 1 of 4"),
                                ([1, 9], ConfigError, "out of range"), ([1, -1], ConfigError, "out of range")):
        with pytest.raises(err, match=match):
            loader.load_many(1, experts)
        assert pool.state(1, 1) is ExpertState.ABSENT and pool.num_free_slots == 1
    with pytest.raises(ConfigError, match=r"expert \(7, 1\) out of range"):
        loader.load_many(7, [1])
    assert engine.stats() == before and loader.stats()["loads_ok"] == 3
    assert loader.load_many(0, []) == []
    pool.check_invariants()
    loader.close()
    with pytest.raises(ConfigError, match="closed"):
        loader.load_many(0, [1])
    pool.close()


def test_load_many_failures_complete_every_future_and_free_every_slot(tmp_path: Path, dev: Device, map_in,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    eng = TransferEngine(dev)
    _pinned, _nvme, pool, loader = _rig(tmp_path, dev, eng, num_slots=3, map_in=map_in)
    monkeypatch.setattr(pool, "map_reserved", lambda layer, expert: (_ for _ in ()).throw(RuntimeError("injected")))
    for f in loader.load_many(0, [0, 1, 2]):
        with pytest.raises(Exception, match="injected"):
            f.wait(10)
    assert pool.num_free_slots == 3 and loader.stats()["loads_failed"] == 3
    eng.close()
    from tierplan.runtime.errors import TransferError

    with pytest.raises(TransferError):  # refused by a closed engine: every slot given back
        loader.load_many(0, [0, 1])
    assert pool.num_free_slots == 3 and all(pool.state(0, e) is ExpertState.ABSENT for e in range(3))
    pool.check_invariants()
    loader.close()
    pool.close()


def test_issued_publish_gives_a_failed_map_back_only_after_its_copy(tmp_path: Path, dev: Device, engine) -> None:
    """publish="issued", mapped beside the copy: the copy is issued, then its map fails while the copy may still
    write the slot. The slot must not be given back (and reused) under it: the load stays LOADING until the copy
    has ended, then fails, counted, with its slot free. The parts are driven in that order by hand."""
    from tierplan.runtime.future import OpFuture
    from tierplan.runtime.weights.loader import _Load

    _pinned, _nvme, pool, loader = _rig(tmp_path, dev, engine, map_in="beside_copy/issued")
    pool.prepare_loads(0, [1], via_window=True)
    loader._inflight += 1
    ld = _Load(0, 1, OpFuture("load of expert (0, 1)"), parts=2)
    loader._step(ld, copy_issued=True)
    loader._step(ld, map_end=True, error=RuntimeError("cuMemMap failed (injected)"))
    assert not ld.fut.done() and pool.state(0, 1) is ExpertState.LOADING and pool.num_free_slots == 2
    loader._step(ld, copy_end=True)
    with pytest.raises(RuntimeError, match="injected"):
        ld.fut.wait(0)
    assert pool.state(0, 1) is ExpertState.ABSENT and pool.num_free_slots == 3
    assert loader.stats()["loads_failed"] == 1 and loader.stats()["failed_after_publish"] == 0
    loader.close()  # nothing left in flight
    pool.close()


def test_a_copy_failing_after_an_issued_publish_is_counted_and_the_expert_evicted(tmp_path: Path, dev: Device,
                                                                                 engine) -> None:
    """publish="issued": the expert is published when its copy is issued; if the copy then fails (a CUDA error)
    the failure is counted, kept, and the expert unmapped, never left looking loaded."""
    from tierplan.runtime.future import OpFuture
    from tierplan.runtime.weights.loader import _Load

    _pinned, _nvme, pool, loader = _rig(tmp_path, dev, engine, map_in="beside_copy/issued")
    pool.prepare_loads(0, [2], via_window=True)
    loader._inflight += 1
    ld = _Load(0, 2, OpFuture("load of expert (0, 2)"), parts=2)
    pool.map_reserved(0, 2)
    loader._step(ld, map_end=True)
    loader._step(ld, copy_issued=True)
    assert ld.fut.ok and pool.is_resident(0, 2)
    boom = RuntimeError("copy failed (injected)")
    loader._step(ld, copy_end=True, error=boom)
    assert pool.state(0, 2) is ExpertState.ABSENT and pool.num_free_slots == 3 and loader.last_error is boom
    assert loader.stats()["failed_after_publish"] == 1 and loader.stats()["loads_failed"] == 1
    loader.close()
    pool.close()


def test_loader_rejects_an_unknown_publish(tmp_path: Path, dev: Device, engine) -> None:
    with pytest.raises(ConfigError, match="publish must be 'done' or 'issued', got 'early'"):
        _rig(tmp_path, dev, engine, map_in="before_copy/early")
