"""KV block tiers on the CPU twin: books, bytes, moves across every tier pair, refusals and corruption.

The "GPU" tier is host memory here but every copy still goes through the engine's H2D/D2H links, so the
paths are the ones a GPU takes. NVMe blocks live in a real file under tmp_path (O_DIRECT where allowed).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.runtime.conftest import fail_copy_at
from tierplan.runtime import errors as err
from tierplan.runtime.checksum import checksum
from tierplan.runtime.device import Device
from tierplan.runtime.kv import KVBlockManager, KVBlockSpec, KVMove, KVTierStores, KVTransferHandler, Tier
from tierplan.runtime.kv.handler import PAIRS
from tierplan.runtime.transfer import MIN_CHUNK_BYTES, Priority, TransferEngine

BLOCK_BYTES = 8192
ALL_PAIRS = [(a, b) for a in Tier for b in Tier if a is not b]


@dataclass
class Rig:
    manager: KVBlockManager
    stores: KVTierStores
    engine: TransferEngine
    handler: KVTransferHandler


@pytest.fixture
def make_rig(tmp_path: Any) -> Any:
    rigs: list[Rig] = []

    def make(capacity: int = 8, verify: frozenset[Tier] = frozenset({Tier.NVME}), **kw: Any) -> Rig:
        caps, device = dict.fromkeys(Tier, capacity), kw.get("device") or Device("cpu")
        engine = TransferEngine(device, chunk_bytes=kw.get("chunk_bytes"))
        path = tmp_path / f"kv{len(rigs)}.bin"
        stores = KVTierStores(device, kw.get("block_bytes", BLOCK_BYTES), caps, nvme_path=path)
        manager = KVBlockManager(caps, verify)
        rig = Rig(manager, stores, engine, KVTransferHandler(manager, stores, engine, kw.get("num_staging", 4)))
        rigs.append(rig)
        return rig

    yield make
    for rig in reversed(rigs):
        rig.handler.close(timeout_s=10)
        rig.engine.close()
        rig.stores.close()


@pytest.fixture
def rig(make_rig: Any) -> Rig:
    return make_rig()


def random_block(seed: int, num_bytes: int = BLOCK_BYTES) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (num_bytes,), dtype=torch.uint8, generator=gen)  # [B], no zero byte


def snapshot(m: KVBlockManager) -> tuple[Any, ...]:
    blocks = {b: (m.location(b), m.checksum(b), m.is_moving(b), m.refcount(b)) for b in m.blocks()}
    return m.usage(), m.blocks(), blocks


def flip_byte(stores: KVTierStores, spec: KVBlockSpec, k: int) -> None:
    if spec.tier is not Tier.NVME:
        stores.memory(spec)[k] ^= 0xFF
        return
    assert stores.nvme_file is not None
    pos = stores.region(spec).offset_bytes + k
    fd = os.open(stores.nvme_file.path, os.O_RDWR)
    os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 0xFF]), pos)
    os.close(fd)


# ---- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("src", "dst"), ALL_PAIRS, ids=[f"{a.value}->{b.value}" for a, b in ALL_PAIRS])
def test_round_trip_is_bit_exact_for_every_tier_pair(rig: Rig, src: Tier, dst: Tier) -> None:
    data = random_block(seed=ALL_PAIRS.index((src, dst)))
    block = rig.manager.allocate(src)
    rig.handler.write(block, data)
    rig.handler.move(block, dst).wait(timeout_s=10)
    assert rig.manager.location(block).tier is dst and not rig.manager.is_moving(block)
    assert torch.equal(rig.handler.read(block), data)
    assert rig.manager.checksum(block) == checksum(data)
    assert rig.manager.num_used(src) == 0 and rig.manager.usage()[dst.value]["blocks"] == 1
    stats = rig.handler.stats()
    assert stats["bytes_by_pair"] == {p: BLOCK_BYTES if p == f"{src.value}->{dst.value}" else 0 for p in PAIRS}
    assert (stats["moves_ok"], stats["moves_failed"], stats["num_staging_free"]) == (1, 0, 4)


@pytest.mark.parametrize("block_bytes", [BLOCK_BYTES, 2 * MIN_CHUNK_BYTES + 4096], ids=["small", "3-chunks"])
def test_multi_hop_chain_keeps_every_byte(make_rig: Any, block_bytes: int) -> None:
    # Blocks of several chunks cross the disk links on parallel workers, one staging buffer for all.
    rig = make_rig(2, block_bytes=block_bytes, chunk_bytes=MIN_CHUNK_BYTES, num_staging=1)
    data = random_block(seed=7, num_bytes=block_bytes)
    block = rig.manager.allocate(Tier.GPU)
    rig.handler.write(block, data)
    rig.handler.mark_dirty(block)  # as if the engine had written it: no checksum until it reaches the host
    assert rig.manager.checksum(block) is None
    chain = [Tier.NVME, Tier.CPU, Tier.GPU, Tier.CPU, Tier.NVME, Tier.GPU, Tier.NVME, Tier.CPU]
    for tier in chain:
        rig.handler.move(block, tier, priority=Priority.HIGH).wait(timeout_s=10)
        assert rig.manager.location(block).tier is tier and rig.manager.checksum(block) == checksum(data)
        assert torch.equal(rig.handler.read(block), data)
    assert rig.handler.stats()["moves_ok"] == len(chain)
    assert {t: rig.manager.num_used(t) for t in Tier} == {Tier.GPU: 0, Tier.CPU: 1, Tier.NVME: 0}


# ---- concurrency ------------------------------------------------------------------------------------
def test_concurrent_moves_from_several_threads_lose_no_byte(make_rig: Any) -> None:
    rig = make_rig(48, num_staging=2)
    num_threads, per_thread, num_rounds = 4, 8, 6
    tiers = list(Tier)
    owned = [[rig.manager.allocate(tiers[(t + j) % 3]) for j in range(per_thread)] for t in range(num_threads)]
    data = {block: random_block(seed=block) for ids in owned for block in ids}
    for block, want in data.items():
        rig.handler.write(block, want)

    def worker(t: int) -> None:
        rng = random.Random(t)
        for r in range(num_rounds):
            rewritten = owned[t][r % per_thread]  # writes race the other threads' moves
            data[rewritten] = random_block(seed=1000 * (t + 1) + r)
            rig.handler.write(rewritten, data[rewritten])
            futures = []
            for block in owned[t]:
                dst = rng.choice([x for x in tiers if x is not rig.manager.location(block).tier])
                futures.append(rig.handler.move(block, dst, priority=rng.choice(list(Priority))))
            for f in futures:
                f.wait(timeout_s=30)
            probe = rng.choice(owned[t])
            assert torch.equal(rig.handler.read(probe), data[probe])

    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(worker, range(num_threads), timeout=60))  # re-raises a worker's failure
    for block, want in data.items():
        assert torch.equal(rig.handler.read(block), want), f"block {block} at {rig.manager.location(block)}"
    stats = rig.handler.stats()
    assert stats["moves_ok"] == num_threads * per_thread * num_rounds
    assert (stats["moves_failed"], stats["moves_in_flight"], stats["num_staging_free"]) == (0, 0, 2)
    usage = rig.manager.usage()
    assert sum(u["blocks"] for u in usage.values()) == len(data)
    assert all(u["reserved"] == 0 and u["used"] == u["blocks"] for u in usage.values())


# ---- manager refusals -------------------------------------------------------------------------------
@pytest.fixture
def busy_books() -> tuple[KVBlockManager, dict[str, Any]]:
    """GPU full; one CPU block held by a reader, one moving to NVMe; one NVMe block; one freed id."""
    m = KVBlockManager({Tier.GPU: 2, Tier.CPU: 2, Tier.NVME: 3})
    ids = {"g0": m.allocate(Tier.GPU), "g1": m.allocate(Tier.GPU), "held": m.allocate(Tier.CPU)}
    ids["moving"] = m.allocate(Tier.CPU)
    ids["n0"] = m.allocate(Tier.NVME)
    ids["freed"] = m.allocate(Tier.NVME)
    m.free(ids["freed"])
    m.acquire(ids["held"])
    m.set_checksum(ids["g0"], 0x1234)
    m.set_checksum(ids["n0"], 0xABCD)
    ids["move"] = m.prepare_move(ids["moving"], Tier.NVME)
    ids["no_move"] = KVMove(ids["g0"], m.location(ids["g0"]), KVBlockSpec(Tier.CPU, 1))
    ids["other_move"] = KVMove(ids["moving"], ids["move"].src, KVBlockSpec(Tier.NVME, 2))
    return m, ids


REFUSALS: list[tuple[str, Callable[[KVBlockManager, dict[str, Any]], object], type[Exception]]] = [
    ("allocate-full-tier", lambda m, i: m.allocate(Tier.GPU), err.CapacityError),
    ("allocate-not-a-tier", lambda m, i: m.allocate("gpu"), err.ConfigError),
    ("free-unknown", lambda m, i: m.free(999), err.UnknownBlockError),
    ("free-twice", lambda m, i: m.free(i["freed"]), err.DoubleFreeError),
    ("free-acquired", lambda m, i: m.free(i["held"]), err.BusyError),
    ("free-moving", lambda m, i: m.free(i["moving"]), err.BusyError),
    ("acquire-unknown", lambda m, i: m.acquire(999), err.UnknownBlockError),
    ("acquire-freed", lambda m, i: m.acquire(i["freed"]), err.UnknownBlockError),
    ("acquire-moving", lambda m, i: m.acquire(i["moving"]), err.BusyError),
    ("release-below-zero", lambda m, i: m.release(i["g0"]), err.ConfigError),
    ("release-unknown", lambda m, i: m.release(999), err.UnknownBlockError),
    ("location-unknown", lambda m, i: m.location(-1), err.UnknownBlockError),
    ("checksum-freed", lambda m, i: m.checksum(i["freed"]), err.UnknownBlockError),
    ("set-checksum-freed", lambda m, i: m.set_checksum(i["freed"], 1), err.UnknownBlockError),
    ("set-checksum-not-int", lambda m, i: m.set_checksum(i["g0"], "x"), err.ConfigError),
    ("move-to-same-tier", lambda m, i: m.prepare_move(i["g0"], Tier.GPU), err.ConfigError),
    ("move-acquired", lambda m, i: m.prepare_move(i["held"], Tier.NVME), err.BusyError),
    ("move-moving", lambda m, i: m.prepare_move(i["moving"], Tier.GPU), err.BusyError),
    ("move-into-full-tier", lambda m, i: m.prepare_move(i["n0"], Tier.GPU), err.CapacityError),
    ("move-freed", lambda m, i: m.prepare_move(i["freed"], Tier.CPU), err.UnknownBlockError),
    ("move-not-a-tier", lambda m, i: m.prepare_move(i["g0"], "cpu"), err.ConfigError),
    ("complete-without-move", lambda m, i: m.complete_move(i["no_move"], True), err.ConfigError),
    ("complete-other-move", lambda m, i: m.complete_move(i["other_move"], True), err.BusyError),
    ("complete-ok-not-bool", lambda m, i: m.complete_move(i["move"], 1), err.ConfigError),
]


@pytest.mark.parametrize(("call", "error"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_manager_refusal_changes_no_state(
    busy_books: tuple[KVBlockManager, dict[str, Any]],
    call: Callable[[KVBlockManager, dict[str, Any]], object],
    error: type[Exception],
) -> None:
    manager, ids = busy_books
    before = snapshot(manager)
    with pytest.raises(error, match=r"\S"):
        call(manager, ids)
    assert snapshot(manager) == before


def test_manager_books_of_a_move(busy_books: tuple[KVBlockManager, dict[str, Any]]) -> None:
    manager, ids = busy_books
    assert manager.usage()["nvme"] == {"capacity": 3, "used": 2, "free": 1, "blocks": 1, "reserved": 1}
    manager.complete_move(ids["move"], ok=False)
    assert manager.location(ids["moving"]).tier is Tier.CPU and manager.num_used(Tier.NVME) == 1
    move = manager.prepare_move(ids["moving"], Tier.NVME)
    manager.complete_move(move, ok=True)
    assert manager.location(ids["moving"]) == move.dst and manager.num_free(Tier.CPU) == 1
    manager.release(ids["held"])
    manager.free(ids["held"])
    new = manager.allocate(Tier.CPU)
    assert new == ids["freed"] + 1  # ids are never reused
    assert manager.blocks() == sorted([ids["g0"], ids["g1"], ids["moving"], ids["n0"], new])


def test_locations_of_a_list_are_each_blocks_in_order_and_name_an_unknown_one() -> None:
    manager = KVBlockManager({Tier.GPU: 4, Tier.CPU: 4})
    ids = [manager.allocate(Tier.GPU), manager.allocate(Tier.CPU), manager.allocate(Tier.GPU)]
    move = manager.prepare_move(ids[0], Tier.CPU)  # in flight: at its source until it completes
    want = [manager.location(b) for b in ids[::-1]]
    assert manager.locations(ids[::-1]) == want and manager.locations([]) == []
    manager.complete_move(move, ok=True)
    assert manager.locations(ids[:1]) == [move.dst]
    manager.free(ids[1])
    with pytest.raises(err.UnknownBlockError, match=f"KV block {ids[1]} was freed"):
        manager.locations([ids[2], ids[1], 99])
    with pytest.raises(err.UnknownBlockError, match="never allocated"):
        manager.locations([ids[2], "x"])  # type: ignore[list-item]


def test_absent_tier_is_refused() -> None:
    manager = KVBlockManager({Tier.GPU: 1})
    block = manager.allocate(Tier.GPU)
    before = snapshot(manager)
    with pytest.raises(err.ConfigError, match="capacity 0"):
        manager.allocate(Tier.CPU)
    with pytest.raises(err.ConfigError, match="capacity 0"):
        manager.prepare_move(block, Tier.NVME)
    assert snapshot(manager) == before and manager.num_free(Tier.CPU) == 0
    with pytest.raises(err.ConfigError, match="int >= 0"):
        KVBlockManager({Tier.GPU: -1})


# ---- stores and handler refusals --------------------------------------------------------------------
def test_stores_and_handler_refuse_bad_parts_and_wrong_views(rig: Rig, tmp_path: Any) -> None:
    for block_bytes in (0, 1000, 4096 + 512, -4096):
        with pytest.raises(err.AlignmentError, match="multiple of 4096"):
            KVTierStores(Device("cpu"), block_bytes, {Tier.CPU: 1}, nvme_path=tmp_path / "kv.bin")
    with pytest.raises(err.ConfigError, match="nvme_path"):
        KVTierStores(Device("cpu"), BLOCK_BYTES, {Tier.NVME: 1})
    with pytest.raises(err.ConfigError, match="region"):
        rig.stores.memory(KVBlockSpec(Tier.NVME, 0))
    with pytest.raises(err.ConfigError, match="memory"):
        rig.stores.region(KVBlockSpec(Tier.GPU, 0))
    with pytest.raises(err.ConfigError, match="outside"):
        rig.stores.memory(KVBlockSpec(Tier.CPU, 8))
    assert rig.stores.memory(KVBlockSpec(Tier.CPU, 3)).data_ptr() % 4096 == 0
    assert rig.stores.region(KVBlockSpec(Tier.NVME, 3)).offset_bytes == 3 * BLOCK_BYTES
    with pytest.raises(err.ConfigError, match="capacity"):
        KVTransferHandler(KVBlockManager({Tier.CPU: 1}), rig.stores, rig.engine)
    with pytest.raises(err.ConfigError, match="num_staging"):
        KVTransferHandler(rig.manager, rig.stores, rig.engine, num_staging=0)


@pytest.mark.parametrize("tier", list(Tier), ids=[t.value for t in Tier])
def test_write_of_wrong_data_changes_nothing(rig: Rig, tier: Tier) -> None:
    data = random_block(seed=5)
    block = rig.manager.allocate(tier)
    rig.handler.write(block, data)
    before = snapshot(rig.manager)
    short, int16 = torch.ones(BLOCK_BYTES - 1, dtype=torch.uint8), torch.ones(BLOCK_BYTES, dtype=torch.int16)
    for bad in (short, int16, b"\x01" * BLOCK_BYTES, torch.ones(BLOCK_BYTES + 4096, dtype=torch.uint8)):
        with pytest.raises(err.ConfigError, match=f"KV block {block}: expected a CPU uint8 tensor"):
            rig.handler.write(block, bad)
    assert snapshot(rig.manager) == before
    assert torch.equal(rig.handler.read(block), data)


def test_handler_refusals_raise_at_once_and_queue_nothing(rig: Rig) -> None:
    block = rig.manager.allocate(Tier.CPU)
    rig.handler.write(block, random_block(seed=9))
    for _ in range(8):
        rig.manager.allocate(Tier.GPU)  # GPU full
    before, kv_before = snapshot(rig.manager), rig.engine.stats()["classes"]["kv"]
    with pytest.raises(err.ConfigError, match="already on cpu"):
        rig.handler.move(block, Tier.CPU)
    with pytest.raises(err.CapacityError, match="full"):
        rig.handler.move(block, Tier.GPU)
    with pytest.raises(err.UnknownBlockError):
        rig.handler.move(12345, Tier.GPU)
    rig.manager.acquire(block)
    with pytest.raises(err.BusyError, match="reader"):
        rig.handler.move(block, Tier.NVME)
    rig.manager.release(block)
    stats = rig.engine.stats()["classes"]["kv"], rig.handler.stats()["moves_failed"]
    assert snapshot(rig.manager) == before and stats == (kv_before, 0)
    moving = rig.manager.allocate(Tier.NVME)
    rig.handler.write(moving, random_block(seed=13))
    move = rig.manager.prepare_move(moving, Tier.CPU)  # a move in flight, as another handler would hold it
    before = snapshot(rig.manager)
    for call in (
        lambda: rig.handler.read(moving),
        lambda: rig.handler.write(moving, random_block(seed=14)),
        lambda: rig.handler.mark_dirty(moving),
        lambda: rig.handler.move(moving, Tier.GPU),
    ):
        with pytest.raises(err.BusyError, match=r"moving|in flight"):
            call()
    assert snapshot(rig.manager) == before
    rig.manager.complete_move(move, ok=False)
    assert torch.equal(rig.handler.read(moving), random_block(seed=13))


# ---- corruption and failed moves --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tier", "k"), [(Tier.NVME, 0), (Tier.NVME, 4097), (Tier.NVME, BLOCK_BYTES - 1), (Tier.CPU, 100)]
)
def test_flipped_byte_is_caught_by_read_and_move_and_block_stays(make_rig: Any, tier: Tier, k: int) -> None:
    rig = make_rig(verify=frozenset({Tier.CPU, Tier.NVME}))
    data = random_block(seed=21)
    block = rig.manager.allocate(tier)
    rig.handler.write(block, data)
    spec = rig.manager.location(block)
    flip_byte(rig.stores, spec, k)
    before = snapshot(rig.manager)
    match = rf"KV block {block} on tier {tier.value} index {spec.index}: checksum mismatch, expected"
    with pytest.raises(err.CorruptDataError, match=match):
        rig.handler.read(block)
    for dst in (t for t in Tier if t is not tier):
        future = rig.handler.move(block, dst)
        with pytest.raises(err.CorruptDataError, match=match):
            future.wait(timeout_s=10)
        assert future.done() and not future.ok
    assert snapshot(rig.manager) == before  # still at the source, destinations given back
    stats = rig.handler.stats()
    assert (stats["corrupt_detected"], stats["moves_failed"], stats["moves_ok"]) == (3, 2, 0)
    assert stats["num_staging_free"] == 4
    rig.handler.write(block, data)  # repair in place
    assert torch.equal(rig.handler.read(block), data)
    rig.handler.move(block, Tier.GPU).wait(timeout_s=10)
    assert torch.equal(rig.handler.read(block), data)


def test_failed_transfers_leave_blocks_readable_at_their_source(rig: Rig) -> None:
    on_cpu, on_gpu = rig.manager.allocate(Tier.CPU), rig.manager.allocate(Tier.GPU)
    data = {on_cpu: random_block(seed=31), on_gpu: random_block(seed=32)}
    for block, want in data.items():
        rig.handler.write(block, want)
    before = snapshot(rig.manager)
    assert rig.stores.nvme_file is not None
    rig.stores.nvme_file.close()  # every disk transfer now fails with EBADF
    for block in data:  # CPU->NVMe fails on its only hop, GPU->NVMe on its second
        with pytest.raises(err.TransferError, match="h2disk transfer failed"):
            rig.handler.move(block, Tier.NVME).wait(timeout_s=10)
    assert snapshot(rig.manager) == before
    stats = rig.handler.stats()
    assert (stats["moves_failed"], stats["corrupt_detected"], stats["num_staging_free"]) == (2, 0, 4)
    for block, want in data.items():
        assert torch.equal(rig.handler.read(block), want)
    rig.engine.close()  # the first hop's submit is refused: the move fails, nothing leaks
    with pytest.raises(err.TransferError, match="closed"):
        rig.handler.move(on_gpu, Tier.CPU).wait(timeout_s=10)
    assert snapshot(rig.manager) == before and rig.handler.stats()["moves_failed"] == 3


def test_close_waits_for_moves_then_refuses_new_work(rig: Rig) -> None:
    blocks = [rig.manager.allocate(Tier.GPU) for _ in range(6)]
    for block in blocks:
        rig.handler.write(block, random_block(seed=block))
    futures = [rig.handler.move(b, Tier.NVME) for b in blocks]
    rig.handler.close(timeout_s=10)
    assert all(f.ok for f in futures)
    before = snapshot(rig.manager)
    with pytest.raises(err.ConfigError, match="closed"):
        rig.handler.move(blocks[0], Tier.CPU)
    with pytest.raises(err.ConfigError, match="closed"):
        rig.handler.read(blocks[0])
    assert snapshot(rig.manager) == before


# ---- lists of moves ---------------------------------------------------------------------------------
def _requests(rig: Rig) -> list[Any]:
    """Every request the rig's handler submits from now on, in order."""
    seen: list[Any] = []
    real = rig.engine.submit

    def submit(req: Any) -> Any:
        seen.append(req)
        return real(req)

    rig.engine.submit = submit  # type: ignore[method-assign]
    return seen


