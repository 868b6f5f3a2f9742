"""KV block lists moved GPU <-> CPU through the KV handler (the `kvmoves` section of `tierplan bench substrate`).

A plan that cuts the GPU KV share spills thousands of blocks at once: on the H100 host ~16,600 blocks of 256 KiB
took 1.24 s (75 µs a block) where the link carries one in ~5-10 µs (bench/results/phase_h200.md, session 29).
This times a list of blocks moved GPU -> CPU and back, per block: one `move` waited at a time, and one
`move_list` waited together, against raw copies of the same blocks on one stream (the floor, the same run). The
list's time is split into the caller's (reserving and submitting, then waiting) and the link worker's phases per
block (hook, issue, blocked, retire), so the host cost of a block shows where it goes.
Runs in the inference process on one GPU; on the CPU twin with --quick (no GPU-side figure means anything there).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from tierplan.runtime.device import Device
from tierplan.runtime.future import wait_every
from tierplan.runtime.kv import Tier
from tierplan.runtime.kv.handler import KVTransferHandler
from tierplan.runtime.kv.manager import KVBlockManager
from tierplan.runtime.kv.stores import KVTierStores
from tierplan.runtime.transfer import Link, TransferEngine

WORKER_PHASES = ("hook_s", "issue_s", "blocked_s", "retire_s")


def _raw_us_per_block(dev: Device, stores: KVTierStores, n: int, to_cpu: bool, reps: int) -> float:
    """Block copies one by one on one stream, GPU tier <-> CPU tier, in the order a list would take them: the
    call the link's worker makes for each (`Device.copy_range`, by address where cuda-python is there), no event
    but one sync at the end."""
    gpu, cpu = stores.tier_tensor(Tier.GPU).view(-1), stores.tier_tensor(Tier.CPU).view(-1)  # [N * B] each
    b = stores.block_bytes
    src, dst = (gpu, cpu) if to_cpu else (cpu, gpu)
    stream = dev.new_stream()
    times = []
    for _ in range(reps):
        dev.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            dev.copy_range(dst, i * b, src, i * b, b, stream, record=False)
        dev.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n * 1e6


def _worker_s(engine: TransferEngine, link: Link) -> dict[str, float]:
    stats = engine.stats()["links"][link.value]
    return {k: float(stats[k]) for k in WORKER_PHASES}


def _round_trip(dev: Device, engine: TransferEngine, handler: KVTransferHandler, manager: KVBlockManager,
                blocks: list[int], as_list: bool) -> dict[str, float]:
    """Every block GPU -> CPU, then back: per direction, µs per block in all and the caller's and worker's parts."""
    out: dict[str, float] = {}
    for dst, link, name in ((Tier.CPU, Link.D2H, "to_cpu"), (Tier.GPU, Link.H2D, "to_gpu")):
        for b in blocks:  # as the engine's kernels leave a block: no checksum until the bytes reach the host
            handler.mark_dirty(b)
        before = _worker_s(engine, link)
        dev.synchronize()
        t0 = time.perf_counter()
        if as_list:
            futures = handler.move_list(blocks, dst)
            t1 = time.perf_counter()
            wait_every(futures)  # as the engine waits for a list (PagedKVCache._move_all)
        else:
            t1 = t0
            for b in blocks:
                handler.move(b, dst).wait()
        t2 = time.perf_counter()
        after = _worker_s(engine, link)
        n = len(blocks)
        if any(manager.location(b).tier is not dst for b in blocks):
            raise RuntimeError(f"kvmoves: a block did not reach {dst.value}")
        out[f"{name}_us"] = (t2 - t0) / n * 1e6
        if as_list:
            out[f"{name}_submit_us"] = (t1 - t0) / n * 1e6
            out[f"{name}_wait_us"] = (t2 - t1) / n * 1e6
        for k in WORKER_PHASES:
            out[f"{name}_worker_{k.removesuffix('_s')}_us"] = (after[k] - before[k]) / n * 1e6
    return out


def kv_move_costs(dev: Device, block_bytes: int, num_blocks: int, reps: int) -> dict[str, Any]:
    """µs per block of a GPU -> CPU list and back: moved one at a time, as one list, and as raw copies."""
    caps = {Tier.GPU: num_blocks, Tier.CPU: num_blocks, Tier.NVME: 0}
    stores = KVTierStores(dev, block_bytes, caps)
    manager = KVBlockManager(caps)
    try:
        with TransferEngine(dev) as engine:
            handler = KVTransferHandler(manager, stores, engine)
            try:
                blocks = [manager.allocate(Tier.GPU) for _ in range(num_blocks)]
                gen = torch.Generator().manual_seed(0)
                for b in blocks[:8]:  # a few with real bytes: the round trip must keep them
                    handler.write(b, torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=gen))
                kept = {b: handler.read(b) for b in blocks[:8]}
                rows: dict[str, list[dict[str, float]]] = {"each": [], "list": []}
                for _ in range(reps):
                    for mode in rows:  # in turn within each repetition: drift hits both alike
                        rows[mode].append(_round_trip(dev, engine, handler, manager, blocks, mode == "list"))
                if any(not torch.equal(handler.read(b), want) for b, want in kept.items()):
                    raise RuntimeError("kvmoves: a block's bytes changed on the round trip")
                res: dict[str, Any] = {"block_bytes": block_bytes, "num_blocks": num_blocks, "reps": reps}
                for mode, runs in rows.items():
                    res[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            finally:
                handler.close(timeout_s=60)
        res["raw_to_cpu_us"] = _raw_us_per_block(dev, stores, num_blocks, True, reps)
        res["raw_to_gpu_us"] = _raw_us_per_block(dev, stores, num_blocks, False, reps)
    finally:
        stores.close()
    for d in ("to_cpu", "to_gpu"):
        res[f"list_over_raw_{d}"] = res["list"][f"{d}_us"] / max(res[f"raw_{d}_us"], 1e-9)
        res[f"each_over_list_{d}"] = res["each"][f"{d}_us"] / max(res["list"][f"{d}_us"], 1e-9)
    return res
