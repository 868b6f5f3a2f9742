"""One baseline on one point: the engine, the plan through the agent's enforcer, a replay on a virtual clock.

Bench driver code (and the baselines' tests): builds a CPU or GPU reference engine for the point with the
baseline's engine options, the scheduler and the runner (forced routing), asks the baseline for its
`PolicyRun`, applies the initial plan through a `ReferenceAdapter`'s enforcer (or an `InProcessLoop` when the
baseline re-plans live), plugs its victim order, replays the requests, and records the footprint after every
step against the point's budget. It must never place anything itself: every byte moves through the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierplan.bench.baselines.base import Baseline, PointContext, PolicyRun

if TYPE_CHECKING:
    from tierplan.controller.protocol import PlanAck
    from tierplan.runtime.device import Device
    from tierplan.runtime.engine.config import ModelSpec
    from tierplan.runtime.engine.engine import ReferenceEngine
    from tierplan.runtime.engine.routing_trace import RoutingTrace
    from tierplan.runtime.engine.runner import RunReport
    from tierplan.runtime.engine.workloads import Request


@dataclass
class PointResult:
    policy: str
    report: RunReport
    outputs: dict[int, list[int]]  # seq id -> generated tokens
    acks: list[PlanAck]  # the initial plan's first, then the live ones
    peak_hbm_bytes: int  # the largest footprint (experts + GPU KV) seen after any step
    over_budget_steps: int  # steps after which the footprint exceeded the budget (a broken promise)
    run: PolicyRun
    stats: dict[str, Any] = field(default_factory=dict)


def point_context(engine: ReferenceEngine, requests: list[Request], batch: int, context_tokens: int,
                  hbm_budget_bytes: int, link_bytes_per_s: float = 2e9, **extra: Any) -> PointContext:
    """The point as a baseline sees it, with sizes read from the engine built for it."""
    from tierplan.runtime.kv import Tier

    spec, cap = engine.spec, engine.cache.manager.capacity
    return PointContext(model=spec.name, layers=spec.num_layers, batch=batch, context_tokens=context_tokens,
                        hbm_budget_bytes=hbm_budget_bytes, block_tokens=engine.cache.block_tokens,
                        kv_block_bytes=engine.cache.block_bytes, expert_stride_bytes=engine.pool.layout.stride_bytes,
                        moe_layers=tuple(spec.moe_layers), num_experts=spec.num_experts,
                        kv_cpu_blocks=cap[Tier.CPU], kv_nvme_blocks=cap[Tier.NVME],
                        link_bytes_per_s=link_bytes_per_s, requests=tuple(requests), num_layers=spec.num_layers,
                        top_k=spec.top_k, **extra)


def run_point(baseline: Baseline, spec: ModelSpec, device: Device, trace: RoutingTrace, requests: list[Request],
              *, batch: int, context_tokens: int, hbm_budget_bytes: int, kv_gpu_blocks: int, kv_cpu_blocks: int,
              kv_nvme_blocks: int, workdir: Path, virtual_step_s: float = 0.005, link_bytes_per_s: float = 2e9,
              engine_kwargs: dict[str, Any] | None = None, **ctx_extra: Any) -> PointResult:
    """Run `baseline` on one point (module docstring); the engine is closed before returning."""
    from tierplan.agent.adapters.reference import ReferenceAdapter
    from tierplan.agent.closed_loop import InProcessLoop
    from tierplan.controller.protocol import AckStatus
    from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
    from tierplan.runtime.engine.runner import ForcedRouter, Runner
    from tierplan.runtime.engine.scheduler import PreemptMode, Scheduler

    cfg = EngineConfig(block_tokens=16, resident_frac=1.0, kv_gpu_blocks=kv_gpu_blocks, kv_cpu_blocks=kv_cpu_blocks,
                       kv_nvme_blocks=kv_nvme_blocks, workdir=workdir, **(engine_kwargs or {}))
    probe = ReferenceEngine(spec, device, cfg)  # the sizes a context needs, then the run's own engine
    try:
        ctx = point_context(probe, requests, batch, context_tokens, hbm_budget_bytes, link_bytes_per_s, **ctx_extra)
    finally:
        probe.close()
    eng = ReferenceEngine(spec, device, dataclasses.replace(cfg, **baseline.engine_options(ctx)))
    run = None
    try:
        sched = Scheduler(kv_gpu_blocks, cfg.block_tokens, max_batch=batch, preempt=PreemptMode.SWAP)
        hooks: list[Any] = []
        budget = ctx.hbm_budget_bytes
        seen = {"peak": 0, "over": 0}

        def on_step(b: Any, step_s: float) -> None:
            for h in hooks:
                h(b, step_s)
            total = adapter.enforcer.footprint().total_hbm_bytes
            seen["peak"] = max(seen["peak"], total)
            seen["over"] += total > budget

        runner = Runner(eng, sched, ForcedRouter(trace, eng), on_step=on_step, virtual_step_s=virtual_step_s)
        run = baseline.start(eng, ctx)
        loop = None
        if run.source is not None:
            loop = InProcessLoop(eng, run.source, window_steps=run.window_steps, hbm_budget_bytes=budget,
                                 local_predictor=run.local_predictor)
            adapter = loop.adapter
            loop.apply_initial(run.initial_plan)
            acks = loop.acks
            hooks.append(loop.on_step)
        else:
            adapter = ReferenceAdapter(eng, hbm_budget_bytes=budget, window_steps=run.window_steps,
                                       local_predictor=run.local_predictor)
            acks = [adapter.apply(run.initial_plan)]
            hooks.append(adapter.on_step)
        if acks[0].status is AckStatus.APPLIED and run.victim_order is not None:
            eng.experts.set_victim_order(run.victim_order)
        if run.on_step is not None:
            hooks.append(run.on_step)
        try:
            report = runner.run(requests)
        finally:  # the outbox's calls into the source end before the source is closed below
            if loop is not None:
                loop.finish()
            else:
                adapter.close()
        stats: dict[str, Any] = {"policy": adapter.policy.stats(), "enforcer": adapter.enforcer.stats(),
                                 "local_predictor": adapter.predictor is not None}
        if loop is not None:
            stats["loop"] = loop.stats()
        return PointResult(baseline.name, report, {s.seq_id: list(s.output) for s in sched.finished}, list(acks),
                           seen["peak"], seen["over"], run, stats)
    finally:
        if run is not None:  # a controller in a child process stops
            run.close()
        eng.close()