def test_a_list_moves_each_memory_pair_as_one_request_and_keeps_every_byte(make_rig: Any) -> None:
    """GPU->CPU and CPU->GPU lists go as one segmented request each (a segment a block, out of index order),
    NVMe moves hop by hop; every block lands bit-exact, its checksum recorded where it reached the host bound for
    a verified tier (the CPU is one here)."""
    rig = make_rig(capacity=12, verify=frozenset({Tier.CPU, Tier.NVME}))
    gpu = [rig.manager.allocate(Tier.GPU) for _ in range(6)]
    nvme = [rig.manager.allocate(Tier.NVME) for _ in range(2)]
    data = {b: random_block(seed=100 + b) for b in gpu + nvme}
    for b, want in data.items():
        rig.handler.write(b, want)
        if b in gpu:
            rig.handler.mark_dirty(b)  # as the engine's kernels leave them: no checksum until bytes reach the host
    seen = _requests(rig)
    order = gpu[::-2] + gpu[::2]
    futures = rig.handler.move_list(order, Tier.CPU)
    assert [f.move.block_id for f in futures] == order
    for f in futures:
        f.wait(timeout_s=10)
    assert [len(r.segments) for r in seen] == [6]
    assert all(rig.manager.checksum(b) == checksum(data[b]) for b in gpu)
    seen.clear()
    futures = rig.handler.move_list(nvme + gpu, Tier.GPU)  # two NVMe blocks hop by hop, the six CPU ones as one
    for f in futures:
        f.wait(timeout_s=10)
    assert sorted(len(r.segments or ()) for r in seen) == [0, 0, 0, 0, 6]
    for b, want in data.items():
        assert rig.manager.location(b).tier is Tier.GPU and torch.equal(rig.handler.read(b), want)
    stats = rig.handler.stats()
    assert (stats["moves_ok"], stats["moves_failed"], stats["moves_in_flight"]) == (14, 0, 0)
    assert stats["bytes_by_pair"]["gpu->cpu"] == stats["bytes_by_pair"]["cpu->gpu"] == 6 * BLOCK_BYTES


