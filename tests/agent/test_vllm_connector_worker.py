"""KvTierWorker, the KV connector's byte side, on fake vLLM caches: blocks go into our CPU and NVMe tiers and come
back bit for bit, checksums catch a corrupted file, and the footprint stays within the installed limits after every
op. No vLLM needed: runs in the main `make test`."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tierplan.agent.adapters.vllm.connector_catalog import OpKind, TierOp
from tierplan.agent.adapters.vllm.connector_meta import BlockLoad, WorkerStep
from tierplan.agent.adapters.vllm.connector_worker import KvLayout, KvTierWorker
from tierplan.runtime.kv.spec import Tier

CPU, NVME = Tier.CPU, Tier.NVME
NUM_BLOCKS = 16


def fake_caches(seed: int) -> dict[str, torch.Tensor]:
    """Two layers shaped like the CPU backend's [num_blocks, kv_heads, block_size, 2 * head_size] bf16 caches."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, 2, 32, 64, generator=g).to(torch.bfloat16)
            for i in range(2)}


def block_bytes(caches: dict[str, torch.Tensor], block_id: int) -> bytes:
    return b"".join(caches[n][block_id].contiguous().view(torch.uint8).numpy().tobytes() for n in sorted(caches))


@pytest.fixture
def worker(tmp_path: Path):
    w = KvTierWorker({CPU: 2, NVME: 3}, tmp_path / "kv.tpnvme")
    yield w
    w.close()


def hold_nvme_writes(w: KvTierWorker) -> threading.Event:
    """Make the worker's NVMe writes wait (a slow disk) until the returned gate is set: spills stay in flight."""
    gate, nvme = threading.Event(), w._stores.nvme_file
    real_write = nvme.write_from

    def held_write(offset_bytes, data):
        gate.wait(timeout=30)  # the test lets it go; a bound, so a broken test fails instead of hanging
        real_write(offset_bytes, data)

    nvme.write_from = held_write
    return gate


def store(key: str, tier: Tier) -> TierOp:
    return TierOp(OpKind.STORE, key, tier)


def test_layout_lays_the_layers_end_to_end_in_4k_multiples() -> None:
    layout = KvLayout.of(fake_caches(0))
    assert layout.bytes_per_layer == (8192, 8192) and layout.block_bytes == 16384
    odd = {"a": torch.zeros(4, 3, 100, dtype=torch.bfloat16)}
    assert KvLayout.of(odd).block_bytes == 4096
    with pytest.raises(ValueError, match="one contiguous block per index"):
        KvLayout.of({"a": torch.zeros(4, 8, 8).transpose(0, 1)})


def test_blocks_stored_on_cpu_and_nvme_load_back_bit_for_bit(worker: KvTierWorker, tmp_path: Path) -> None:
    src = fake_caches(1)
    worker.register(src)
    ops = (store("a", CPU), store("b", CPU), TierOp(OpKind.MOVE, "a", NVME), store("c", NVME))
    worker.apply(WorkerStep(2, 3, ops=ops, store_blocks={"a": 3, "b": 5, "c": 7}))
    worker.finish_spills()  # the move of "a" to NVMe runs in the background
    assert worker.blocks_per_tier() == {"cpu": 1, "nvme": 2}
    assert worker.stats.stores_per_tier == {"cpu": 2, "nvme": 1} and worker.stats.moves == 1
    expected = {k: block_bytes(src, b) for k, b in (("a", 3), ("b", 5), ("c", 7))}
    # Into other blocks of the cache (vLLM gives a later request whatever blocks are free): the bytes come back.
    worker.load((BlockLoad("a", 0), BlockLoad("b", 9), BlockLoad("c", 15)))
    for key, bid in (("a", 0), ("b", 9), ("c", 15)):
        assert block_bytes(src, bid) == expected[key]
    assert worker.stats.loads_per_tier == {"cpu": 1, "nvme": 2}
    assert (worker._reader.num_batches, worker._reader.num_disk_reads) == (1, 2)  # the NVMe reads went as one list
    assert worker.take_report().failed_load_block_ids == set()


def test_a_corrupted_nvme_block_fails_its_load_and_is_dropped(worker: KvTierWorker, tmp_path: Path) -> None:
    caches = fake_caches(3)
    worker.register(caches)
    worker.apply(WorkerStep(2, 3, ops=(store("a", NVME),), store_blocks={"a": 1}))
    path = tmp_path / "kv.tpnvme"
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0x01  # one bit of the stored block
    path.write_bytes(bytes(raw))
    before = block_bytes(caches, 6)
    worker.load((BlockLoad("a", 6),))
    assert block_bytes(caches, 6) == before  # nothing written into vLLM's block
    report = worker.take_report()
    assert report.failed_load_block_ids == {6} and report.failed_keys == {"a"}
    assert worker.stats.corrupt_loads == 1 and not worker.holds("a")


def test_a_load_of_a_block_the_worker_does_not_hold_is_reported(worker: KvTierWorker) -> None:
    worker.register(fake_caches(5))
    worker.load((BlockLoad("never", 2),))
    assert worker.take_report().failed_load_block_ids == {2}
    assert worker.stats.failed_loads == 1


def test_the_runtime_refuses_a_store_past_the_installed_limit(worker: KvTierWorker) -> None:
    worker.register(fake_caches(6))
    # Books that disagree with the limits (a bug upstream) cannot push the tier past them: the runtime refuses.
    worker.apply(WorkerStep(1, 0, ops=(store("a", CPU), store("b", CPU)), store_blocks={"a": 0, "b": 1}))
    assert worker.blocks_per_tier()["cpu"] == 1
    assert worker.stats.failed_stores == 1 and worker.take_report().failed_keys == {"b"}
    assert worker.stats.limit_violations == 0 and worker.stats.peak_blocks_per_tier["cpu"] == 1


