"""GPU paths: CUDA VMM slots, transfers, KV tiers and expert loads on a real device (`pytest -m gpu`).

Run on the lent H200 through the device tool; skipped cleanly where there is no CUDA device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierplan.runtime.checksum import checksum
from tierplan.runtime.device import Device
from tierplan.runtime.errors import ConfigError, CudaError, NotResidentError
from tierplan.runtime.memory.slots import ExpertSlotPool
from tierplan.runtime.transfer import Link, Priority, TrafficClass, TransferEngine, TransferRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture()
def dev() -> Device:
    return Device("cuda")


@pytest.fixture()
def vmm(dev: Device):
    from tierplan.runtime.memory.cuda_vmm import CudaVmmBackend

    be = CudaVmmBackend(0)
    yield be
    be.close()
    assert be.live().reservations == be.live().physical == be.live().mappings == 0


def _rand(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_vmm_bytes_follow_the_chunk_across_remaps(vmm) -> None:
    g = vmm.granularity_bytes
    va = vmm.reserve(4 * g)
    phys = vmm.create_physical(g)
    vmm.map(va, g, phys)
    data = _rand(g, 1).cuda()
    vmm.tensor(va, g).copy_(data)
    torch.cuda.synchronize()
    vmm.unmap(va, g)
    vmm.map(va + 3 * g, g, phys)
    assert torch.equal(vmm.tensor(va + 3 * g, g), data)
    with pytest.raises(ConfigError, match="already mapped"):
        vmm.map(va + 3 * g, g, phys)
    with pytest.raises(ConfigError, match="multiple"):
        vmm.map(va, g // 2, phys)


def test_vmm_driver_errors_are_cuda_errors(vmm) -> None:
    g = vmm.granularity_bytes
    with pytest.raises(CudaError, match=r"cuMemCreate"):
        vmm.create_physical(g * (1 << 30))  # 2 PiB: the driver refuses


def test_pool_on_cuda_poisons_absent_experts_and_loads_exactly(dev: Device, vmm) -> None:
    pool = ExpertSlotPool(vmm, dev, 2, 8, 3 << 20, 3, poison_unmapped=True, scrub_on_unmap=True)
    absent = pool.layer_tensor(1)[: 3 << 20].view(torch.bfloat16)
    assert torch.isnan(absent).all()
    with pytest.raises(NotResidentError):
        pool.expert_tensor(1, 0)
    data = _rand(3 << 20, 2)
    dst = pool.prepare_load(1, 5)
    ev = dev.copy(dst, data.pin_memory(), dev.new_stream())
    pool.complete_load(1, 5, True, ev)
    pool.wait_ready(1, [5])
    assert checksum(pool.expert_tensor(1, 5).cpu()) == checksum(data)
    pool.record_read(1, [5], dev.record_event())
    pool.unmap(1, 5)
    assert torch.isnan(pool.layer_tensor(1)[5 * pool.layout.stride_bytes:][: 1 << 20].view(torch.bfloat16)).all()
    pool.check_invariants()
    pool.close()


def test_cuda_graph_replay_reads_the_expert_mapped_now(dev: Device, vmm) -> None:
    """Graphs captured over the stable range follow remaps: capture once, replay while experts move."""
    n = 1 << 20
    pool = ExpertSlotPool(vmm, dev, 1, 2, n, 1, poison_unmapped=True)
    a, b = _rand(n, 3), _rand(n, 4)
    for e, d in ((0, a),):
        dst = pool.prepare_load(0, e)
        dst.copy_(d.cuda())
        pool.complete_load(0, e, True)
    view = pool.layer_tensor(0)[:n]
    out = torch.empty((), dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out.copy_(view.to(torch.int64).sum())  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        out.copy_(view.to(torch.int64).sum())
    graph.replay()
    torch.cuda.synchronize()
    assert int(out) == int(a.to(torch.int64).sum())
    pool.unmap(0, 0)
    dst = pool.prepare_load(0, 0)  # same virtual address, same slot, new bytes
    dst.copy_(b.cuda())
    pool.complete_load(0, 0, True)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    assert int(out) == int(b.to(torch.int64).sum())
    pool.close()


def test_engine_links_on_cuda_are_exact_and_urgent_overtakes(dev: Device, tmp_path: Path) -> None:
    from tierplan.runtime.nvme import DirectFile

    eng = TransferEngine(dev, chunk_bytes=2 << 20)
    n = 64 << 20
    host = dev.alloc_host(n)
    host.tensor.copy_(_rand(n, 5))
    d = dev.alloc(n)
    back = dev.alloc_host(n)
    eng.submit(TransferRequest(Link.H2D, TrafficClass.EXPERT, host.tensor, d)).wait()
    eng.submit(TransferRequest(Link.D2H, TrafficClass.KV, d, back.tensor)).wait()
    assert torch.equal(back.tensor, host.tensor)
    f = DirectFile(tmp_path / "x.bin", n)
    eng.submit(TransferRequest(Link.H2DISK, TrafficClass.KV, host.tensor, f.region(0, n))).wait()
    back.tensor.fill_(0xAB)
    eng.submit(TransferRequest(Link.DISK2H, TrafficClass.KV, f.region(0, n), back.tensor)).wait()
    assert torch.equal(back.tensor, host.tensor)
    order: list[str] = []
    small_d = dev.alloc(1 << 16)  # allocated first: a cudaMalloc between the two submits let big finish first
    big_n = 1 << 30  # ~20 ms on the link: the urgent copy is submitted while it is surely in flight
    big_host, big_d = dev.alloc_host(big_n), dev.alloc(big_n)
    big = eng.submit(TransferRequest(Link.H2D, TrafficClass.EXPERT, big_host.tensor, big_d, Priority.LOW,
                                     on_done=lambda h: order.append("big")))
    eng.submit(TransferRequest(Link.H2D, TrafficClass.KV, host.tensor[: 1 << 16], small_d, Priority.URGENT,
                               on_done=lambda h: order.append("small"))).wait()
    big.wait()
    assert order == ["small", "big"]
    big_host.close()
    eng.close()
    f.close()
    host.close()
    back.close()


def test_kv_lists_go_in_groups_on_cuda_exact_and_a_failed_part_lands_those_before_it(
        dev: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook-free list of 256 KiB segments, scattered both ways, goes as groups of one event each: every byte
    lands, each segment's bytes already in place when it reports done (the copies held back behind a sleeping
    stream); a copy failing at part 3 leaves parts 0-2 landed by the time wait() raises, the rest untouched."""
    from tests.runtime.conftest import fail_copy_at
    from tierplan.runtime.errors import TransferError
    from tierplan.runtime.transfer import DEFAULT_CHUNK_BYTES, MAX_GROUP_PARTS

    blk = 256 << 10
    per_group = min(MAX_GROUP_PARTS, DEFAULT_CHUNK_BYTES // blk)  # a group stops at chunk_bytes: 32 blocks at 8 MiB
    n = 2 * per_group + 6  # two full groups and a short one
    eng = TransferEngine(dev)
    host, back = dev.alloc_host(n * blk), dev.alloc_host(n * blk)
    host.tensor.copy_(_rand(n * blk, 9))
    d = dev.alloc(n * blk)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
    segs = [(i * blk, p * blk, blk) for i, p in enumerate(perm)]
    try:
        eng.submit(TransferRequest(Link.H2D, TrafficClass.KV, host.tensor, d, segments=segs)).wait()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # the list's copies wait ~tens of ms behind this: a segment reported done
            torch.cuda._sleep(50_000_000)  # before its group's event would see bytes not there yet
            held = torch.cuda.Event()
            held.record(side)
        landed: list[bool] = []

        def done(i: int, err: BaseException | None) -> None:
            landed.append(err is None and torch.equal(back.tensor[i * blk : (i + 1) * blk],
                                                      host.tensor[i * blk : (i + 1) * blk]))

        eng.submit(TransferRequest(Link.D2H, TrafficClass.KV, d, back.tensor, after=held, on_segment_done=done,
                                   segments=[(p, i, k) for i, p, k in segs])).wait()
        assert torch.equal(back.tensor, host.tensor) and landed == [True] * n
        assert eng.stats()["links"]["h2d"]["chunks"] == eng.stats()["links"]["d2h"]["chunks"] == 3
        back.tensor.zero_()
        fail_copy_at(monkeypatch, dev, 4, RuntimeError("copy failed (injected)"))
        h = eng.submit(TransferRequest(Link.D2H, TrafficClass.KV, d, back.tensor,
                                       segments=[(p, i, k) for i, p, k in segs]))
        with pytest.raises(TransferError, match="copy failed"):
            h.wait()
        assert torch.equal(back.tensor[: 3 * blk], host.tensor[: 3 * blk])
        assert not back.tensor[3 * blk :].any()
    finally:
        eng.close()
        host.close()
        back.close()


@pytest.mark.parametrize(("map_in", "poison", "publish"), [("beside_copy", False, "issued"),
                                                            ("before_copy", False, "issued"),
                                                            ("beside_copy", True, "issued"),
                                                            ("beside_copy", False, "done"),
                                                            ("on_read", False, "issued"),
                                                            ("on_read", True, "issued")])
def test_engine_exact_on_cuda_with_the_paged_kernel(tmp_path: Path, map_in: str, poison: bool, publish: str) -> None:
    from tierplan.runtime.engine.presets import preset
    from tierplan.runtime.selfcheck.exact import run_exact_check

    r = run_exact_check(preset("tiny"), 0.25, device="cuda", workdir=tmp_path, decode_kernel=True,
                        expert_map_in=map_in, expert_poison=poison, expert_publish=publish)  # type: ignore[arg-type]
    # the bits and a real offload; which executor ran is not this test's point (3 live-routed rows may need more
    # experts than the slots: eager), test_offload_exec checks each mode
    assert r.max_abs_diff == 0.0 and r.tokens_equal, r.line()
    assert r.kv_fetches > 0 and r.expert_misses_tight > r.expert_misses_full


def test_paged_kernel_on_cuda_matches_the_reference() -> None:
    from tierplan.runtime.engine.kernels.paged_attention import paged_decode_attention, paged_decode_reference

    g = torch.Generator().manual_seed(7)
    kv = torch.randn(64, 2, 16, 4, 128, generator=g).to(torch.bfloat16).cuda()  # [N, 2, T, Hkv, D]
    table = torch.randperm(64, generator=g)[:60].view(4, 15).to(torch.int32).cuda()
    lens = torch.tensor([1, 100, 240, 17], dtype=torch.int32).cuda()
    q = torch.randn(4, 32, 128, generator=g).to(torch.bfloat16).cuda()
    out = paged_decode_attention(q, kv[:, 0], kv[:, 1], table, lens)
    ref = paged_decode_reference(q, kv[:, 0], kv[:, 1], table, lens)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


def test_a_mixed_step_on_cuda_sends_its_decodes_to_the_paged_kernel(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.runtime.test_engine import mixed_step_gaps
    from tierplan.runtime.engine.presets import preset

    decode_gap, mixed_gap = mixed_step_gaps(preset("tiny"), "cuda", tmp_path, monkeypatch)
    assert decode_gap < 0.1 and mixed_gap.max().item() <= max(2 * decode_gap, 1e-3)


@pytest.mark.parametrize("batch", [4, 3])
def test_cuda_graph_decode_matches_eager_decode(tmp_path: Path, batch: int) -> None:
    from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
    from tierplan.runtime.engine.presets import preset
    from tierplan.runtime.selfcheck.exact import auto_block_tokens

    spec = preset("tiny")
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [5] * 20, [11, 12]][:batch]
    out = {}
    for graphs in (False, True):
        cfg = EngineConfig(block_tokens=auto_block_tokens(spec), decode_graphs=graphs, workdir=tmp_path / str(graphs))
        eng = ReferenceEngine(spec, Device("cuda"), cfg)
        out[graphs] = eng.generate(prompts, 6)
        if graphs:
            from tierplan.runtime.engine.executor import Reason

            assert eng.executors.reasons == {Reason.PREFILL: 1, Reason.ALL_RESIDENT: 5}
            assert eng.graphs is not None
            gpu_ms = eng.graphs.take_gpu_ms()  # the last decode step's replay, then forgotten
            assert gpu_ms is not None and gpu_ms > 0 and eng.graphs.take_gpu_ms() is None
        eng.close()
    assert out[False].tokens == out[True].tokens
    if batch == 4:  # a full bucket runs the very same kernels: the same bits
        assert torch.equal(out[False].logits, out[True].logits)


def test_urgent_stream_on_cuda_overtakes_a_deep_bulk_queue(dev: Device) -> None:
    """Expert copies queued 64 MiB deep; an URGENT KV copy on its own stream finishes first, bytes exact."""
    eng = TransferEngine(dev, chunk_bytes=8 << 20, max_inflight_bytes=64 << 20, urgent_stream=True)
    big_n, small_n = 1 << 30, 1 << 16
    big_h, big_d = dev.alloc_host(big_n), dev.alloc(big_n)
    small_h, small_d, back = dev.alloc_host(small_n), dev.alloc(small_n), dev.alloc_host(small_n)
    small_h.tensor.copy_(_rand(small_n, 9))
    order: list[str] = []
    big = eng.submit(TransferRequest(Link.H2D, TrafficClass.EXPERT, big_h.tensor, big_d, Priority.LOW,
                                     on_done=lambda h: order.append("big")))
    eng.submit(TransferRequest(Link.H2D, TrafficClass.KV, small_h.tensor, small_d, Priority.URGENT,
                               on_done=lambda h: order.append("small"))).wait()
    big.wait()
    eng.submit(TransferRequest(Link.D2H, TrafficClass.KV, small_d, back.tensor, Priority.URGENT)).wait()
    eng.close()
    assert order == ["small", "big"] and torch.equal(back.tensor, small_h.tensor)
    for b in (big_h, small_h, back):
        b.close()


@pytest.mark.parametrize("batch", [3, 5, 9, 17])  # 9: a bucket of 16, its splits sized by its fewest 9 rows
def test_replayed_and_padded_eager_steps_are_bit_identical_on_cuda(tmp_path: Path, batch: int) -> None:
    from tests.runtime.test_graphs import replay_vs_padded_eager
    from tierplan.runtime.engine.presets import preset

    a, b = replay_vs_padded_eager(preset("tiny"), "cuda", tmp_path, batch)
    assert torch.equal(a, b)


@pytest.mark.parametrize("retire_thread", [False, True])
@pytest.mark.parametrize("map_in", ["before_copy", "beside_copy", "before_copy/issued", "beside_copy/issued"])
def test_expert_loads_on_cuda_are_exact_wherever_slots_are_mapped(dev: Device, vmm, map_in: str,
                                                                  retire_thread: bool) -> None:
    """Rounds of a whole-layer prefetch list (one load each, or one load_many), evicted in between, with a KV
    stream on the same link: every expert lands byte-exact and absent ones read as poison, whether the link
    worker maps before each copy or beside it, and whether a load is published once its copy is done or once
    it is issued (then the read is ordered by wait_ready alone)."""
    map_in, _, publish = map_in.partition("/")
    from tierplan.runtime.weights.format import ExpertFormat
    from tierplan.runtime.weights.loader import ExpertLoadHandler
    from tierplan.runtime.weights.sources import SyntheticExpertSource
    from tierplan.runtime.weights.stores import PinnedExpertStore

    fmt = ExpertFormat.swiglu(512, 768)  # 2.25 MiB, a slot of two 2 MiB pages
    pinned = PinnedExpertStore(dev, SyntheticExpertSource(fmt, 2, 12, seed=5))
    pool = ExpertSlotPool(vmm, dev, 2, 12, fmt.num_bytes, 12, poison_unmapped=True,
                          slot_window=map_in == "beside_copy")
    kv_src, kv_dst = _rand(24 << 20, 9).pin_memory(), torch.empty(24 << 20, dtype=torch.uint8, device="cuda")
    with TransferEngine(dev, max_inflight_bytes=64 << 20, urgent_stream=True, retire_thread=retire_thread) as eng:
        loader = ExpertLoadHandler(pool, eng, pinned=pinned, map_in=map_in, publish=publish or "done")
        for rnd in range(4):
            layer = rnd % 2
            kv = eng.submit(TransferRequest(Link.H2D, TrafficClass.KV, kv_src, kv_dst, Priority.URGENT))
            order = list(range(12)) if rnd < 2 else list(range(11, -1, -1))
            futs = loader.load_many(layer, order) if rnd % 2 else [loader.load(layer, e) for e in order]
            for f in futs:
                f.wait(30)
            kv.wait(30)
            pool.wait_ready(layer, range(12))
            for e in range(12):
                assert checksum(pool.expert_tensor(layer, e).cpu()) == pinned.checksum(layer, e), (rnd, e)
            assert checksum(kv_dst.cpu()) == checksum(kv_src)
            pool.record_read_all(dev.record_event())
            for e in range(12):
                pool.unmap(layer, e)
            assert torch.isnan(pool.layer_tensor(layer)[: 1 << 20].view(torch.bfloat16)).all()
        loader.close()
    assert loader.stats()["loads_ok"] == 48
    pool.check_invariants()
    pool.close()
    pinned.close()


@pytest.mark.parametrize("store", ["nvme", "pinned"])
@pytest.mark.parametrize("mode", ["piecewise", "lookahead", "range", "eager", "on_read"])
def test_engine_exact_on_cuda_in_each_execution_mode(tmp_path: Path, mode: str, store: str) -> None:
    """Piecewise graphs (misses loaded between layers), with the layer-ahead window, through the ranges, padded
    eager, and loads mapping no range: the same bits as all resident, and the mode really ran. From the pinned
    store a step's misses are issued on the engine thread (`TransferEngine.submit_now`); from NVMe one by one."""
    from tierplan.runtime.engine.presets import preset
    from tierplan.runtime.selfcheck.exact import run_exact_check
    from tierplan.runtime.weights.loader import StoreKind

    r = run_exact_check(preset("tiny"), 0.5, "cuda", workdir=tmp_path, mode=mode, expert_map_in="on_read" if
                        mode == "on_read" else "beside_copy", expert_store=StoreKind(store))
    assert r.line() == "exact: max_abs_diff=0.0 tokens_equal=True ok" and r.mode_steps and r.ok


def test_a_piecewise_steps_gpu_time_sums_its_pieces_on_cuda(tmp_path: Path) -> None:
    """Steps with experts missing replay piecewise graphs: the last step's GPU time covers all its pieces, is
    taken once, and a step that then runs eagerly (a prefill) leaves none behind."""
    from tests.runtime.test_graphs import PROMPTS
    from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
    from tierplan.runtime.engine.executor import Reason
    from tierplan.runtime.engine.presets import preset
    from tierplan.runtime.selfcheck.exact import auto_block_tokens

    spec = preset("tiny")
    eng = ReferenceEngine(spec, Device("cuda"), EngineConfig(block_tokens=auto_block_tokens(spec), decode_kernel=True,
                                                             decode_graphs=True, resident_frac=0.25,
                                                             workdir=tmp_path / "p"))
    try:
        eng.generate(PROMPTS[:2], 3)  # 2 rows x top-2 fit the slots: piecewise
        assert eng.executors.reasons == {Reason.PREFILL: 1, Reason.EXPERTS_MISSING: 2}
        assert eng.graphs is not None and eng.graphs._timed == eng.model.num_pieces
        gpu_ms = eng.graphs.take_gpu_ms()
        assert gpu_ms is not None and gpu_ms > 0 and eng.graphs.take_gpu_ms() is None
    finally:
        eng.close()


def test_capture_time_is_counted_once_per_bucket_on_cuda(tmp_path: Path) -> None:
    """A new bucket's warm-up and capture add to capture_s (the phase bench's clocks leave it out); replaying
    captured buckets adds nothing."""
    from tests.runtime.test_graphs import PROMPTS
    from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
    from tierplan.runtime.engine.presets import preset
    from tierplan.runtime.selfcheck.exact import auto_block_tokens

    spec = preset("tiny")
    eng = ReferenceEngine(spec, Device("cuda"), EngineConfig(block_tokens=auto_block_tokens(spec), decode_kernel=True,
                                                             decode_graphs=True, workdir=tmp_path / "c"))
    try:
        assert eng.graphs is not None and eng.graphs.capture_s == 0.0
        eng.generate(PROMPTS[:2], 3)
        first = eng.graphs.capture_s
        assert first > 0
        eng.generate(PROMPTS[2:4], 3)  # the same bucket of 2: replayed, not captured again
        assert eng.graphs.capture_s == first
    finally:
        eng.close()


def test_forced_routes_replay_the_graph_on_cuda(tmp_path: Path) -> None:
    from tests.runtime.test_offload_exec import forced_graph_vs_eager
    from tierplan.runtime.engine.presets import preset

    forced_graph_vs_eager(preset("tiny"), "cuda", tmp_path)


def test_a_released_slot_is_not_overwritten_under_a_kernel_still_reading_it_on_cuda(dev: Device, vmm) -> None:
    """The engine's evictions return at once (`release`): the copy of the expert that reuses the slot must be
    ordered, on the device, after a kernel queued before the eviction that still reads the old expert (here one
    that sleeps ~0.1 s first, while the 2.25 MiB copy takes ~50 µs)."""
    from tierplan.runtime.weights.format import ExpertFormat
    from tierplan.runtime.weights.loader import ExpertLoadHandler
    from tierplan.runtime.weights.sources import SyntheticExpertSource
    from tierplan.runtime.weights.stores import PinnedExpertStore

    fmt = ExpertFormat.swiglu(512, 768)
    pinned = PinnedExpertStore(dev, SyntheticExpertSource(fmt, 1, 2, seed=7))
    pool = ExpertSlotPool(vmm, dev, 1, 2, fmt.num_bytes, 1, slot_window=True)
    with TransferEngine(dev) as eng:
        loader = ExpertLoadHandler(pool, eng, pinned=pinned)  # the engine's defaults: beside_copy, issued
        loader.load_many(0, [0])[0].wait(30)
        pool.wait_ready(0, [0])
        old = pool.expert_tensor(0, 0)
        out = torch.empty_like(old)
        torch.cuda._sleep(200_000_000)
        out.copy_(old)  # the reader, queued behind the sleep
        pool.record_read(0, [0], dev.record_event())
        pool.release(0, 0)
        loader.load_many(0, [1])[0].wait(30)
        pool.wait_ready(0, [1])
        new = pool.expert_tensor(0, 1).clone()
        torch.cuda.synchronize()
        assert checksum(out.cpu()) == pinned.checksum(0, 0), "the reused slot was overwritten under its reader"
        assert checksum(new.cpu()) == pinned.checksum(0, 1)
        loader.close()
    pool.close()
    pinned.close()