def test_a_block_is_hashed_only_on_its_way_to_a_tier_that_verifies_it(make_rig: Any) -> None:
    """With only NVMe verified, dirty GPU blocks spilled to the CPU get no checksum (nothing would compare it);
    the move on to NVMe hashes the CPU bytes, and a copy corrupted on NVMe is caught on its way back."""
    rig = make_rig(capacity=4)
    blocks = [rig.manager.allocate(Tier.GPU) for _ in range(3)]
    data = {b: random_block(seed=300 + b) for b in blocks}
    for b, want in data.items():
        rig.handler.write(b, want)
        rig.handler.mark_dirty(b)
    for f in rig.handler.move_list(blocks, Tier.CPU):
        f.wait(timeout_s=10)
    assert [rig.manager.checksum(b) for b in blocks] == [None] * 3
    for f in rig.handler.move_list(blocks[:2], Tier.NVME):
        f.wait(timeout_s=10)
    assert [rig.manager.checksum(b) for b in blocks] == [checksum(data[blocks[0]]), checksum(data[blocks[1]]), None]
    flip_byte(rig.stores, rig.manager.location(blocks[1]), 7)
    futures = rig.handler.move_list(blocks, Tier.GPU)
    futures[0].wait(timeout_s=10)
    futures[2].wait(timeout_s=10)
    with pytest.raises(err.CorruptDataError, match=f"KV block {blocks[1]} on tier nvme"):
        futures[1].wait(timeout_s=10)
    assert torch.equal(rig.handler.read(blocks[0]), data[blocks[0]])
    assert torch.equal(rig.handler.read(blocks[2]), data[blocks[2]])
    assert rig.manager.location(blocks[1]).tier is Tier.NVME


