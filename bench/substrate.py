"""`tierplan bench substrate`: what the execution substrate achieves on this machine's links.

Runs in one process on one CUDA GPU (or, with --quick on the CPU twin, a smoke run of the same code).
Every figure is compared with a baseline measured in the same run, as a ratio:
  * expert loads pinned host -> slot (map + engine copy) vs raw pinned host -> device copies, per size;
  * map + set access per slot (CUDA VMM or the mmap twin);
  * the transfer engine's achieved bandwidth per link vs raw copies (memory) or raw O_DIRECT I/O (disk);
  * latency of a small urgent KV transfer submitted behind a 1 GiB expert stream, with and without chunks;
  * KV block lists GPU <-> CPU through the KV handler, one move at a time and as one list, vs raw copies.
Writes substrate_<device>.json, .md and .png into the output folder.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tierplan.bench.substrate_report import write_substrate_report
from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig
from tierplan.runtime.future import wait_all
from tierplan.runtime.memory.backend import make_backend
from tierplan.runtime.memory.slots import ExpertSlotPool
from tierplan.runtime.nvme import DirectFile, align_up
from tierplan.runtime.selfcheck.common import workdir_for
from tierplan.runtime.transfer import Link, Priority, TrafficClass, TransferEngine, TransferRequest
from tierplan.runtime.weights.format import ExpertFormat
from tierplan.runtime.weights.load_modes import pool_modes
from tierplan.runtime.weights.loader import ExpertLoadHandler, MapIn, Publish, StoreKind
from tierplan.runtime.weights.sources import SyntheticExpertSource
from tierplan.runtime.weights.stores import PinnedExpertStore

MiB = 1 << 20


def timed_in_turn(dev: Device, jobs: list[tuple[Callable[[], Any], Callable[[], Any] | None]], reps: int,
                  warmup: int = 2) -> list[float]:
    """Median wall seconds of each (fn, setup) job, the jobs timed one after another within every repetition
    (setup() untimed before its fn, the device synchronized around each): a slow spell of the machine then hits
    a measurement and its baseline alike, which is what a ratio between them needs."""
    times: list[list[float]] = [[] for _ in jobs]
    for rep in range(warmup + reps):
        for (fn, setup), out in zip(jobs, times, strict=True):
            if setup is not None:
                setup()
            dev.synchronize()
            t0 = time.perf_counter()
            fn()
            dev.synchronize()
            if rep >= warmup:
                out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def timed(dev: Device, fn: Callable[[], Any], reps: int, warmup: int = 2,
          setup: Callable[[], Any] | None = None) -> float:
    """Median wall seconds of fn() with the device synchronized around each call; setup() runs untimed."""
    return timed_in_turn(dev, [(fn, setup)], reps, warmup)[0]


def raw_copy_gbps(dev: Device, num_bytes: int, reps: int, to_device: bool = True, count: int = 1) -> float:
    """Plain pinned copies on one stream, `count` of `num_bytes` back to back (the baseline)."""
    host = dev.alloc_host(num_bytes * count)
    host.tensor.copy_(torch.randint(0, 256, (num_bytes * count,), dtype=torch.uint8))
    d = dev.alloc(num_bytes * count)
    hs = host.tensor.view(count, num_bytes)
    ds = d.view(count, num_bytes)
    s = dev.new_stream()

    def go() -> None:
        for i in range(count):
            dev.copy(ds[i], hs[i], s) if to_device else dev.copy(hs[i], ds[i], s)

    sec = timed(dev, go, reps)
    host.close()
    return num_bytes * count / sec / 1e9


WORKER_PHASES = ("hook_s", "issue_s", "blocked_s", "retire_s", "idle_s")


def pinned_experts(dev: Device, hidden: int, inter: int, batch: int) -> PinnedExpertStore:
    """`batch` synthetic SwiGLU experts of one layer in pinned host memory (the loads' source)."""
    return PinnedExpertStore(dev, SyntheticExpertSource(ExpertFormat.swiglu(hidden, inter), 1, batch, seed=1))


def expert_load_gbps(dev: Device, engine: TransferEngine, store: PinnedExpertStore, batch: int,
                     reps: int, poison_unmapped: bool = False, map_in: MapIn = "beside_copy",
                     submit: str = "list", publish: Publish = "issued") -> dict[str, Any]:
    """Pinned store -> slots: `batch` loads in flight at once (a prefetch list: one `load_many` call, or with
    submit="each" one `load` per expert), then a single load.

    Timed: prepare_load (the slot map) + the engine's copy + complete_load, i.e. the whole load path, until
    every future is done and the device is synchronized (with publish="issued" a future is done once its copy
    is issued, so the synchronize is what waits for the bytes; the raw copies end the same way).
    Not timed: unmapping the previous round's experts (eviction happens off this path).
    Raw: the same experts' bytes from the same pinned store into a plain device buffer, one copy each on one
    stream, timed in turn with the lists (each repetition times a list, then the raw copies).
    Also reported, per pipelined load: where the host->device worker (and its retire thread) spent their time.
    """
    fmt = store.format
    n = fmt.num_bytes
    pool = ExpertSlotPool(make_backend(dev), dev, 1, batch, n, batch, poison_unmapped=poison_unmapped,
                          **pool_modes(map_in))
    loader = ExpertLoadHandler(pool, engine, pinned=store, map_in=map_in, publish=publish)
    srcs = [store.buffer[off : off + n] for off in store.offsets(0, list(range(batch)))]  # [n] each
    dsts = dev.alloc(n * batch).view(batch, n)  # [batch, n]
    stream = dev.new_stream()

    def evict_all() -> None:
        for e in pool.resident_experts(0):
            pool.unmap(0, e)

    def load_all() -> None:
        wait_all(loader.load_many(0, list(range(batch))) if submit == "list" else
                 [loader.load(0, e, StoreKind.PINNED) for e in range(batch)])

    def raw_all() -> None:
        for i, src in enumerate(srcs):
            dev.copy(dsts[i], src, stream)

    def load_one() -> None:
        loader.load(0, 0, StoreKind.PINNED).wait()

    before = engine.stats()["links"]["h2d"]
    # 20 lists after 5 warm-up lists: the median rides out a lease's hiccups and a cold start's first remaps
    batch_s, raw_s = timed_in_turn(dev, [(load_all, evict_all), (raw_all, None)], reps * 2, warmup=5)
    after, num_loads = engine.stats()["links"]["h2d"], (reps * 2 + 5) * batch  # warm-ups included
    worker_us = {k.removesuffix("_s"): (after[k] - before[k]) / num_loads * 1e6 for k in WORKER_PHASES}
    one_s = timed(dev, load_one, reps * 2, setup=evict_all)
    loader.close()
    pool.close()
    raw = n * batch / raw_s / 1e9
    return {"expert_bytes": n, "batch": batch, "pipelined_gbps": n * batch / batch_s / 1e9,
            "single_gbps": n / one_s / 1e9, "single_ms": one_s * 1e3, "raw_gbps": raw,
            "pipelined_ratio": n * batch / batch_s / 1e9 / raw, "map_in": map_in, "submit": submit, "publish": publish,
            "worker_us_per_load": worker_us}


def map_cost_us(dev: Device, stride_bytes: int, n: int) -> dict[str, float]:
    be = make_backend(dev)
    stride_bytes = align_up(stride_bytes, be.granularity_bytes)
    va = be.reserve(stride_bytes * n)
    phys = [be.create_physical(stride_bytes) for _ in range(n)]
    maps, unmaps = [], []
    for _ in range(3):
        for i, p in enumerate(phys):
            t0 = time.perf_counter()
            be.map(va + i * stride_bytes, stride_bytes, p)
            maps.append(time.perf_counter() - t0)
        for i in range(n):
            t0 = time.perf_counter()
            be.unmap(va + i * stride_bytes, stride_bytes)
            unmaps.append(time.perf_counter() - t0)
    be.close()
    return {"stride_bytes": stride_bytes, "map_access_us_median": statistics.median(maps) * 1e6,
            "map_access_us_p90": sorted(maps)[int(0.9 * len(maps))] * 1e6,
            "unmap_us_median": statistics.median(unmaps) * 1e6}


def map_while_copying_us(dev: Device, stride_bytes: int, copy_bytes: int = 256 * MiB) -> dict[str, float]:
    """Do map / unmap wait for DMA already in flight? Time each while a large H2D copy runs on a side stream,
    and whether the copy was already finished when the call returned (if unmap waits, it always is)."""
    be = make_backend(dev)
    stride_bytes = align_up(stride_bytes, be.granularity_bytes)
    va = be.reserve(stride_bytes)
    phys = be.create_physical(stride_bytes)
    host, d = dev.alloc_host(copy_bytes), dev.alloc(copy_bytes)
    stream = dev.new_stream()
    out: dict[str, list[float]] = {"map": [], "unmap": [], "copy_done_after_map": [], "copy_done_after_unmap": []}
    for _ in range(5):
        for op in ("map", "unmap"):
            dev.synchronize()
            if op == "unmap":
                be.map(va, stride_bytes, phys)
                dev.synchronize()
            ev = dev.copy(d, host.tensor, stream)
            t0 = time.perf_counter()
            be.map(va, stride_bytes, phys) if op == "map" else be.unmap(va, stride_bytes)
            out[op].append((time.perf_counter() - t0) * 1e6)
            out[f"copy_done_after_{op}"].append(float(ev.query()))
            if op == "map":
                dev.synchronize()
                be.unmap(va, stride_bytes)
    dev.synchronize()
    host.close()
    be.close()
    copy_us = copy_bytes / 55e9 * 1e6
    return {"stride_bytes": stride_bytes, "copy_bytes": copy_bytes, "copy_us_at_55GBps": copy_us,
            **{k: statistics.median(v) for k, v in out.items()}}


def engine_link_gbps(dev: Device, engine: TransferEngine, link: Link, num_bytes: int, f: DirectFile | None,
                     reps: int) -> float:
    host = dev.alloc_host(num_bytes)
    host.tensor.copy_(torch.randint(0, 256, (num_bytes,), dtype=torch.uint8))
    d = dev.alloc(num_bytes) if link in (Link.H2D, Link.D2H) else None
    src: Any = {Link.H2D: host.tensor, Link.D2H: d, Link.DISK2H: f.region(0, num_bytes) if f else None,
                Link.H2DISK: host.tensor}[link]
    dst: Any = {Link.H2D: d, Link.D2H: host.tensor, Link.DISK2H: host.tensor,
                Link.H2DISK: f.region(0, num_bytes) if f else None}[link]

    def go() -> None:
        engine.submit(TransferRequest(link, TrafficClass.EXPERT, src, dst)).wait()

    sec = timed(dev, go, reps, warmup=1)
    host.close()
    return num_bytes / sec / 1e9


def raw_disk_gbps(dev: Device, f: DirectFile, num_bytes: int, write: bool) -> float:
    buf = dev.alloc_host(num_bytes)
    buf.tensor.copy_(torch.randint(0, 256, (num_bytes,), dtype=torch.uint8))
    sec = timed(dev, lambda: (f.write_from if write else f.read_into)(0, buf.tensor), reps=2, warmup=1)
    buf.close()
    return num_bytes / sec / 1e9


def urgent_behind_stream(dev: Device, chunk_bytes: int | None, stream_bytes: int, small_bytes: int,
                         reps: int, max_inflight_bytes: int = 16 * MiB, urgent_stream: bool = False) -> dict[str, Any]:
    """Latency of a small URGENT KV copy submitted while a LOW expert stream of `stream_bytes` is queued."""
    engine = TransferEngine(dev, chunk_bytes=chunk_bytes, max_inflight_bytes=max_inflight_bytes,
                            urgent_stream=urgent_stream)
    big_h = dev.alloc_host(stream_bytes)
    big_d = dev.alloc(stream_bytes)
    small_h = dev.alloc_host(small_bytes)
    small_d = dev.alloc(small_bytes)
    lat, qd, big_lat = [], [], []
    for _ in range(reps):
        big = engine.submit(TransferRequest(Link.H2D, TrafficClass.EXPERT, big_h.tensor, big_d, Priority.LOW))
        time.sleep(0.001)  # the stream is on the wire
        small = engine.submit(TransferRequest(Link.H2D, TrafficClass.KV, small_h.tensor, small_d, Priority.URGENT))
        small.wait()
        big.wait()
        lat.append(small.latency_s)
        qd.append(small.queue_delay_s)
        big_lat.append(big.latency_s)
    engine.close()
    for b in (big_h, small_h):
        b.close()
    return {"chunk_bytes": chunk_bytes or 0, "max_inflight_bytes": max_inflight_bytes, "urgent_stream": urgent_stream,
            "urgent_latency_ms_median": statistics.median(lat) * 1e3,
            "urgent_queue_delay_ms_median": statistics.median(qd) * 1e3,
            "stream_ms_median": statistics.median(big_lat) * 1e3}


SECTIONS = ("raw", "loads", "map", "links", "urgent", "calls", "kvmoves")


_ENGINE = EngineConfig()  # the reference engine's defaults, which the default load config measures


@dataclass(frozen=True)
class LoadConfig:
    """One transfer-engine + loader setting the loads section measures; the defaults are the engine's."""

    chunk_bytes: int
    max_inflight_bytes: int
    poison_unmapped: bool = _ENGINE.expert_poison  # False: absent experts are unmapped (a read faults)
    urgent_stream: bool = False  # urgent KV copies on their own stream, so the bulk bound can be deep
    map_in: MapIn = "beside_copy"  # when the link worker maps a slot (a pool read through its ranges, as here)
    submit: str = "list"  # a prefetch list as one load_many call ("list") or one load() per expert ("each")
    retire_thread: bool = _ENGINE.transfer_retire_thread  # finished copies accounted on a retire thread
    publish: Publish = _ENGINE.expert_publish  # a load is published once its copy is done, or once issued


_DEFAULT = LoadConfig(8 * MiB, 16 * MiB)
_POISON = replace(_DEFAULT, poison_unmapped=True)  # absent experts read as NaN: one more driver call per load
_RETIRE = replace(_DEFAULT, retire_thread=True)
_BEFORE = replace(_DEFAULT, map_in="before_copy")  # each range mapped before its copy (the earlier default)
_OTHER_PUBLISH = replace(_DEFAULT, publish="done" if _DEFAULT.publish == "issued" else "issued")
_DEEP = replace(_DEFAULT, max_inflight_bytes=64 * MiB, urgent_stream=True)
LOAD_CONFIG_SETS: dict[str, list[LoadConfig]] = {
    "default": [_DEFAULT],
    "urgent-stream": [_DEFAULT, _DEEP],
    "map-in": [_DEFAULT, _OTHER_PUBLISH, _BEFORE, replace(_BEFORE, publish=_OTHER_PUBLISH.publish)],
    "submit": [_DEFAULT, _POISON, _RETIRE, replace(_POISON, retire_thread=True), replace(_DEFAULT, submit="each")],
    "all": [_DEFAULT, _POISON, _RETIRE, _BEFORE, _OTHER_PUBLISH, _DEEP],
}


def run_substrate_bench(out_dir: Path, device: str = "cuda", quick: bool = False, console: Any = None,
                        sections: tuple[str, ...] = SECTIONS, load_configs: str = "all") -> dict:
    """Run the chosen sections (all by default) and write the results; a partial run writes what it ran."""
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown bench sections {sorted(unknown)}; expected some of {SECTIONS}")
    if load_configs not in LOAD_CONFIG_SETS:
        raise ValueError(f"unknown load config set {load_configs!r}; expected one of {sorted(LOAD_CONFIG_SETS)}")
    dev = Device(device)
    say = console.print if console is not None else print
    reps = 3 if quick else 10
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if dev.is_cuda else platform.processor() or "cpu",
                           "torch": torch.__version__, "quick": quick, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "gil_switch_interval_us": sys.getswitchinterval() * 1e6}
    if "raw" in sections:
        sizes = [2 * MiB, 8 * MiB] if quick else [2 * MiB, 8 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB]
        res["raw_h2d_gbps"] = {str(s): raw_copy_gbps(dev, s, reps) for s in sizes}
        res["raw_d2h_gbps"] = {str(s): raw_copy_gbps(dev, s, reps, to_device=False) for s in sizes}
        say(f"raw h2d: {res['raw_h2d_gbps']}")
    if "loads" in sections:
        # Prefetch batches a decode step really issues: at B>=32 ~110 of Qwen3's 128 experts per layer are active.
        shapes = [(256, 512, 4)] if quick else [(2048, 768, 16), (2048, 768, 64), (4096, 1024, 32), (4096, 14336, 4)]
        configs = [LoadConfig(4 * MiB, 16 * MiB), replace(_BEFORE, chunk_bytes=4 * MiB)] if quick \
            else LOAD_CONFIG_SETS[load_configs]
        res["expert_loads"] = []
        stores = [pinned_experts(dev, *shape) for shape in shapes]  # made once: random weights take a while
        try:
            for c in configs:
                with TransferEngine(dev, chunk_bytes=c.chunk_bytes, max_inflight_bytes=c.max_inflight_bytes,
                                    urgent_stream=c.urgent_stream, retire_thread=c.retire_thread) as eng:
                    for (_h, _i, b), store in zip(shapes, stores, strict=True):
                        r = expert_load_gbps(dev, eng, store, b, reps, poison_unmapped=c.poison_unmapped,
                                             map_in=c.map_in, submit=c.submit, publish=c.publish)
                        res["expert_loads"].append({**r, **asdict(c)})
        finally:
            for store in stores:
                store.close()
        say(f"expert loads: {res['expert_loads']}")
    if "calls" in sections:
        from tierplan.bench.host_calls import host_call_costs

        store = pinned_experts(dev, *((256, 512, 4) if quick else (2048, 768, 64)))
        try:
            res["host_calls"] = host_call_costs(dev, store, 4 if quick else 64)
        finally:
            store.close()
        say(f"host calls: {res['host_calls']}")
    if "map" in sections:
        strides = [2 * MiB] if quick else [2 * MiB, 10 * MiB, 336 * MiB]
        res["map_cost"] = [map_cost_us(dev, s, 8 if quick else 32 if s < 100 * MiB else 8) for s in strides]
        res["map_while_copying"] = map_while_copying_us(dev, 10 * MiB, 16 * MiB if quick else 256 * MiB)
        say(f"map cost: {res['map_cost']}; while copying: {res['map_while_copying']}")
    if "links" in sections:
        res.update(_links(dev, 8 * MiB if quick else 1024 * MiB, reps))
        say(f"links: {res['links']}")
    if "urgent" in sections:
        stream_bytes = 32 * MiB if quick else 1024 * MiB
        res["urgent_kv"] = [urgent_behind_stream(dev, c, stream_bytes, 64 << 10, reps, k, u)
                            for c, k, u in [(4 * MiB, 16 * MiB, False), (8 * MiB, 16 * MiB, False),
                                            (None, 16 * MiB, False), (8 * MiB, 64 * MiB, True)]]
        say(f"urgent kv: {res['urgent_kv']}")
    if "kvmoves" in sections:
        from tierplan.bench.kv_moves import kv_move_costs

        # The phase sweep's KV block (qwen3-30b-a3b, 16 tokens) and a cut's worth of them (a 1 GiB list).
        res["kv_moves"] = kv_move_costs(dev, 64 << 10 if quick else 256 << 10, 64 if quick else 4096, reps)
        say(f"kv moves: {res['kv_moves']}")
    write_substrate_report(out_dir, res, device)
    return res


