"""Host time per call of what an expert load issues (the `calls` section of `tierplan bench substrate`).

A 9 MiB load keeps a PCIe Gen5 link busy only a couple of hundred µs (9 MiB / link bandwidth); when the host
needs longer per load, the link waits. This times, on the calling thread, each host-side piece a load is made
of, so the load path can be put together from measured parts: the copy through torch vs the driver call, an
event record and query, and the Python that submitting a prefetch list costs per expert (the link's worker held
back, so only submission is timed).
Runs in the inference process; GPU rows only on CUDA.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tierplan.runtime.device import Device, HostEvent
from tierplan.runtime.engine.engine import EngineConfig
from tierplan.runtime.future import OpFuture, wait_all
from tierplan.runtime.memory.backend import make_backend
from tierplan.runtime.memory.slots import ExpertSlotPool
from tierplan.runtime.transfer import Link, TrafficClass, TransferEngine, TransferRequest
from tierplan.runtime.weights.load_modes import pool_modes
from tierplan.runtime.weights.loader import ExpertLoadHandler, StoreKind
from tierplan.runtime.weights.stores import PinnedExpertStore

Submit = Callable[[ExpertLoadHandler], list[OpFuture]]  # submits loads, returns their futures


def _per_call_us(fn: Callable[[int], Any], n: int, reps: int = 5, before: Callable[[], Any] | None = None) -> float:
    """Median over `reps` rounds of (host time of n back-to-back calls fn(0..n-1)) / n, in µs."""
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def _gpu_call_costs(dev: Device, num_bytes: int, n: int) -> dict[str, float]:
    from cuda.bindings import driver as cu

    host = dev.alloc_host(num_bytes * n)
    dst = dev.alloc(num_bytes * n)
    hs, ds = host.tensor.view(n, num_bytes), dst.view(n, num_bytes)
    stream = torch.cuda.Stream()
    raw_stream = cu.CUstream(stream.cuda_stream)
    src_ptr, dst_ptr = host.tensor.data_ptr(), dst.data_ptr()
    done = [torch.cuda.Event() for _ in range(n)]
    for ev in done:
        ev.record(stream)
    stream.synchronize()
    res: dict[str, float] = {}
    with torch.cuda.stream(stream):
        res["torch_copy_us"] = _per_call_us(lambda i: ds[i].copy_(hs[i], non_blocking=True), n,
                                            before=stream.synchronize)
        res["driver_copy_us"] = _per_call_us(
            lambda i: cu.cuMemcpyHtoDAsync(cu.CUdeviceptr(dst_ptr + i * num_bytes), src_ptr + i * num_bytes,
                                           num_bytes, raw_stream), n, before=stream.synchronize)
        res["torch_event_record_us"] = _per_call_us(lambda i: torch.cuda.Event().record(stream), n)
        res["torch_event_query_us"] = _per_call_us(lambda i: done[i].query(), n, before=stream.synchronize)
        res["current_stream_us"] = _per_call_us(lambda i: torch.cuda.current_stream(), n)
    stream.synchronize()
    host.close()
    return res


@contextmanager
def _gated_loader(dev: Device, store: PinnedExpertStore, batch: int) -> Iterator[Callable[[Submit], None]]:
    """A one-layer pool of `batch` slots and a loader over `store`, set up as the reference engine sets them up.
    Yields `gated(submit)`: it runs `submit(loader)` (which returns the load futures) while the link's worker is
    held back by a gate, so only submission runs, then lets the worker go, waits for the loads and evicts them."""
    cfg = EngineConfig()
    map_in = cfg.map_in_for(graphs=dev.is_cuda)
    pool = ExpertSlotPool(make_backend(dev), dev, 1, batch, store.format.num_bytes, batch,
                          poison_unmapped=cfg.expert_poison, **pool_modes(map_in))
    engine = TransferEngine(dev, retire_thread=cfg.transfer_retire_thread)
    loader = ExpertLoadHandler(pool, engine, pinned=store, map_in=map_in, publish=cfg.expert_publish)
    gate_src, gate_dst = torch.zeros(4096, dtype=torch.uint8), dev.alloc(4096)

    def gated(submit: Submit) -> None:
        gate = HostEvent()
        engine.submit(TransferRequest(Link.H2D, TrafficClass.KV, gate_src, gate_dst, after=gate))
        try:
            futs = submit(loader)
        finally:
            gate.set()
        wait_all(futs, 60)
        for e in pool.resident_experts(0):
            pool.unmap(0, e)

    try:
        yield gated
    finally:
        loader.close()
        engine.close()
        pool.close()


def submit_cost_us(dev: Device, store: PinnedExpertStore, batch: int, reps: int = 5) -> dict[str, float]:
    """Host µs per expert to submit a prefetch list of `batch` (one `load_many`, or one `load` each) while the
    link's worker is held back, so the worker's own work is not in the figure."""
    out: dict[str, list[float]] = {"load_many": [], "load_each": []}

    def timed_submit(how: str) -> Submit:
        def go(loader: ExpertLoadHandler) -> list[OpFuture]:
            t0 = time.perf_counter()
            futs = loader.load_many(0, list(range(batch))) if how == "load_many" else \
                [loader.load(0, e, StoreKind.PINNED) for e in range(batch)]
            out[how].append((time.perf_counter() - t0) / batch * 1e6)
            return futs
        return go

    with _gated_loader(dev, store, batch) as gated:
        for _ in range(reps):
            for how in out:
                gated(timed_submit(how))
    return {f"{how}_submit_us_per_expert": statistics.median(v) for how, v in out.items()}


def submit_profile(dev: Device, store: PinnedExpertStore, batch: int, top: int = 15) -> list[dict[str, Any]]:
    """cProfile of one gated `load_many` of `batch` experts on the calling thread: the functions with the most
    own time, in µs per expert (profiling slows every call; the split, not the sum, is the point)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()

    def profiled(loader: ExpertLoadHandler) -> list[OpFuture]:
        prof.enable()
        try:
            return loader.load_many(0, list(range(batch)))
        finally:
            prof.disable()

    with _gated_loader(dev, store, batch) as gated:
        gated(profiled)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{fn.rsplit('/', 1)[-1]}:{line}({name})", "calls": cc,
             "own_us_per_expert": round(tt / batch * 1e6, 2), "total_us_per_expert": round(ct / batch * 1e6, 2)}
            for (fn, line, name), (cc, _nc, tt, ct, _callers) in rows]


def host_call_costs(dev: Device, store: PinnedExpertStore, batch: int) -> dict[str, Any]:
    """Every figure of the section, for experts of `store` in lists of `batch`."""
    res: dict[str, Any] = {"expert_bytes": store.format.num_bytes, "batch": batch,
                           **submit_cost_us(dev, store, batch)}
    res["submit_profile"] = submit_profile(dev, store, batch)
    res["thread_event_us"] = _per_call_us(lambda i: __import__("threading").Event(), 256)
    if dev.is_cuda:
        res.update(_gpu_call_costs(dev, store.format.num_bytes, batch))
    return res