def test_a_list_that_cannot_be_reserved_changes_nothing(make_rig: Any) -> None:
    rig = make_rig(capacity=4)
    blocks = [rig.manager.allocate(Tier.CPU) for _ in range(3)]
    for b in blocks:
        rig.handler.write(b, random_block(seed=b))
    rig.manager.allocate(Tier.GPU)
    rig.manager.allocate(Tier.GPU)  # room for two of the three
    before, seen = snapshot(rig.manager), _requests(rig)
    with pytest.raises(err.CapacityError, match="full"):
        rig.handler.move_list(blocks, Tier.GPU)
    rig.manager.acquire(blocks[2])
    with pytest.raises(err.BusyError, match="reader"):
        rig.handler.move_list(blocks, Tier.NVME)
    rig.manager.release(blocks[2])
    assert snapshot(rig.manager) == before and seen == [] and rig.handler.stats()["moves_in_flight"] == 0


def test_a_corrupt_block_of_a_list_stays_and_the_others_land(make_rig: Any) -> None:
    """A checksum mismatch at a CPU source fails that block's future alone; a copy that fails fails its own."""
    rig = make_rig(verify=frozenset({Tier.CPU, Tier.NVME}))
    blocks = [rig.manager.allocate(Tier.CPU) for _ in range(4)]
    data = {b: random_block(seed=200 + b) for b in blocks}
    for b, want in data.items():
        rig.handler.write(b, want)
    bad = blocks[1]
    flip_byte(rig.stores, rig.manager.location(bad), 5)
    futures = rig.handler.move_list(blocks, Tier.GPU)
    with pytest.raises(err.CorruptDataError, match=f"KV block {bad} on tier cpu"):
        futures[1].wait(timeout_s=10)
    for b, f in zip(blocks, futures, strict=True):
        if b != bad:
            f.wait(timeout_s=10)
            assert torch.equal(rig.handler.read(b), data[b])
    assert rig.manager.location(bad).tier is Tier.CPU and not rig.manager.is_moving(bad)
    stats = rig.handler.stats()
    assert (stats["moves_ok"], stats["moves_failed"], stats["corrupt_detected"]) == (3, 1, 1)
    rig.engine.close()  # the list's request is refused: every block fails and stays
    good = [b for b in blocks if b != bad]
    before = snapshot(rig.manager)
    futures = rig.handler.move_list(good, Tier.CPU)
    for f in futures:
        with pytest.raises(err.TransferError, match="closed"):
            f.wait(timeout_s=10)
    assert snapshot(rig.manager) == before and rig.handler.stats()["moves_in_flight"] == 0


