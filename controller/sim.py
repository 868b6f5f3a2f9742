"""Trace-driven simulator over the cost model: plans past the machine at hand.

Runs in `tierplan sim` (and tests). Pure Python + numpy. Requests arrive on a clock, are batched continuously
(`SimScheduler`, the engine's rules), each step's tokens are routed by a real routing trace (rows as the
engine's ForcedRouter picks them), an expert-cache policy says which experts each layer missed or had
streamed ahead, KV swaps become block fetches and spills, and `CostModel.step_time_ms` prices the step.
The clock advances by the priced step (or by `virtual_step_s`, the demo's step clock, so arrivals meet the
same batches as an engine run paced that way). It never imports torch/runtime, reads files (callers load
traces) or draws plots (api/sim_report.py does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from tierplan.controller.costmodel import CostModel, StepLoad
from tierplan.controller.model_shape import ModelShape
from tierplan.controller.protocol import StallCause
from tierplan.controller.sim_policy import ExpertCachePolicy
from tierplan.controller.sim_sched import SimScheduler, SimSeq
from tierplan.controller.sim_traces import RoutingTrace, SimRequest


@dataclass(frozen=True)
class SimConfig:
    kv_gpu_blocks: int
    max_batch: int = 16
    kv_cpu_blocks: int = 1 << 30  # swapped-out KV beyond this goes to NVMe
    max_prefill_tokens: int = 2048
    virtual_step_s: float | None = None  # None: the clock advances by each step's predicted time
    max_steps: int | None = None


@dataclass(frozen=True)
class StepRecord:
    step: int
    clock_s: float  # the scheduling clock when the step was formed
    num_prefills: int
    num_decodes: int
    batch_tokens: int
    context_tokens: int
    active_experts: int  # summed over MoE layers
    hits: int
    misses: int
    prefetches: int
    kv_fetch_blocks: int
    kv_spill_blocks: int
    total_ms: float
    compute_ms: float
    expert_stall_ms: float
    kv_stall_ms: float
    both_stall_ms: float


@dataclass
class SimReport:
    """Steps and finished requests. Throughput is over the priced step times; request latencies (TTFT, TPOT)
    are on the scheduling clock, so under `virtual_step_s` they are in step-clock time."""

    steps: list[StepRecord]
    requests: list[dict[str, float]]
    policy: str
    num_slots: int
    config: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        total = np.array([s.total_ms for s in self.steps]) if self.steps else np.zeros(1)
        decode = np.array([s.total_ms for s in self.steps if s.num_prefills == 0]) if self.steps else np.zeros(1)
        hits, misses = sum(s.hits for s in self.steps), sum(s.misses for s in self.steps)
        tokens_out = sum(s.num_prefills + s.num_decodes for s in self.steps)
        busy_s = float(total.sum()) / 1e3
        stalls = {c: sum(getattr(s, f"{c}_stall_ms") for s in self.steps) for c in ("expert", "kv", "both")}

        def pct(key: str, q: float) -> float:
            vals = sorted(r[key] for r in self.requests)
            return vals[min(len(vals) - 1, int(q * len(vals)))] * 1e3 if vals else 0.0

        return {"policy": self.policy, "num_slots": self.num_slots, "steps": len(self.steps),
                "requests": len(self.requests), "tokens_out": tokens_out,
                "tokens_per_s": tokens_out / busy_s if busy_s else 0.0, "step_ms_mean": float(total.mean()),
                "step_ms_p50": float(np.median(total)), "step_ms_p99": float(np.quantile(total, 0.99)),
                "decode_steps": int(decode.size) if self.steps else 0,
                "decode_step_ms_mean": float(decode.mean()) if decode.size else 0.0,
                "decode_step_ms_p50": float(np.median(decode)) if decode.size else 0.0,
                "expert_hit_rate": hits / (hits + misses) if hits + misses else 1.0,
                "compute_ms_total": sum(s.compute_ms for s in self.steps),
                **{f"{c}_stall_ms_total": v for c, v in stalls.items()},
                "ttft_ms_p50": pct("ttft_s", 0.5), "ttft_ms_p99": pct("ttft_s", 0.99),
                "tpot_ms_p50": pct("tpot_s", 0.5), "tpot_ms_p99": pct("tpot_s", 0.99),
                "preemptions": int(sum(r["preemptions"] for r in self.requests))}

    def to_dict(self) -> dict[str, Any]:
        """Summary, inputs and the steps as columns (one list per StepRecord field; ms to 1 µs)."""
        names = [f.name for f in fields(StepRecord)]
        cols = {n: [round(v, 3) if isinstance(v := getattr(s, n), float) else v for s in self.steps] for n in names}
        return {"summary": self.summary(), "config": self.config, "steps": cols}


def expert_slots_for(shape: ModelShape, hbm_bytes: int, kv_gpu_blocks: int, workspace_bytes: int = 0) -> int:
    """Expert slots left in HBM once dense weights, the GPU KV blocks and activation workspace are placed."""
    free = hbm_bytes - shape.dense_bytes - kv_gpu_blocks * shape.kv_bytes_per_block - workspace_bytes
    if free < shape.expert_bytes:
        raise ValueError(f"HBM of {hbm_bytes / 2**30:.1f} GiB holds no expert slot: dense weights "
                         f"{shape.dense_bytes / 2**30:.1f} GiB + {kv_gpu_blocks} KV blocks "
                         f"{kv_gpu_blocks * shape.kv_bytes_per_block / 2**30:.1f} GiB + workspace "
                         f"{workspace_bytes / 2**30:.1f} GiB leave {max(free, 0) / 2**30:.2f} GiB")
    return min(free // shape.expert_bytes, shape.num_moe_layers * shape.num_experts)


class Simulator:
    def __init__(self, shape: ModelShape, cost: CostModel, trace: RoutingTrace, policy: ExpertCachePolicy,
                 config: SimConfig, num_slots: int) -> None:
        if trace.ids.shape[1] != shape.num_moe_layers:
            raise ValueError(f"Simulator: routing trace fitted to {trace.ids.shape[1]} MoE layers, the model has "
                             f"{shape.num_moe_layers}")
        self.shape, self.cost, self.trace, self.policy, self.cfg = shape, cost, trace, policy, config
        self.num_slots = num_slots

    def _kv_moves(self, batch: Any, where: dict[int, str], sched: SimScheduler) -> dict[str, int]:
        """Blocks swapped out (to host, past its room to NVMe) and back in this step."""
        bb = self.shape.kv_bytes_per_block
        on_cpu = sum(n for sid, n in ((k, sched.blocks_for(v)) for k, v in self._swapped_tokens.items())
                     if where.get(sid) == "cpu")
        moves = {"spill": 0, "disk_write": 0, "fetch": 0, "disk_read": 0}
        for s in batch.preempted:
            n = sched.blocks_for(s.num_computed)
            tier = "cpu" if on_cpu + n <= self.cfg.kv_cpu_blocks else "nvme"
            where[s.req.request_id], self._swapped_tokens[s.req.request_id] = tier, s.num_computed
            on_cpu += n if tier == "cpu" else 0
            moves["spill"] += n
            moves["disk_write"] += n if tier == "nvme" else 0
        for s in batch.swapped_in:
            n = sched.blocks_for(self._swapped_tokens.pop(s.req.request_id, s.num_computed))
            moves["disk_read" if where.pop(s.req.request_id, "cpu") == "nvme" else "fetch"] += n
        return {k: v * bb for k, v in moves.items()} | {f"{k}_count": v for k, v in moves.items()}

    def run(self, requests: list[SimRequest], on_finished: Callable[[int], None] | None = None) -> SimReport:
        """Replay `requests` to the end (or `max_steps`); `on_finished(n)` hears of n more finished requests."""
        cfg = self.cfg
        sched = SimScheduler(cfg.kv_gpu_blocks, self.shape.block_tokens, cfg.max_batch, cfg.max_prefill_tokens)
        for r in requests:
            sched.add(r)
        self._swapped_tokens: dict[int, int] = {}
        where: dict[int, str] = {}
        steps: list[StepRecord] = []
        clock, offset, arrived = 0.0, 0.0, {}
        while not sched.idle and (cfg.max_steps is None or len(steps) < cfg.max_steps):
            now = (len(steps) * cfg.virtual_step_s if cfg.virtual_step_s else clock) + offset
            for s in sched.waiting:
                if s.req.arrival_s <= now:
                    arrived.setdefault(s.req.request_id, now)
            batch = sched.schedule(now)
            kv = self._kv_moves(batch, where, sched)
            if batch.empty:
                nxt = sched.next_arrival_s()
                if nxt is None or nxt <= now:
                    raise RuntimeError(f"simulated scheduler made no progress with {len(sched.waiting)} waiting and "
                                       f"{len(sched.swapped)} swapped out")
                offset += nxt - now
                continue
            run: list[SimSeq] = batch.prefills + batch.decodes
            rows = self.trace.span_row_index([(s.req.request_id, s.num_computed, s.num_tokens - s.num_computed)
                                              for s in run])  # [N]
            num_rows = rows.size
            ids = self.trace.ids[np.unique(rows)]  # [U, M, k]: a long prefill repeats trace rows
            used = np.zeros((ids.shape[1], self.shape.num_experts), dtype=bool)  # [M, E]
            used[np.arange(ids.shape[1])[None, :, None], ids] = True
            unions = [np.flatnonzero(row) for row in used]
            out = self.policy.on_step(unions)
            load = StepLoad(batch_tokens=num_rows, context_tokens=sum(s.num_tokens for s in run),
                            active_experts=tuple(len(u) for u in unions), miss_count=out.misses,
                            prefetch_count=out.prefetches, kv_fetch_bytes=kv["fetch"],
                            kv_fetch_count=kv["fetch_count"], kv_disk_read_bytes=kv["disk_read"],
                            kv_disk_read_count=kv["disk_read_count"], kv_spill_bytes=kv["spill"],
                            kv_spill_count=kv["spill_count"], kv_disk_write_bytes=kv["disk_write"],
                            kv_disk_write_count=kv["disk_write_count"],
                            chunked=out.chunked and not batch.prefills)  # a prefill step runs eagerly anyway
            b = self.cost.step_time_ms(load)
            clock += b.total_ms / 1e3
            done_at = (len(steps) + 1) * cfg.virtual_step_s + offset if cfg.virtual_step_s else clock + offset
            num_done = len(sched.finished)
            for s in run:
                sched.complete(s, done_at)
            if on_finished is not None and len(sched.finished) > num_done:
                on_finished(len(sched.finished) - num_done)
            steps.append(StepRecord(
                len(steps), now, len(batch.prefills), len(batch.decodes), num_rows, load.context_tokens,
                sum(load.active_experts), sum(out.hits), sum(out.misses), sum(out.prefetches),
                kv["fetch_count"] + kv["disk_read_count"], kv["spill_count"], b.total_ms, b.compute_ms,
                b.stall_ms[StallCause.EXPERT_MISS], b.stall_ms[StallCause.KV_MISS], b.stall_ms[StallCause.BOTH]))
        reqs = []
        for s in sorted(sched.finished, key=lambda s: s.req.request_id):
            a = arrived.get(s.req.request_id, s.req.arrival_s)
            n = s.num_out
            reqs.append({"request_id": s.req.request_id, "ttft_s": (s.first_token_s or a) - a,
                         "tpot_s": ((s.finish_s or 0) - (s.first_token_s or 0)) / (n - 1) if n > 1 else 0.0,
                         "preemptions": s.num_preemptions})
        conf = {"shape": self.shape.to_dict(), "sim": asdict(cfg), "num_slots": self.num_slots}
        return SimReport(steps, reqs, self.policy.name, self.num_slots, conf)