def _links(dev: Device, link_bytes: int, reps: int) -> dict[str, Any]:
    with TransferEngine(dev) as engine, workdir_for(None) as td:  # not tmpfs: O_DIRECT must hold
        f = DirectFile(td / "link.tpnvme", link_bytes)
        links = {
            "h2d": {"engine_gbps": engine_link_gbps(dev, engine, Link.H2D, link_bytes, None, reps),
                    "raw_gbps": raw_copy_gbps(dev, link_bytes, reps)},
            "d2h": {"engine_gbps": engine_link_gbps(dev, engine, Link.D2H, link_bytes, None, reps),
                    "raw_gbps": raw_copy_gbps(dev, link_bytes, reps, to_device=False)},
            "h2disk": {"raw_gbps": raw_disk_gbps(dev, f, link_bytes, write=True),
                       "engine_gbps": engine_link_gbps(dev, engine, Link.H2DISK, link_bytes, f, 2)},
            "disk2h": {"raw_gbps": raw_disk_gbps(dev, f, link_bytes, write=False),
                       "engine_gbps": engine_link_gbps(dev, engine, Link.DISK2H, link_bytes, f, 2)},
        }
        direct = f.direct_io
        f.close()
    for v in links.values():
        v["ratio"] = v["engine_gbps"] / v["raw_gbps"]
    return {"links": links, "disk_direct_io": direct}
