"""`tierplan check tiers`: random KV moves over every tier pair interleaved with expert loads.

Runs in one process on the CPU twin or one CUDA GPU. KV blocks hold random bytes whose checksums are
known; each step either moves a random idle block to another tier with room (up to `window` moves in
flight) or loads an expert from the pinned or NVMe store into the slot pool. From time to time a byte
is flipped in the NVMe file under a KV block or an expert record; the runtime must detect every one
(the move, load or final sweep fails with CorruptDataError), after which the block is rewritten (as an
engine would recompute it). A mismatch is any byte that arrives different without being detected.
It cannot pass by accident: after every move that reports success the block must sit on the destination
tier in the books (else it is `misplaced`) and its bytes, read back from where the books say, must be the
ones written (else a mismatch); a move that reports success without moving a byte fails the check.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from tierplan.runtime.checksum import checksum
from tierplan.runtime.device import Device
from tierplan.runtime.errors import CorruptDataError
from tierplan.runtime.future import OpFuture
from tierplan.runtime.kv import KVBlockManager, KVTierStores, KVTransferHandler, Tier
from tierplan.runtime.memory.backend import make_backend
from tierplan.runtime.memory.slots import ExpertSlotPool
from tierplan.runtime.selfcheck.common import ExpertFixture, Progress, build_experts, flip_byte, workdir_for
from tierplan.runtime.transfer import TransferEngine
from tierplan.runtime.weights.loader import ExpertLoadHandler, StoreKind


@dataclass
class TierCheckResult:
    moves: int
    kv_moves: int
    expert_loads: int
    mismatches: int
    misplaced: int  # moves that reported success with the block not on their destination tier in the books
    verified: int  # moves and loads whose result was read back and compared after they reported success
    injected: int
    corrupt_detected: int
    unexpected_errors: int
    seconds: float
    device: str
    direct_io: bool

    @property
    def ok(self) -> bool:
        return (self.mismatches == 0 and self.misplaced == 0 and self.unexpected_errors == 0
                and self.corrupt_detected == self.injected and self.verified > 0)

    def line(self) -> str:
        return (f"tiers: moves={self.moves} verified={self.verified} mismatches={self.mismatches} "
                f"misplaced={self.misplaced} corrupt_detected={self.corrupt_detected}")


def run_tier_check(moves: int, seed: int, device: str = "cpu", workdir: str | Path | None = None,
                   inject_every: int = 500, window: int = 32, progress: Progress | None = None) -> TierCheckResult:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dev = Device(device)
    block_bytes = 16 << 10
    cap = {Tier.GPU: 96, Tier.CPU: 96, Tier.NVME: 192}
    num_blocks = 256  # leaves room on every tier so any pair can be drawn
    layers, experts, slots = 2, 16, 12
    t0 = time.perf_counter()
    with workdir_for(workdir) as wd:
        engine = TransferEngine(dev)
        stores = KVTierStores(dev, block_bytes, cap, wd / "kv.tpnvme")
        mgr = KVBlockManager(cap)
        kv = KVTransferHandler(mgr, stores, engine)
        fx = build_experts(dev, wd, layers, experts, 64, 96, seed)
        pool = ExpertSlotPool(make_backend(dev), dev, layers, experts, fx.format.num_bytes, slots,
                              poison_unmapped=True, slot_window=True)
        # Copies through the slot window, ranges mapped beside them (the engine's default), published once issued:
        # the stricter mode for readers (they must wait on the copy's event), so the check covers it.
        loader = ExpertLoadHandler(pool, engine, fx.pinned, fx.nvme, map_in="beside_copy", publish="issued")
        truth: dict[int, torch.Tensor] = {}
        tainted_blocks: set[int] = set()
        tainted_experts: set[tuple[int, int]] = set()
        counts = {"mismatches": 0, "misplaced": 0, "verified": 0, "injected": 0, "detected": 0, "unexpected": 0,
                  "kv": 0, "expert": 0}
        kv_dst: dict[int, Tier] = {}  # destination of each KV move in flight
        inflight: deque[tuple[str, object, OpFuture]] = deque()
        busy: set[object] = set()

        def write_truth(b: int) -> None:
            data = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8, generator=gen)
            truth[b] = data
            kv.write(b, data)

        def settle(kind: str, key: object, fut: OpFuture) -> None:
            try:
                fut.wait()
            except CorruptDataError:
                if kind == "kv" and key in tainted_blocks:
                    tainted_blocks.discard(key)
                    counts["detected"] += 1
                    kv.write(key, truth[key])  # repair in place: the block stayed on NVMe
                elif kind == "expert" and key in tainted_experts:
                    tainted_experts.discard(key)
                    counts["detected"] += 1
                    _repair_expert(fx, key)
                else:
                    counts["unexpected"] += 1
            except Exception:
                counts["unexpected"] += 1
            else:
                counts["verified"] += 1
                if kind == "expert":
                    lay, e = key
                    pool.wait_ready(lay, [e])  # published once issued: the read waits on the copy's event
                    got = pool.expert_tensor(lay, e).cpu()
                    if checksum(got) != fx.pinned.checksum(lay, e):
                        counts["mismatches"] += 1
                else:
                    verify_moved(key, kv_dst[key])
            if kind == "kv":
                kv_dst.pop(key)  # type: ignore[call-overload]
            busy.discard(key)
            if progress is not None:
                progress(1)

        def verify_moved(b: int, dst: Tier) -> None:
            """The books say `dst`, and the bytes there are the block's; else count it and rewrite the block."""
            if mgr.location(b).tier is not dst:
                counts["misplaced"] += 1
                return
            try:
                same = torch.equal(kv.read(b), truth[b])
            except CorruptDataError:  # not tainted (that move would have failed): stale bytes where the books say
                same = False
            if not same:
                counts["mismatches"] += 1
                kv.write(b, truth[b])  # so later moves of this block are checked against good bytes again

        def drain(limit: int) -> None:
            while len(inflight) > limit:
                settle(*inflight.popleft())

        def inject() -> None:
            if rng.random() < 0.5:
                cands = [b for b in truth if b not in busy and b not in tainted_blocks
                         and mgr.location(b).tier is Tier.NVME]
                if cands:
                    b = rng.choice(cands)
                    region = stores.region(mgr.location(b))
                    flip_byte(stores.nvme_file.path, region.offset_bytes + rng.randrange(block_bytes))
                    tainted_blocks.add(b)
                    counts["injected"] += 1
                    return
            cands_e = [(la, e) for la in range(layers) for e in range(experts)
                       if (la, e) not in busy and (la, e) not in tainted_experts]
            key = rng.choice(cands_e)
            region = fx.nvme.region(*key)
            flip_byte(fx.nvme.path, region.offset_bytes + rng.randrange(fx.format.num_bytes))
            tainted_experts.add(key)
            counts["injected"] += 1

        def submit_expert() -> None:
            absent = [(la, e) for la in range(layers) for e in range(experts)
                      if (la, e) not in busy and not pool.is_resident(la, e)]
            key = rng.choice(absent)
            if pool.num_free_slots == 0:
                resident = [(la, e) for la in range(layers) for e in pool.resident_experts(la) if (la, e) not in busy]
                if not resident:
                    drain(0)
                    return submit_expert()
                pool.unmap(*rng.choice(resident))
            kind = StoreKind.NVME if (key in tainted_experts or rng.random() < 0.5) else StoreKind.PINNED
            busy.add(key)
            inflight.append(("expert", key, loader.load(*key, kind)))
            counts["expert"] += 1

        def submit_kv() -> None:
            while True:
                b = rng.choice(block_ids)
                if b in busy:
                    drain(0)
                    continue
                here = mgr.location(b).tier
                dsts = [t for t in Tier if t is not here and mgr.num_free(t) > 0]
                if dsts:
                    break
            busy.add(b)
            kv_dst[b] = rng.choice(dsts)
            inflight.append(("kv", b, kv.move(b, kv_dst[b])))
            counts["kv"] += 1

        try:
            tiers = list(Tier)
            for i in range(num_blocks):
                write_truth(mgr.allocate(tiers[i % 3]))
            block_ids = list(truth)
            for i in range(moves):
                if inject_every and i % inject_every == inject_every // 2:
                    drain(0)
                    inject()
                (submit_expert if rng.random() < 0.25 else submit_kv)()
                drain(window)
                if i % 997 == 0:  # spot-check a random idle block byte for byte
                    drain(0)
                    b = rng.choice([b for b in truth if b not in tainted_blocks])
                    counts["mismatches"] += int(not torch.equal(kv.read(b), truth[b]))
            drain(0)
            for b in list(truth):  # final sweep: every block, every byte; tainted ones must be caught
                try:
                    got = kv.read(b)
                except CorruptDataError:
                    if b in tainted_blocks:
                        tainted_blocks.discard(b)
                        counts["detected"] += 1
                    else:
                        counts["unexpected"] += 1
                    continue
                counts["mismatches"] += int(not torch.equal(got, truth[b]))
            for key in list(tainted_experts):  # undetected expert corruption: load it from NVMe now
                if pool.is_resident(*key):
                    pool.unmap(*key)
                if pool.num_free_slots == 0:
                    pool.unmap(*next((la, e) for la in range(layers) for e in pool.resident_experts(la)))
                settle("expert", key, loader.load(*key, StoreKind.NVME))
            pool.check_invariants()
        finally:
            dev.synchronize()
            engine.close()
            kv.close()
            loader.close()
            pool.close()
            stores.close()
            fx.close()
        direct = stores.nvme_file.direct_io if stores.nvme_file is not None else False
    return TierCheckResult(
        moves=counts["kv"] + counts["expert"], kv_moves=counts["kv"], expert_loads=counts["expert"],
        mismatches=counts["mismatches"], misplaced=counts["misplaced"], verified=counts["verified"],
        injected=counts["injected"], corrupt_detected=counts["detected"],
        unexpected_errors=counts["unexpected"], seconds=time.perf_counter() - t0, device=device, direct_io=direct,
    )


