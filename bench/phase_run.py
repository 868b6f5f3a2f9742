"""One run of the phase diagram: a (point, policy) pair on a fresh engine over the model's shared pinned store.

Runs in the bench process (`tierplan bench phase`), on one device. `open_model` builds what every run of a
model shares (the truncated spec, the pinned expert store with synthetic weights at true shapes, the forced
router over the bundled routing trace, the slot stride and KV block size); `point_context` turns a grid point
into what a policy sees (refusing a point whose budget cannot hold top_k slots per MoE layer plus the largest
request's KV, the rule the policies use); `measure` builds the run's engine, lets the policy start (its initial
plan is applied through the agent's enforcer before the first step; a live policy re-plans through
`InProcessLoop`; the agent's layer-ahead predictor is attached only where the policy uses it), replays the
point's requests with the `Runner` on the virtual step clock, and records every step: its engine time, and its
cycle (wall time since the previous step ended: the step plus everything the runner, the agent and the planner
did between the two, spills, solves and prefetch issue included).
It decides no placement itself and never changes a policy's plan: a plan the enforcer refuses ends the run
with the refusal as its outcome, never a silent fallback.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierplan.agent.closed_loop import InProcessLoop
from tierplan.bench.baselines.base import PointContext, PolicyRun, request_kv_blocks
from tierplan.bench.baselines.dry_record import point_scheduler
from tierplan.bench.engine_steps import GcWatch
from tierplan.bench.phase_grid import GIB, ROUTING, Point, RunStop, Sizes, point_requests
from tierplan.controller.loop import Outcome as DecisionOutcome
from tierplan.controller.protocol import AckStatus, Plan, PlanAck, Telemetry
from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.engine.routing_trace import RoutingTrace
from tierplan.runtime.engine.runner import ForcedRouter, Runner, RunReport
from tierplan.runtime.engine.scheduler import Batch
from tierplan.runtime.engine.weights import DenseWeights, expert_format, synthetic_dense_weights
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.kv import Tier
from tierplan.runtime.selfcheck.exact import auto_block_tokens
from tierplan.runtime.weights.stores import PinnedExpertStore

CPU_LINK_BYTES_PER_S = 2e9  # the CPU twin's nominal host->device figure (a memcpy; not measured per run)
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


class RunRefused(Exception):
    """The policy's initial plan was refused, or the point cannot run under it: the row's outcome."""


@dataclass
class ModelHandle:
    """What every run of one model shares in this process."""

    name: str
    spec: Any  # ModelSpec, truncated to the kept layers
    dev: Device
    store: PinnedExpertStore
    router: ForcedRouter
    block_tokens: int
    stride_bytes: int
    kv_block_bytes: int
    link_bytes_per_s: float
    dense_bytes: int  # dense weights of the kept layers (taken out of the budget with the activations)
    dense: DenseWeights | None = None  # the synthetic dense weights every run's engine borrows (drawn once)
    memory_bytes_per_s: float = 0.0  # device memory read bandwidth, measured (the live cost model's prior)

    def close(self) -> None:
        self.store.close()


def _dense_bytes(name: str, kept_frac: float) -> int:
    from tierplan.controller.model_shape import BUILTIN_CONFIGS, builtin_shape

    return int(builtin_shape(name).dense_bytes * kept_frac) if name in BUILTIN_CONFIGS else 0


def open_model(name: str, layers: int, full_layers: int, dev: Device, say: Any) -> ModelHandle:
    """The store, router and sizes of `name` cut to `layers` (one probe engine reads the slot stride and block
    bytes the pool and cache really use on this device)."""
    from tierplan.bench.offload import DeviceRandomSource, link_gb_s, memory_read_gb_s

    spec = preset(name).truncated(layers) if layers < preset(name).num_layers else preset(name)
    t0 = time.perf_counter()
    src = DeviceRandomSource(expert_format(spec), len(spec.moe_layers), spec.num_experts, dev.torch_device)
    store = PinnedExpertStore(dev, src)
    bt = auto_block_tokens(spec)
    # Drawn once: each engine drawing its own took seconds a run on the H200's host (CPU randn for ~0.8 G values).
    dense = synthetic_dense_weights(spec, dev.torch_device, seed=EngineConfig().seed)
    probe = ReferenceEngine(spec, dev, EngineConfig(resident_frac=1 / (len(spec.moe_layers) * spec.num_experts),
                                                    block_tokens=bt, kv_gpu_blocks=1), pinned_store=store,
                            dense_weights=dense)
    try:
        stride, kv_block = probe.pool.layout.stride_bytes, probe.cache.block_bytes
    finally:
        probe.close()
    bw = link_gb_s(dev, 256 << 20) * 1e9 if dev.is_cuda else CPU_LINK_BYTES_PER_S
    mem = memory_read_gb_s(dev, (1 << 30) if dev.is_cuda else (64 << 20)) * 1e9
    router = ForcedRouter(RoutingTrace.load(ROUTING), spec=spec, device=dev.torch_device)
    say(f"{spec.name}: pinned store {store.records.total_bytes / GIB:.2f} GiB in {time.perf_counter() - t0:.1f} s; "
        f"slot {stride} B, KV block {kv_block} B ({bt} tokens), h2d {bw / 1e9:.1f} GB/s, memory reads "
        f"{mem / 1e9:.0f} GB/s")
    return ModelHandle(name, spec, dev, store, router, bt, stride, kv_block, bw,
                       _dense_bytes(name, layers / full_layers), dense, mem)


def _blocks(tokens: int, bt: int) -> int:
    return -(-tokens // bt)


def point_context(h: ModelHandle, point: Point, sizes: Sizes) -> tuple[PointContext, int]:
    """The point as a policy sees it (its budget scaled by the kept layers, workspace out; sizes; requests), and
    the tokens a prefix id covers (the runner's prompts share leading tokens by it)."""
    reqs, prefix_tokens = point_requests(point, sizes)
    num_experts_all = len(h.spec.moe_layers) * h.spec.num_experts
    per_request = request_kv_blocks(reqs, h.block_tokens)
    need_kv_blocks = sum(per_request[: point.batch])  # the batch's largest requests at once
    if point.budget_frac is not None:  # quick: a fraction of what the point could use at most
        budget = int(point.budget_frac * (num_experts_all * h.stride_bytes + need_kv_blocks * h.kv_block_bytes))
    else:
        workspace = h.dense_bytes + sizes.activation_bytes_per_token * max(point.batch, point.context)
        budget = int(point.budget_label_gib * GIB * point.kept_frac) - workspace
    floor_kv_blocks = per_request[0] + 1  # the largest request whole, plus one (base.kv_floor_blocks)
    floor = h.spec.top_k * len(h.spec.moe_layers) * h.stride_bytes + floor_kv_blocks * h.kv_block_bytes
    if budget < floor:
        raise ConfigError(f"point {point.key}: infeasible: the HBM budget of {budget} bytes (after the workspace) is "
                          f"below {floor} bytes, the least any policy needs: top_k={h.spec.top_k} slots in each of "
                          f"{len(h.spec.moe_layers)} MoE layers ({h.stride_bytes} B a slot) plus the largest "
                          f"request's {floor_kv_blocks} KV blocks ({h.kv_block_bytes} B a block)")
    total_blocks = sum(per_request) + point.batch
    tier_cap = int(sizes.kv_cpu_gib * GIB * point.kept_frac) // h.kv_block_bytes
    return PointContext(
        model=point.model, layers=point.layers, batch=point.batch, context_tokens=point.context,
        hbm_budget_bytes=budget, block_tokens=h.block_tokens, kv_block_bytes=h.kv_block_bytes,
        expert_stride_bytes=h.stride_bytes, moe_layers=tuple(h.spec.moe_layers), num_experts=h.spec.num_experts,
        # Swaps park at most the GPU share on the CPU: the tier holds that much at least, whatever the cap.
        kv_cpu_blocks=max(1, min(total_blocks, max(tier_cap, budget // h.kv_block_bytes))),
        kv_nvme_blocks=max(1, min(total_blocks, int(sizes.kv_nvme_gib * GIB * point.kept_frac) // h.kv_block_bytes)),
        link_bytes_per_s=h.link_bytes_per_s, memory_bytes_per_s=h.memory_bytes_per_s, requests=reqs,
        num_layers=h.spec.num_layers, top_k=h.spec.top_k, planner_cores=sizes.planner_cores), prefix_tokens


def engine_config(h: ModelHandle, ctx: PointContext, options: dict[str, Any], workdir: Path) -> EngineConfig:
    """The run's engine: a slot pool no larger than the budget could ever hold, a GPU KV tier as large as any
    plan within the budget could ask; the policy's overrides on top (an unknown key refused by name)."""
    bad = sorted(set(options) - _CONFIG_FIELDS)
    if bad:
        raise ConfigError(f"engine_options: unknown EngineConfig field(s) {bad}")
    owned = {"resident_frac", "block_tokens", "kv_gpu_blocks", "kv_cpu_blocks", "kv_nvme_blocks", "workdir"}
    if owned & set(options):
        raise ConfigError(f"engine_options: {sorted(owned & set(options))} are the runner's (sizes of the point)")
    total = len(ctx.moe_layers) * ctx.num_experts
    slots = min(total, ctx.hbm_budget_bytes // ctx.expert_stride_bytes)
    frac = 1.0 if slots >= total else (slots - 0.5) / total  # the engine rounds up: exactly `slots` slots
    return EngineConfig(resident_frac=frac, block_tokens=ctx.block_tokens,
                        kv_gpu_blocks=max(1, ctx.hbm_budget_bytes // ctx.kv_block_bytes),
                        kv_cpu_blocks=ctx.kv_cpu_blocks, kv_nvme_blocks=ctx.kv_nvme_blocks, workdir=workdir,
                        **options)


def _decisions(history: list[Any]) -> list[tuple[int, float]]:
    """A live policy's decisions as (windows seen when it decided, its plan's predicted step ms): the
    controller's `Decision.step_ms` for the split it issued or kept; [] for a static policy."""
    return [(int(d.window), float(d.step_ms)) for d in history if getattr(d, "step_ms", 0.0) > 0]


REASON_CHARS = 1200  # of each plan's reason kept in the row (up to 4000; 600 cut the gain and margin off, session 31)


def _shares(d: Any) -> list[dict[str, Any]]:
    """Every KV share a decision's coupled search solved, term by term (coupling.ShareTerms): which term moved a
    split offline, from the row alone."""
    return [s.as_row() for s in getattr(d, "shares", ())]


def _plans_issued(history: list[Any]) -> list[dict[str, Any]]:
    """The plans a live controller issued, as the row shows them: when, the split, the batch it saw, why, and the
    shares it weighed."""
    return [{"window": int(d.window), "kv_gpu_blocks": int(d.split.kv_blocks), "expert_slots": int(sum(d.split.slots)),
             "batch_tokens": round(float(d.batch_tokens), 2), "predicted_step_ms": round(float(d.step_ms), 3),
             "reason": str(d.reason)[:REASON_CHARS], "shares": _shares(d)}
            for d in history if d.outcome is DecisionOutcome.ISSUED]


HELD_KEPT = 3  # the last held decisions whose reasons the row keeps (why the split stayed, near the run's end)


def _plans_held(history: list[Any]) -> dict[str, Any] | None:
    """How often a live controller kept its split, and its last `HELD_KEPT` reasons (each gain it turned down,
    and the demand it saw): what a row needs to tell a controller that saw nothing better from one held back
    by its margin (H200 phase runs 26-28: one plan in ~24 windows, and no row said why). None: no controller
    (a static policy)."""
    if not history:
        return None
    held = [d for d in history if d.outcome is DecisionOutcome.HELD]
    return {"count": len(held),
            "last": [{"window": int(d.window), "batch_tokens": round(float(d.batch_tokens), 2),
                      "kv_demand_blocks": round(float(d.kv_demand_blocks), 1), "reason": str(d.reason)[:REASON_CHARS],
                      "shares": _shares(d)}
                     for d in held[-HELD_KEPT:]]}


class _Hold:
    """The plan source of a static policy: it takes every window and never re-plans (the initial plan holds)."""

    def sync_from(self, telemetry: Telemetry) -> None:
        return None

    def step_next(self) -> Plan | None:
        return None

    def record_ack(self, ack: PlanAck) -> None:
        return None


@dataclass
class StepRecord:
    step_s: float  # the engine's forward alone (Runner's step timer)
    cycle_s: float  # wall time since the previous step ended (its hooks, spills, solves, this step)
    num_prefills: int
    num_decodes: int
    tokens_out: int  # one per sequence in the step
    batch_tokens: int  # tokens computed (prompts + one per decode)
    context_tokens: int  # tokens attention read
    expert_hits: int
    expert_misses: int
    expert_stall_ms: float
    kv_stall_ms: float
    kv_gpu_hits: int
    kv_fetch: dict[str, int]  # blocks fetched back, by the tier they were on
    link_bytes: dict[str, int]
    executors: dict[str, int] = field(default_factory=dict)  # "executor/reason" the step ran on (engine's count)
    gc_ms: float = 0.0  # the cyclic collector's pauses within this step's cycle (any thread's)
    plan_version: int = 0  # the plan in force when the step ended (the enforcer's applied version)
    # Of expert_hits: loads issued ahead of their layer (agent prefetch, a streaming window) that had landed or
    # were in flight when the layer asked (OnDemandExperts.prefetch_hits).
    expert_prefetch_hits: int = 0
    # GPU time of the step's CUDA-graph replays (DecodeGraphs.take_gpu_ms); None: no graph replayed (eager, CPU).
    # step_s beyond it is host time between pieces: tells a slow kernel from a starved engine thread.
    graph_gpu_ms: float | None = None
    # Wall time this step spent capturing CUDA graphs of a new bucket (DecodeGraphs.capture_s), already taken out
    # of step_s and cycle_s: a server captures its buckets at start-up (H100 phase run 62, b32 1K 56 GiB: each
    # first decode step in a new bucket took 46-148 ms against 3-16 ms, 23-29 % of a run's measured wall time).
    capture_ms: float = 0.0
    # Of this step's cycle: how long the engine's other threads held the GIL for the agent's telemetry (the
    # outbox's builds) and a child-process planner's messages (packing, validating): set once the run has ended
    # (`overlap_ms`), as a span may outlast the step it started in. The engine thread waits out such work
    # between its launches; live policies' decode steps ran slowest at the window's first steps.
    outbox_ms: float = 0.0
    # Of this step's cycle: how long a planner in a child process was working on a call (wall), and the CPU time
    # its threads spent meanwhile (planner_cpu_ms / planner_ms: the cores it kept busy beside the engine).
    planner_ms: float = 0.0
    planner_cpu_ms: float = 0.0


def cpu_overlap_ms(cycles: list[tuple[float, float]], spans: list[tuple[float, float, float]]) -> list[float]:
    """For each (start, end) cycle, the CPU ms of the (start, end, cpu_s) spans that fall in it, each span's CPU
    spread evenly over its wall time (the spans are one process's calls, one at a time)."""
    return [sum(cpu * 1e3 * max(0.0, min(b, t1) - max(a, t0)) / (b - a) for a, b, cpu in spans
                if b > a and a < t1 and b > t0) for t0, t1 in cycles]


def overlap_ms(cycles: list[tuple[float, float]], spans: list[tuple[float, float]]) -> list[float]:
    """For each (start, end) cycle, the ms that the union of `spans` covers of it (both on one clock)."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in merged if a < t1 and b > t0) * 1e3
            for t0, t1 in cycles]


@dataclass
class Outcome:
    report: RunReport
    steps: list[StepRecord]
    telemetry: list[Telemetry]
    acks: list[PlanAck]
    loop_stats: dict[str, Any]
    initial_plan: Plan
    notes: str
    window_steps: int
    extra: dict[str, Any] = field(default_factory=dict)


def capture_s(eng: ReferenceEngine) -> float:
    """The engine's CUDA-graph capture time so far (s; 0 without graphs)."""
    return eng.graphs.capture_s if eng.graphs is not None else 0.0


def server_clock(eng: ReferenceEngine) -> Callable[[], float]:
    """perf_counter less the engine's capture time so far: the clock of a server that captured its graphs at
    start-up. Every step timer of a run reads it (the runner's step and request times, the cycles)."""
    return lambda: time.perf_counter() - capture_s(eng)


class _Recorder:
    """Counters of the engine before and after each step (the runner's hook, after the agent's)."""

    def __init__(self, eng: ReferenceEngine) -> None:
        self.eng = eng
        self.steps: list[StepRecord] = []
        self._last = self._snap()
        if eng.graphs is not None:
            eng.graphs.take_gpu_ms()  # a replay before this run (a warm-up) is none of its steps' GPU time
        self._gc_ms = 0.0
        self._capture_s = capture_s(eng)

    def _snap(self) -> dict[str, Any]:
        e, c = self.eng.experts, self.eng.cache
        links = self.eng.transfer.stats()["links"]
        ran = self.eng.executors.runs
        return {"hits": e.hits, "prefetch_hits": e.prefetch_hits, "misses": e.misses, "stall_ms": e.stalls_ms,
                "kv_s": c.fetch_s, "kv_hits": c.gpu_hits,
                "fetch": {t.value: v for t, v in c.misses_by_tier.items()},
                "links": {k: int(v["bytes"]) for k, v in links.items()},
                "ran": {f"{x.value}/{r.value}": n for (x, r), n in ran.items()}}

    def after_step(self, batch: Batch, step_s: float, cycle_s: float, gc_ms: float, plan_version: int = 0) -> None:
        """`gc_ms`: the collector's pauses so far, read where the step's cycle ended (the pauses the cycle holds);
        `plan_version`: the plan the step ran under."""
        now, last, captured_s = self._snap(), self._last, capture_s(self.eng)
        run = batch.prefills + batch.decodes
        self.steps.append(StepRecord(
            step_s=step_s, cycle_s=cycle_s, num_prefills=len(batch.prefills), num_decodes=len(batch.decodes),
            tokens_out=len(run),
            batch_tokens=sum(len(s.prompt) for s in batch.prefills) + len(batch.decodes),
            context_tokens=sum(s.num_tokens for s in run), expert_hits=now["hits"] - last["hits"],
            expert_misses=now["misses"] - last["misses"], expert_stall_ms=now["stall_ms"] - last["stall_ms"],
            kv_stall_ms=(now["kv_s"] - last["kv_s"]) * 1e3, kv_gpu_hits=now["kv_hits"] - last["kv_hits"],
            kv_fetch={t: now["fetch"][t] - last["fetch"][t] for t in now["fetch"]},
            link_bytes={k: now["links"][k] - last["links"].get(k, 0) for k in now["links"]},
            executors={k: n - last["ran"].get(k, 0) for k, n in now["ran"].items() if n > last["ran"].get(k, 0)},
            gc_ms=gc_ms - self._gc_ms, plan_version=plan_version,
            expert_prefetch_hits=now["prefetch_hits"] - last["prefetch_hits"],
            graph_gpu_ms=self.eng.graphs.take_gpu_ms() if self.eng.graphs is not None else None,
            capture_ms=(captured_s - self._capture_s) * 1e3))
        self._last, self._gc_ms, self._capture_s = now, gc_ms, captured_s


def measure(h: ModelHandle, ctx: PointContext, policy: Any, sizes: Sizes, workdir: Path, prefix_tokens: int,
            router: Any = None) -> Outcome:
    """Run `policy` at `ctx` once (`prefix_tokens`: see `point_context`; `router`: the model's forced router
    unless given, e.g. the oracle's recording wrapper). RunRefused: its initial plan was refused (the ack's
    reason), or a request can never fit the GPU KV share it left. The footprint (experts + GPU KV) is checked
    against the budget after every step."""
    cfg = engine_config(h, ctx, policy.engine_options(ctx), workdir)
    eng = ReferenceEngine(h.spec, h.dev, cfg, pinned_store=h.store,
                          dense_weights=h.dense if cfg.seed == EngineConfig().seed else None)
    run: PolicyRun | None = None
    try:
        cap_blocks = eng.cache.manager.capacity[Tier.GPU]
        sched = point_scheduler(ctx, cap_blocks)
        virtual = {"t": 0.0}
        hooks: list[Any] = []
        # The runner first: it plugs the forced routes into the engine, which a policy may read when it starts.
        clock_s = server_clock(eng)
        runner = Runner(eng, sched, router or h.router, on_step=lambda b, s: [f(b, s) for f in hooks],
                        virtual_step_s=sizes.virtual_step_s, clock=clock_s)
        run = policy.start(eng, ctx)

        def queued_blocks() -> int:  # the KV a larger GPU share would let run now (the controller's telemetry)
            room = max(0, ctx.batch - len(sched.running) - len(sched.swapped))
            waiting = [s for s in sched.waiting if s.arrival_s <= virtual["t"]][:room]
            return sum(_blocks(s.num_tokens + 1, ctx.block_tokens) for s in [*waiting, *sched.swapped])

        # The agent's layer-ahead predictor (a per-layer host copy of the routes) only where the policy uses it:
        # `PolicyRun.local_predictor` where the baselines define it, else the live policies (a plan source).
        # A live planner runs as it would beside a deployed engine: in its own process (the live baselines'
        # default, bench/baselines/plan_process.py) reached from the loop's outbox thread while decode goes on, its
        # plan applied at the first window end after it is ready (the engine never waits for a solve).
        local = bool(getattr(run, "local_predictor", run.source is not None))
        loop = InProcessLoop(eng, run.source if run.source is not None else _Hold(), window_steps=run.window_steps,
                             hbm_budget_bytes=ctx.hbm_budget_bytes, queue_probe=queued_blocks,
                             wait_for_plans=False, local_predictor=local)
        # GC pauses stop every thread that needs the GIL: a few in the measured steps are one cause of run-to-run
        # spread between runs that did the same work (phase_spread.py), so each step's record carries its own.
        gc_watch = GcWatch()  # closed when the run ends, failed or not
        gc_watch.block = True
        try:
            ack = loop.apply_initial(run.initial_plan)  # enforcer, predictor, the between-steps trim over its caps
            if ack.status is not AckStatus.APPLIED:
                raise RunRefused(f"initial plan {ack.status.value}: {ack.reason}")
            if run.victim_order is not None:
                eng.experts.set_victim_order(run.victim_order)
            rec = _Recorder(eng)
            enforcer, seen = loop.adapter.enforcer, {"peak": 0, "over": 0}
            clock = {"last": 0.0, "raw": 0.0}
            cycles: list[tuple[float, float]] = []  # each step's cycle on perf_counter (the threads' spans' clock)
            stop = RunStop.of(sizes)  # the rule the oracle's dry record follows too

            def hook(batch: Batch, step_s: float) -> None:
                # The step's cycle ends here, before this step's own hooks (they belong to the next cycle).
                t, raw = clock_s(), time.perf_counter()
                cycles.append((clock["raw"], raw))
                clock["raw"] = raw
                stop.after_step(len(batch.prefills))
                cycle_s, clock["last"] = t - clock["last"], t
                gc_ms = gc_watch.ms[True]  # the pauses up to here fell in this cycle (a later one's belong to the next)
                virtual["t"] = max([virtual["t"] + sizes.virtual_step_s, *(s.arrival_s for s in batch.prefills)])
                ran_under = enforcer.applied_version  # a plan the loop applies at this window's end is the next step's
                loop.on_step(batch, step_s)
                if run.on_step is not None:
                    run.on_step(batch, step_s)
                rec.after_step(batch, step_s, cycle_s, gc_ms, ran_under)
                total = enforcer.footprint().total_hbm_bytes
                seen["peak"] = max(seen["peak"], total)
                seen["over"] += total > ctx.hbm_budget_bytes

            hooks.append(hook)
            try:
                clock["last"], clock["raw"] = clock_s(), time.perf_counter()
                report = runner.run(list(ctx.requests), block_tokens_for_prefixes=prefix_tokens,
                                    stop=lambda: stop.reached)
            except ConfigError as exc:  # e.g. a request longer than the GPU KV share the plan left
                raise RunRefused(f"the point cannot run under this plan: {exc}") from exc
        finally:
            loop.finish()
            gc_watch.close()
        spans = [*loop.adapter.outbox.build_spans, *getattr(run.source, "host_spans", ())]
        solves = list(getattr(run.source, "solve_spans", ()))
        for step, busy_ms, solve_ms, cpu_ms in zip(rec.steps, overlap_ms(cycles, spans),
                                                   overlap_ms(cycles, [(a, b) for a, b, _ in solves]),
                                                   cpu_overlap_ms(cycles, solves), strict=True):
            step.outbox_ms, step.planner_ms, step.planner_cpu_ms = busy_ms, solve_ms, cpu_ms
        history = list(getattr(run.source, "history", None) or []) if run.source is not None else []
        controller_stats = getattr(run.source, "controller_stats", None) if run.source is not None else None
        decisions = _decisions(history)
        if (close_error := run.close()) is not None:  # the controller's process could not stop cleanly: counted
            loop.planner_errors.append(f"closing the controller's process: {close_error}")
        return Outcome(report, rec.steps, list(loop.telemetry), list(loop.acks), loop.stats(), run.initial_plan,
                       run.notes, run.window_steps, {"peak_hbm_bytes": seen["peak"], "over_budget_steps": seen["over"],
                                                     "split": run.split, "planner_errors": list(loop.planner_errors),
                                                     "diverged_steps": getattr(run.victim_order, "diverged_steps",
                                                                               None),
                                                     "decisions": decisions,
                                                     "plans_issued": _plans_issued(history),
                                                     "plans_held": _plans_held(history),
                                                     "controller_stats": controller_stats,
                                                     "plans_applied": {p.version: p for p, a in
                                                                       zip(loop.plans, loop.acks, strict=True)
                                                                       if a.status is AckStatus.APPLIED},
                                                     "local_predictor": loop.adapter.predictor is not None})
    finally:
        if run is not None:  # a controller in a child process stops (on a failed run too; a second close: nothing)
            run.close()
        eng.close()
        if h.dev.is_cuda:
            torch.cuda.empty_cache()