def test_a_copy_that_fails_mid_list_fails_the_rest_and_the_landed_ones_stay_landed(
        make_rig: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine fails a segmented request from its failed copy on: blocks copied before it land, that one and
    the later ones fail and stay where they were, readable; nothing is left in flight."""
    rig = make_rig()
    blocks = [rig.manager.allocate(Tier.GPU) for _ in range(5)]
    data = {b: random_block(seed=400 + b) for b in blocks}
    for b, want in data.items():
        rig.handler.write(b, want)
    fail_copy_at(monkeypatch, rig.engine.device, 3, OSError("injected copy failure"))
    futures = rig.handler.move_list(blocks, Tier.CPU)
    for i, f in enumerate(futures):
        if i < 2:
            f.wait(timeout_s=10)
        else:
            with pytest.raises(err.TransferError, match="injected copy failure"):
                f.wait(timeout_s=10)
    monkeypatch.undo()
    assert [rig.manager.location(b).tier for b in blocks] == [Tier.CPU] * 2 + [Tier.GPU] * 3
    for b, want in data.items():
        assert torch.equal(rig.handler.read(b), want) and not rig.manager.is_moving(b)
    stats = rig.handler.stats()
    assert (stats["moves_ok"], stats["moves_failed"], stats["moves_in_flight"]) == (2, 3, 0)


# ---- the device path --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_every_pair_chain_and_corruption_on_a_real_gpu(make_rig: Any) -> None:
    rig = make_rig(device=Device("cuda"))
    assert rig.stores.memory(KVBlockSpec(Tier.GPU, 0)).is_cuda
    data = random_block(seed=61)
    block = rig.manager.allocate(Tier.GPU)
    rig.handler.write(block, data)
    for tier in [Tier.CPU, Tier.NVME, Tier.GPU, Tier.NVME, Tier.CPU, Tier.GPU]:  # all six ordered pairs
        rig.handler.move(block, tier).wait(timeout_s=30)
        assert torch.equal(rig.handler.read(block), data)
    rig.stores.memory(rig.manager.location(block)).fill_(7)  # the engine writes on the compute stream
    rig.handler.mark_dirty(block)
    rig.handler.move(block, Tier.NVME).wait(timeout_s=30)  # ordered after the fill by the recorded event
    assert torch.equal(rig.handler.read(block), torch.full((BLOCK_BYTES,), 7, dtype=torch.uint8))
    flip_byte(rig.stores, rig.manager.location(block), 9)
    with pytest.raises(err.CorruptDataError):
        rig.handler.move(block, Tier.GPU).wait(timeout_s=30)
    assert rig.manager.location(block).tier is Tier.NVME


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run through the device tool)")
def test_lists_of_moves_on_a_real_gpu_follow_the_kernels_and_keep_every_byte(make_rig: Any) -> None:
    """A list spilled right after the compute stream wrote it, and fetched back into indices the stream still
    read, is bit-exact both ways (one recorded event orders the whole request)."""
    rig = make_rig(capacity=64, device=Device("cuda"))
    blocks = [rig.manager.allocate(Tier.GPU) for _ in range(48)]
    for b in blocks:
        rig.handler.write(b, random_block(seed=300 + b))
    torch.cuda._sleep(200_000_000)  # the compute stream busy for a while: the fills below land after the list is
    for i, b in enumerate(blocks):  # queued, so only the request's recorded event keeps its copies behind them
        rig.stores.memory(rig.manager.location(b)).fill_(i + 1)  # queued on the compute stream
        rig.handler.mark_dirty(b)
    for f in rig.handler.move_list(blocks, Tier.CPU):
        f.wait(timeout_s=30)
    for i, b in enumerate(blocks):
        assert torch.equal(rig.handler.read(b), torch.full((BLOCK_BYTES,), i + 1, dtype=torch.uint8))
    for f in rig.handler.move_list(blocks[::-1], Tier.GPU):
        f.wait(timeout_s=30)
    for i, b in enumerate(blocks):
        loc = rig.manager.location(b)
        assert loc.tier is Tier.GPU and bool((rig.stores.memory(loc) == i + 1).all())