def run_tier_check_jobs(moves: int, seed: int, device: str = "cpu", workdir: str | Path | None = None,
                        inject_every: int = 500, jobs: int = 1) -> TierCheckResult:
    """Shard `moves` over `jobs` processes (seeds seed, seed+1, ...), each with its own tiers; sum the counts."""
    if jobs <= 1:
        return run_tier_check(moves, seed, device, workdir, inject_every)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    shares = [moves // jobs + (1 if j < moves % jobs else 0) for j in range(jobs)]
    wds = [None if workdir is None else Path(workdir) / f"job{j}" for j in range(jobs)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        parts = list(ex.map(run_tier_check, shares, [seed + j for j in range(jobs)], [device] * jobs, wds,
                            [inject_every] * jobs))
    total = {k: sum(getattr(p, k) for p in parts) for k in
             ("moves", "kv_moves", "expert_loads", "mismatches", "misplaced", "verified", "injected",
              "corrupt_detected", "unexpected_errors")}
    return TierCheckResult(**total, seconds=time.perf_counter() - t0, device=device,
                           direct_io=all(p.direct_io for p in parts))


def _repair_expert(fx: ExpertFixture, key: tuple[int, int]) -> None:
    """Rewrite an NVMe expert record from the pinned store (the checkpoint is the source of truth)."""
    fx.nvme.file.write_from(fx.nvme.region(*key).offset_bytes, fx.pinned.record(*key))
