"""`tierplan check slots`: random expert remaps through the slot pool, every read verified.

Runs in one process on the CPU twin or one CUDA GPU. Each step loads a random absent expert (pinned or
NVMe store), evicting a random unpinned resident one when no slot is free; freed slots are scrubbed with
poison, so a wrong mapping or a partial load shows up. Reads run on a compute stream that waits on the
load (RAW) and records its event on the slot (WAR); a read whose fingerprint differs from the expert's
is a stale read. Absent experts must read as poison.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tierplan.runtime.device import Device
from tierplan.runtime.memory.backend import make_backend
from tierplan.runtime.memory.slots import POISON_BYTE, ExpertSlotPool
from tierplan.runtime.selfcheck.common import Progress, build_experts, fingerprint, workdir_for
from tierplan.runtime.transfer import TransferEngine
from tierplan.runtime.weights.loader import ExpertLoadHandler, StoreKind


@dataclass
class SlotCheckResult:
    remaps: int
    stale_reads: int
    poison_reads: int
    reads_checked: int
    pins: int
    evictions: int
    seconds: float
    device: str

    def line(self) -> str:
        return f"slots: remaps={self.remaps} stale_reads={self.stale_reads}"


def run_slot_check(remaps: int, seed: int, device: str = "cpu", workdir: str | Path | None = None,
                   progress: Progress | None = None) -> SlotCheckResult:
    rng = random.Random(seed)
    dev = Device(device)
    layers, experts, slots = 3, 16, 20
    hidden, inter = (256, 640) if dev.is_cuda else (64, 96)
    t0 = time.perf_counter()
    with workdir_for(workdir) as wd:
        fx = build_experts(dev, wd, layers, experts, hidden, inter, seed)
        pool = ExpertSlotPool(make_backend(dev), dev, layers, experts, fx.format.num_bytes, slots,
                              poison_unmapped=True, scrub_on_unmap=True, slot_window=True)
        engine = TransferEngine(dev)
        # Copies through the slot window, ranges mapped beside them (the engine's default), published once issued:
        # the stricter mode for readers (they must wait on the copy's event), so the check covers it.
        loader = ExpertLoadHandler(pool, engine, fx.pinned, fx.nvme, map_in="beside_copy", publish="issued")
        stream = dev.new_stream()
        poison = torch.full((fx.format.num_bytes,), POISON_BYTE, dtype=torch.uint8)
        poison_fp = int(fingerprint(poison))
        got: list[torch.Tensor] = []  # 0-d device tensors, compared in batches
        want: list[int] = []
        stale = 0
        reads = poison_reads = pins = evictions = 0

        def read(layer: int, e: int, expect: int) -> None:
            nonlocal reads
            if expect != poison_fp:
                pool.wait_ready(layer, [e], stream)
            view = pool.layer_tensor(layer)[e * pool.layout.stride_bytes :][: fx.format.num_bytes]
            if dev.is_cuda:
                with torch.cuda.stream(stream):
                    got.append(fingerprint(view))
                if expect != poison_fp:
                    pool.record_read(layer, [e], dev.record_event(stream), stream)
            else:
                got.append(fingerprint(view))
            want.append(expect)
            reads += 1

        def flush() -> int:
            if not got:
                return 0
            vals = torch.stack(got).cpu().tolist()
            bad = sum(1 for g, w in zip(vals, want, strict=True) if g != w)
            got.clear()
            want.clear()
            return bad

        try:
            for i in range(remaps):
                absent = [(lay, e) for lay in range(layers) for e in range(experts) if not pool.is_resident(lay, e)]
                layer, e = rng.choice(absent)
                if pool.num_free_slots == 0:
                    victims = [(lay, x) for lay in range(layers) for x in pool.resident_experts(lay)
                               if not pool.is_pinned(lay, x)]
                    vl, ve = rng.choice(victims)
                    pool.unmap(vl, ve, wait=True)
                    evictions += 1
                    read(vl, ve, poison_fp)  # I5: the evicted range shows poison, not the old bytes
                    poison_reads += 1
                    # That read holds no slot, so no reader event protects it: finish it before a later load
                    # remaps this range under it.
                    dev.record_event(stream).synchronize()
                kind = StoreKind.NVME if rng.random() < 0.25 else StoreKind.PINNED
                loader.load(layer, e, kind).wait()
                read(layer, e, fx.expected[(layer, e)])
                for lay in range(layers):  # re-read a random resident expert of each layer: nothing else moved
                    res = pool.resident_experts(lay)
                    if res:
                        x = rng.choice(res)
                        read(lay, x, fx.expected[(lay, x)])
                if rng.random() < 0.05:
                    res = [x for x in pool.resident_experts(layer) if not pool.is_pinned(layer, x)]
                    pinned = [x for x in pool.resident_experts(layer) if pool.is_pinned(layer, x)]
                    if res and len(pinned) < 3:
                        pool.pin(layer, rng.choice(res))
                        pins += 1
                    elif pinned:
                        pool.unpin(layer, rng.choice(pinned))
                if i % 64 == 63:
                    stale += flush()
                    pool.check_invariants()
                if progress is not None:
                    progress(1)
            stale += flush()
            pool.check_invariants()
            assert pool.remaps == remaps, f"pool counted {pool.remaps} remaps, asked for {remaps}"
        finally:
            dev.synchronize()
            engine.close()
            loader.close()
            pool.close()
            fx.close()
    return SlotCheckResult(remaps, stale, poison_reads, reads, pins, evictions, time.perf_counter() - t0, device)
