"""The staging pool: lent one buffer at a time, waited for, refused on close, and shared by the engine's movers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.errors import BusyError, ConfigError
from tierplan.runtime.selfcheck.exact import auto_block_tokens
from tierplan.runtime.staging import StagingClosed, StagingPool
from tierplan.runtime.weights.loader import StoreKind


def test_a_lease_is_the_asked_bytes_of_a_whole_buffer_and_close_waits_for_it(cpu: Device) -> None:
    pool = StagingPool(cpu, 8192, 1)
    lease = pool.take(4096)
    assert lease.tensor.numel() == 4096 and lease.buffer.num_bytes == 8192 and pool.num_free == 0
    with pytest.raises(ConfigError, match="9000 bytes asked, the buffers hold 8192"):
        pool.take(9000)
    with pytest.raises(BusyError, match="1 buffer"):
        pool.close()
    stop = threading.Event()
    got: list[object] = []

    def waiter() -> None:
        try:
            got.append(pool.take(4096, refuse=stop.is_set))
        except StagingClosed as exc:
            got.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    stop.set()
    pool.wake()  # its owner is closing: the waiter gives up instead of waiting forever
    t.join(10)
    assert isinstance(got[0], StagingClosed)
    pool.give(lease)
    pool.close()


def test_the_engine_stages_expert_reads_and_kv_moves_through_one_pool(tmp_path: Path) -> None:
    spec = preset("tiny")
    eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(
        block_tokens=auto_block_tokens(spec), resident_frac=0.5, expert_store=StoreKind.NVME, kv_gpu_blocks=8,
        kv_cpu_blocks=4, kv_nvme_blocks=8, spill_kv_every_step=True, workdir=tmp_path))
    try:
        assert eng.loader._staging is eng.staging and eng.cache.handler._staging is eng.staging
        out = eng.generate([[1, 2, 3], [4, 5]], 3)
        assert out.expert_misses > 0 and out.kv_spills > 0 and eng.staging.num_free == eng.staging.count
    finally:
        eng.close()
