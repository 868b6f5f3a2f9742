"""Request replay on the reference engine: continuous batching, forced routing, per-request metrics.

Runs in the inference process. Requests arrive on a clock that is wall time plus jumps over idle gaps (a
CPU run does not sleep through a trace's quiet minutes). Each step: schedule, swap out or drop the
preempted, run one forward over the prefills and decodes together, record tokens. Metrics per request:
TTFT (arrival -> first token), TPOT (mean time per later token), end-to-end latency, preemptions.
It must never decide placement (the agent's hook does, between steps) nor block on the network.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch

from tierplan.runtime.engine.config import ModelSpec
from tierplan.runtime.engine.engine import ReferenceEngine
from tierplan.runtime.engine.routing_trace import ROUTER_HORIZON_TOKENS, RoutingTrace
from tierplan.runtime.engine.scheduler import Batch, PreemptMode, Scheduler, Sequence
from tierplan.runtime.engine.workloads import Request, synthetic_prompt_tokens
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.kv import Tier


class ForcedRouter:
    """Feeds a real routing trace to the model (implements `runtime.engine.hooks.ForcedRoutes`). Token `pos` of
    sequence `seq` reads trace token (seq * 997 + pos) % T: a sequence walks the trace in order (real temporal
    locality) and a token's route never depends on what else shares its batch, or when it ran. The fitted
    table lives on the device (graphs gather from it) with a host copy (the engine knows a step's experts)."""

    def __init__(self, trace: RoutingTrace, engine: ReferenceEngine | None = None,
                 horizon_tokens: int = ROUTER_HORIZON_TOKENS, *, spec: ModelSpec | None = None,
                 device: torch.device | None = None) -> None:
        if engine is not None:
            spec, device = engine.spec, engine.device.torch_device
        if spec is None or device is None:
            raise ConfigError("ForcedRouter needs an engine, or spec= and device=")
        ids, w = trace.routes(horizon_tokens, len(spec.moe_layers), spec.top_k, spec.num_experts)  # [T, L, k]
        self.ids_host = np.ascontiguousarray(ids)
        self.ids = torch.from_numpy(self.ids_host).to(device)
        self.weights = torch.from_numpy(np.ascontiguousarray(w)).to(device)

    def trace_rows(self, seqs: Seq[int], starts: Seq[int], num_tokens: Seq[int]) -> list[int]:
        t = self.ids.shape[0]
        return [(s * 997 + p + j) % t for s, p, n in zip(seqs, starts, num_tokens, strict=True) for j in range(n)]


@dataclass
class RequestMetrics:
    request_id: int
    prompt_len: int
    output_len: int
    queue_s: float  # arrival -> first scheduled (wall time)
    ttft_s: float
    tpot_s: float
    e2e_s: float
    preemptions: int


@dataclass
class RunReport:
    requests: list[RequestMetrics]
    wall_s: float
    steps: int
    tokens_out: int
    expert_hits: int
    expert_misses: int
    kv_peak_blocks: dict[str, int] = field(default_factory=dict)
    unfinished: int = 0  # requests a `stop` left unfinished (not in `requests` nor `tokens_out`)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_out / self.wall_s if self.wall_s else 0.0

    @property
    def expert_hit_rate(self) -> float:
        total = self.expert_hits + self.expert_misses
        return self.expert_hits / total if total else 1.0

    def pct(self, attr: str, q: float) -> float:
        vals = sorted(getattr(r, attr) for r in self.requests)
        return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else 0.0

    def summary(self) -> dict[str, float]:
        return {"requests": len(self.requests), "tokens_out": self.tokens_out, "tokens_per_s": self.tokens_per_s,
                "queue_ms_p50": self.pct("queue_s", 0.5) * 1e3, "queue_ms_p99": self.pct("queue_s", 0.99) * 1e3,
                "ttft_ms_p50": self.pct("ttft_s", 0.5) * 1e3, "ttft_ms_p99": self.pct("ttft_s", 0.99) * 1e3,
                "tpot_ms_p50": self.pct("tpot_s", 0.5) * 1e3, "tpot_ms_p99": self.pct("tpot_s", 0.99) * 1e3,
                "expert_hit_rate": self.expert_hit_rate, "steps": self.steps,
                "preemptions": sum(r.preemptions for r in self.requests)}


StepHook = Callable[[Batch, float], None]  # (batch, step seconds): the agent observes here


class Runner:
    """Replays requests. `virtual_step_s` paces arrivals by a step clock (each step advances it by that much,
    idle gaps are jumped) so that which requests share a batch does not depend on host speed; latencies
    are still wall time, counted from the step at which the request arrived on that clock."""

    def __init__(self, engine: ReferenceEngine, scheduler: Scheduler, router: ForcedRouter | None = None,
                 clock: Callable[[], float] = time.perf_counter, on_step: StepHook | None = None,
                 virtual_step_s: float | None = None) -> None:
        cap = engine.cache.manager.capacity
        if scheduler.block_tokens != engine.cache.block_tokens:
            raise ConfigError(f"Runner: scheduler.block_tokens={scheduler.block_tokens} differs from the engine's "
                              f"KV block_tokens={engine.cache.block_tokens}")
        if scheduler.gpu_blocks > cap[Tier.GPU]:
            raise ConfigError(f"Runner: scheduler.gpu_blocks={scheduler.gpu_blocks} exceeds the engine's GPU KV "
                              f"capacity of {cap[Tier.GPU]} blocks (EngineConfig.kv_gpu_blocks)")
        if scheduler.preempt is PreemptMode.SWAP and cap[Tier.CPU] == 0:
            raise ConfigError("Runner: preemption by SWAP needs CPU KV blocks (EngineConfig.kv_cpu_blocks > 0); "
                              "use PreemptMode.RECOMPUTE or give the CPU tier capacity")
        if virtual_step_s is not None and not virtual_step_s > 0:
            raise ConfigError(f"Runner: virtual_step_s must be > 0, got {virtual_step_s}")
        self.engine, self.sched, self.router, self.clock, self.on_step = engine, scheduler, router, clock, on_step
        self.virtual_step_s = virtual_step_s
        if router is not None:
            engine.set_hooks(forced_routes=router)

    def run(self, requests: list[Request], block_tokens_for_prefixes: int = 16,
            stop: Callable[[], bool] | None = None) -> RunReport:
        """Every request to completion, or until `stop()` (asked before each step) says True: what is left is
        counted (`RunReport.unfinished`)."""
        spec, cache = self.engine.spec, self.engine.cache
        # The GPU tier's limit (an applied plan's KV blocks) bounds what the batch may hold there, and refuses
        # a request that could never fit under it (Scheduler.add says so).
        sched_blocks = self.sched.gpu_blocks
        self.sched.gpu_blocks = min(sched_blocks, cache.manager.limit(Tier.GPU))
        for r in requests:
            prompt = synthetic_prompt_tokens(r, spec.vocab_size, block_tokens=block_tokens_for_prefixes)
            self.sched.add(Sequence(r.request_id, r.arrival_s, prompt, r.output_len))
        hits0, misses0 = self.engine.experts.hits, self.engine.experts.misses
        t0, offset, steps, peak = self.clock(), 0.0, 0, {t.value: 0 for t in Tier}
        arrived: dict[int, float] = {}  # wall time (since t0) at which each request became visible
        admitted: dict[int, float] = {}
        first: dict[int, float] = {}
        finished: dict[int, float] = {}

        def wall() -> float:
            return self.clock() - t0

        def now() -> float:  # the scheduling clock
            return (steps * self.virtual_step_s if self.virtual_step_s else wall()) + offset

        while not self.sched.idle and not (stop is not None and stop()):
            self.sched.gpu_blocks = min(sched_blocks, cache.manager.limit(Tier.GPU))
            t_sched = now()
            for s in self.sched.waiting:
                if s.arrival_s <= t_sched:
                    arrived.setdefault(s.seq_id, wall())
            batch = self.sched.schedule(t_sched)
            for s in batch.preempted:
                if self.sched.preempt is PreemptMode.SWAP:
                    cache.spill(cache.blocks_of(s.seq_id), Tier.CPU)
                else:
                    cache.free(s.seq_id)
            for s in batch.swapped_in:  # last in the running list now: the next to be preempted
                cache.touch(s.seq_id)
            if batch.empty:
                offset += self.sched.idle_gap_s(t_sched)  # raises at a dead end
                continue
            run = batch.prefills + batch.decodes
            toks = [s.tokens_from(s.num_computed) for s in run]
            for s in batch.prefills:
                admitted.setdefault(s.seq_id, wall())
            start = self.clock()
            logits = self.engine.step([s.seq_id for s in run], toks, [s.num_computed for s in run])
            next_tokens = logits.argmax(-1).tolist()  # the host has the tokens: the step is really over
            step_s = self.clock() - start
            t = wall()
            for s, tok in zip(run, next_tokens, strict=True):
                self.sched.complete(s, int(tok), t_sched)
                first.setdefault(s.seq_id, t)
                if s.done:
                    finished[s.seq_id] = t
                    cache.free(s.seq_id)
            steps += 1
            for k, v in cache.tier_usage().items():
                peak[k] = max(peak[k], v)
            if self.on_step is not None:
                self.on_step(batch, step_s)
        self.sched.gpu_blocks = sched_blocks  # the scheduler's own budget again: a later plan may allow more
        metrics = []
        for s in sorted(self.sched.finished, key=lambda s: s.seq_id):
            i, n = s.seq_id, len(s.output)
            tpot = (finished[i] - first[i]) / (n - 1) if n > 1 else 0.0
            metrics.append(RequestMetrics(i, len(s.prompt), n, admitted[i] - arrived[i], first[i] - arrived[i], tpot,
                                          finished[i] - arrived[i], s.num_preemptions))
        return RunReport(metrics, wall(), steps, sum(m.output_len for m in metrics),
                         self.engine.experts.hits - hits0, self.engine.experts.misses - misses0, peak,
                         unfinished=sum(r.request_id not in finished for r in requests))