def test_drop_frees_the_block_and_close_removes_the_file(tmp_path: Path) -> None:
    w = KvTierWorker({CPU: 1, NVME: 1}, tmp_path / "kv.tpnvme")
    w.register(fake_caches(7))
    w.apply(WorkerStep(1, 1, ops=(store("a", NVME), TierOp(OpKind.DROP, "a", NVME)), store_blocks={"a": 0}))
    assert w.blocks_per_tier() == {"cpu": 0, "nvme": 0} and w.stats.drops == 1
    assert (tmp_path / "kv.tpnvme").exists()
    w.close()
    assert not (tmp_path / "kv.tpnvme").exists()


def test_a_spill_runs_in_the_background_counted_on_both_tiers_until_the_next_step(worker: KvTierWorker) -> None:
    src = fake_caches(8)
    worker.register(src)
    worker.apply(WorkerStep(2, 3, ops=(store("a", CPU), store("b", CPU)), store_blocks={"a": 1, "b": 2}))
    gate = hold_nvme_writes(worker)
    worker.apply(WorkerStep(2, 3, ops=(TierOp(OpKind.MOVE, "a", NVME),)))
    assert worker.spills.pending() == 1  # the engine thread went on
    assert worker.blocks_per_tier() == {"cpu": 2, "nvme": 1}  # in flight: on both tiers, within both limits
    gate.set()
    worker.apply(WorkerStep(2, 3))  # the next step finishes it first
    assert worker.spills.pending() == 0 and worker.stats.moves == 1
    assert worker.blocks_per_tier() == {"cpu": 1, "nvme": 1}
    worker.load((BlockLoad("a", 9),))
    assert block_bytes(src, 9) == block_bytes(src, 1)


def test_a_store_of_a_key_already_held_replaces_its_bytes(worker: KvTierWorker) -> None:
    src = fake_caches(9)
    worker.register(src)
    worker.apply(WorkerStep(2, 3, ops=(store("a", CPU),), store_blocks={"a": 1}))
    worker.apply(WorkerStep(2, 3, ops=(store("a", CPU),), store_blocks={"a": 2}))  # books that lost track of it
    assert worker.stats.overwrites == 1 and worker.stats.failed_stores == 0
    assert worker.blocks_per_tier() == {"cpu": 1, "nvme": 0}
    worker.load((BlockLoad("a", 9),))
    assert block_bytes(src, 9) == block_bytes(src, 2)


def test_stores_scheduled_before_the_books_heard_of_a_failed_load_are_still_skipped(worker: KvTierWorker) -> None:
    """Async scheduling: vLLM builds the next step before the failure's report reaches the scheduler; every store
    (of any request) waits until a step acknowledges the failure's epoch."""
    src = fake_caches(10)
    worker.register(src)
    worker.apply(WorkerStep(2, 3, ops=(store("k0", CPU),), store_blocks={"k0": 0}, seq=1))
    worker.load((BlockLoad("gone", 4, "r", 1),))  # block 1 of request r: not held, the load fails
    worker.apply(WorkerStep(2, 3, ops=(store("k2", CPU),), store_blocks={"k2": 5}, req_blocks={"s": (4, 7)}, seq=2))
    report = worker.take_report()
    assert report.failed_from == {"r": 1, "s": 0} and report.failed_keys == {"gone", "k2"} and report.epoch == 2
    # Scheduled before that report: another request's store, too, may be computed over the bad block.
    worker.apply(WorkerStep(2, 3, ops=(store("k3", CPU), store("x", CPU)), store_blocks={"k3": 6, "x": 8}, seq=3))
    assert worker.take_report().failed_keys == {"k3", "x"} and not worker.holds("k3") and not worker.holds("x")
    # The books heard of it (and rewound r): stores go on.
    worker.apply(WorkerStep(2, 3, ops=(store("k1", CPU),), store_blocks={"k1": 4}, seq=4, ack_epoch=2))
    assert worker.holds("k1") and worker.stats.poisoned_stores == 3


def test_a_store_needing_the_room_of_a_spill_in_flight_waits_in_a_buffer_not_on_the_engine_thread(
        tmp_path: Path) -> None:
    w = KvTierWorker({CPU: 1, NVME: 2}, tmp_path / "kv.tpnvme")
    try:
        src = fake_caches(11)
        w.register(src)
        w.apply(WorkerStep(1, 2, ops=(store("a", CPU),), store_blocks={"a": 1}))
        gate = hold_nvme_writes(w)
        # The books: "a" makes way for "b" (moved to NVMe), "b" takes its CPU room.
        w.apply(WorkerStep(1, 2, ops=(TierOp(OpKind.MOVE, "a", NVME), store("b", CPU)), store_blocks={"b": 2}))
        assert w.stats.deferred_stores == 1 and w.stats.spill_waits == 0 and w.spills.num_waited == 0
        assert w.holds("b") and w.blocks_per_tier() == {"cpu": 1, "nvme": 1}  # within both limits meanwhile
        stored_b = block_bytes(src, 2)
        src["model.layers.0.self_attn.attn"][2].zero_()  # vLLM reuses block 2: the store kept its own copy
        gate.set()
        w.apply(WorkerStep(1, 2))  # the next step finishes the spill, then the store
        assert w.blocks_per_tier() == {"cpu": 1, "nvme": 1} and w.stats.stores_per_tier["cpu"] == 2
        before = block_bytes(src, 1)
        w.load((BlockLoad("a", 9), BlockLoad("b", 10)))
        assert block_bytes(src, 9) == before and w.stats.limit_violations == 0
        assert block_bytes(src, 10) == stored_b  # the bytes as they were at the store
    finally:
        w.close()
