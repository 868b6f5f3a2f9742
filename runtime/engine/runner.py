"""Request replay on the reference engine: continuous batching, forced routing, per-request metrics.

Runs in the inference process. Requests arrive on a clock that is wall time plus jumps over idle gaps (a
CPU run does not sleep through a trace's quiet minutes). Each step: schedule, swap out or drop the
preempted, run one forward over the prefills and decodes together, record tokens. Metrics per request:
TTFT (arrival -> first token), TPOT (mean time per later token), end-to-end latency, preemptions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.engine.engine import ReferenceEngine
from runtime.engine.routing_trace import RoutingTrace
from runtime.engine.scheduler import Batch, PreemptMode, Scheduler, Sequence
from runtime.engine.workloads import Request, synthetic_prompt_tokens
from runtime.kv import Tier


class ForcedRouter:
    """Feeds a real routing trace to the model: each forward takes the next N trace tokens (cycled)."""

    def __init__(self, trace: RoutingTrace, engine: ReferenceEngine, horizon_tokens: int = 4096) -> None:
        spec = engine.spec
        ids, w = trace.routes(horizon_tokens, len(spec.moe_layers), spec.top_k, spec.num_experts)  # [T, L, k]
        dev = engine.device.torch_device
        self.ids = torch.from_numpy(np.ascontiguousarray(ids)).to(dev)
        self.weights = torch.from_numpy(np.ascontiguousarray(w)).to(dev)
        self.pool_layer = engine.model.pool_layer
        self.cursor = 0
        self._rows: torch.Tensor | None = None

    def begin(self, num_rows: int) -> None:
        t = self.ids.shape[0]
        self._rows = (torch.arange(num_rows) + self.cursor) % t
        self.cursor = (self.cursor + num_rows) % t

    def __call__(self, layer: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._rows is not None and self._rows.numel() == num_rows, "begin() was not called for this forward"
        m = self.pool_layer[layer]
        return self.ids[self._rows, m], self.weights[self._rows, m]


@dataclass
class RequestMetrics:
    request_id: int
    prompt_len: int
    output_len: int
    queue_s: float  # arrival -> first scheduled
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
    def __init__(self, engine: ReferenceEngine, scheduler: Scheduler, router: ForcedRouter | None = None,
                 clock: Callable[[], float] = time.perf_counter, on_step: StepHook | None = None) -> None:
        self.engine, self.sched, self.router, self.clock, self.on_step = engine, scheduler, router, clock, on_step
        if router is not None:
            engine.model.forced_routes = router

    def run(self, requests: list[Request], block_tokens_for_prefixes: int = 16) -> RunReport:
        spec, cache = self.engine.spec, self.engine.cache
        for r in requests:
            prompt = synthetic_prompt_tokens(r, spec.vocab_size, block_tokens=block_tokens_for_prefixes)
            self.sched.add(Sequence(r.request_id, r.arrival_s, prompt, r.output_len))
        hits0, misses0 = self.engine.experts.hits, self.engine.experts.misses
        t0, offset, steps, peak = self.clock(), 0.0, 0, {t.value: 0 for t in Tier}

        def now() -> float:
            return self.clock() - t0 + offset

        while not self.sched.idle:
            batch = self.sched.schedule(now())
            for s in batch.preempted:
                if self.sched.preempt is PreemptMode.SWAP:
                    cache.spill(cache.blocks_of(s.seq_id), Tier.CPU)
                else:
                    cache.free(s.seq_id)
            if batch.empty:
                nxt = self.sched.next_arrival_s()
                if nxt is None:  # nothing runnable and nothing arriving: a scheduling dead end
                    raise RuntimeError("scheduler made no progress with requests still queued")
                offset += max(0.0, nxt - now())
                continue
            run = batch.prefills + batch.decodes
            toks = [s.tokens[s.num_computed :] for s in run]
            if self.router is not None:
                self.router.begin(sum(len(t) for t in toks))
            start = self.clock()
            logits = self.engine.step([s.seq_id for s in run], toks, [s.num_computed for s in run])
            step_s = self.clock() - start
            t = now()
            for s, tok in zip(run, logits.argmax(-1).tolist(), strict=True):
                self.sched.complete(s, int(tok), t)
                if s.done:
                    cache.free(s.seq_id)
            steps += 1
            for k, v in cache.tier_usage().items():
                peak[k] = max(peak[k], v)
            if self.on_step is not None:
                self.on_step(batch, step_s)
        wall = self.clock() - t0
        metrics = []
        for s in sorted(self.sched.finished, key=lambda s: s.seq_id):
            assert s.first_token_s is not None and s.finish_s is not None and s.admitted_s is not None
            n = len(s.output)
            tpot = (s.finish_s - s.first_token_s) / (n - 1) if n > 1 else 0.0
            metrics.append(RequestMetrics(s.seq_id, len(s.prompt), n, s.admitted_s - s.arrival_s,
                                          s.first_token_s - s.arrival_s, tpot,
                                          s.finish_s - s.arrival_s, s.num_preemptions))
        return RunReport(metrics, wall, steps, sum(m.output_len for m in metrics),
                         self.engine.experts.hits - hits0, self.engine.experts.misses - misses0, peak)

