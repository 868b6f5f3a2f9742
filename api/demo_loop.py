"""The demo's closed loop: a phased workload on the tiny engine, run with a static split and with the controller.

Composition root (the user's process): builds the engine, the in-process controller and the agent loop, and
replays bundled real Mooncake requests (lengths scaled to the CPU) in three phases: light traffic, then the
batch grows, then the context grows. Both runs share one HBM budget for expert slots plus GPU KV blocks; the
static run splits it once (most experts, the KV floor), the controller re-splits it every window. Used by
api/demo.py and the closed-loop tests; heavy modules are imported inside the functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data"
BLOCK_TOKENS = 16
MAX_BATCH = 16
KV_GPU_CAPACITY, KV_CPU_BLOCKS, KV_NVME_BLOCKS = 64, 128, 128
UNIT_BYTES = 4096  # the demo's sizes are whole units: 4 KiB KV blocks, 12 KiB expert slots
BUDGET_UNITS = 64  # the split's HBM budget, in 4 KiB units: 16 expert slots (3 units each) would leave 16 for KV
WINDOW_STEPS = 4
VIRTUAL_STEP_S = 0.005
# (label, requests, max prompt tokens, max output tokens, start_s, seconds between arrivals)
PHASES = (("light", 8, 32, 12, 0.0, 0.04), ("batch grows", 28, 32, 32, 1.0, 0.001),
          ("context grows", 12, 224, 12, 2.0, 0.005))  # 48 requests; `num_requests` scales every phase
NUM_REQUESTS = sum(p[1] for p in PHASES)


@dataclass
class LoopResult:
    label: str
    summary: dict[str, float]
    outputs: dict[int, list[int]]
    history: list[Any]  # controller Decisions (empty for the static run)
    stats: dict[str, Any]
    budget_bytes: int
    plan_totals: list[int]  # each issued plan's expert + GPU KV bytes
    phase_at_window: dict[int, str]  # windows closed so far -> the phase of the newest running request


def phased_requests(num_requests: int = NUM_REQUESTS) -> tuple[list[Any], dict[int, str]]:
    """The three phases as one request list (ids renumbered) and each request's phase label; `num_requests`
    (at least 3) scales every phase's count alike."""
    from tierplan.runtime.engine.workloads import load_mooncake, scale_requests

    if num_requests < len(PHASES):
        raise ValueError(f"the phased demo needs at least {len(PHASES)} requests (one per phase), got {num_requests}")
    base = load_mooncake(DATA / "requests/mooncake_conversation_sample.jsonl", limit=400)
    out, phase_of, used = [], {}, 0
    for label, full, max_prompt, max_out, start_s, gap_s in PHASES:
        n = max(1, round(full * num_requests / NUM_REQUESTS))
        picked = scale_requests(base[used:used + n], max_prompt, max_out, block_tokens=BLOCK_TOKENS)
        used += n
        for j, r in enumerate(picked):
            rid = len(out)
            out.append(dataclasses.replace(r, request_id=rid, arrival_s=start_s + j * gap_s))
            phase_of[rid] = label
    return out, phase_of


DEMO_GROUP = "demo"


def demo_knobs(calibrate: bool = True) -> Any:
    """The demo group's policy: at least top_k slots per MoE layer (a layer's experts of one token fit), plans
    expected to hold 4 windows. The service run PUTs them as the group's policy; the in-process run uses them
    directly, so both runs decide alike."""
    from tierplan.controller.protocol_service import PolicyKnobs

    return PolicyKnobs(min_slots_per_layer=2, horizon_steps=4 * WINDOW_STEPS, calibrate=calibrate)


def tiny_registration(agent_id: str = "agent-0", group: str = "default", kv_gpu_blocks_min: int = 16,
                      registered_s: float = 0.0, slot_bytes: int = 3 * UNIT_BYTES, kv_block_bytes: int = UNIT_BYTES,
                      budget_bytes: int = BUDGET_UNITS * UNIT_BYTES) -> Any:
    """The tiny engine's `AgentRegistration` (the demo's numbers): the one description the in-process
    controller, the service and the tests build the tiny agent's controller from. A caller with an engine
    passes its slot and block sizes."""
    from tierplan.controller.model_shape import builtin_shape
    from tierplan.controller.protocol import Link
    from tierplan.controller.protocol_service import (
        AgentRegistration,
        ComputeSheet,
        HardwareSheet,
        ShapeSpec,
        SplitSheet,
    )

    shape = builtin_shape("tiny", block_tokens=BLOCK_TOKENS)
    return AgentRegistration(
        agent_id=agent_id, group=group, engine="tierplan-reference", registered_s=registered_s,
        shape=ShapeSpec(name=shape.name, num_layers=shape.num_layers, moe_layers=shape.moe_layers,
                        num_experts=shape.num_experts, top_k=shape.top_k, expert_bytes=shape.expert_bytes,
                        dense_bytes=shape.dense_bytes, kv_bytes_per_token=shape.kv_bytes_per_token,
                        block_tokens=BLOCK_TOKENS),
        # A guess the cost model calibrates away from on the first windows (CPU memcpy, Python per-load cost).
        hardware=HardwareSheet(name="cpu twin", link_bytes_per_s=dict.fromkeys(Link, 2e9),
                               transfer_overhead_s=2e-4, hbm_bytes=budget_bytes),
        split=SplitSheet(hbm_budget_bytes=budget_bytes, dense_bytes=0, workspace_bytes=0, slot_bytes=slot_bytes,
                         kv_block_bytes=kv_block_bytes, kv_gpu_blocks_max=KV_GPU_CAPACITY,
                         kv_gpu_blocks_min=kv_gpu_blocks_min, kv_block_tokens=BLOCK_TOKENS,
                         kv_cpu_blocks=KV_CPU_BLOCKS, kv_nvme_blocks=KV_NVME_BLOCKS, max_running_seqs=MAX_BATCH),
        # The tiny model's step on this box, roughly (a few ms): the prior the windows then correct.
        compute=ComputeSheet(step_ms=1.0, dense_ms=0.5, moe_ms=0.3, dense_ms_per_token=0.01, moe_ms_per_token=0.01,
                             moe_ms_per_active_expert=0.05))


def engine_registration(engine: Any, budget_bytes: int, kv_floor: int, agent_id: str, group: str = DEMO_GROUP,
                        registered_s: float = 0.0) -> Any:
    """`tiny_registration` with this engine's slot and KV block sizes."""
    return tiny_registration(agent_id, group, kv_floor, registered_s, slot_bytes=engine.pool.layout.stride_bytes,
                             kv_block_bytes=engine.cache.block_bytes, budget_bytes=budget_bytes)


def _controller(engine: Any, budget_bytes: int, kv_floor: int, calibrate: bool) -> Any:
    from tierplan.api.hub_config import controller_config
    from tierplan.controller.loop import Controller

    cfg = controller_config(engine_registration(engine, budget_bytes, kv_floor, "controller"), demo_knobs(calibrate))
    # The local predictor's prior recall until measured (the service's agents start from 0: they measure it).
    return Controller(dataclasses.replace(cfg, space=dataclasses.replace(cfg.space, prefetch_recall=0.3)))


def run_loop_job(workdir: Path, with_controller: bool, num_requests: int = NUM_REQUESTS,
                 calibrate: bool = True, source: Callable[[Any, int, int], Any] | None = None,
                 pace: Callable[[], None] | None = None, clock: Callable[[], float] | None = None) -> LoopResult:
    """One run. `calibrate=False` keeps the cost model at its priors: no wall-clock time enters a decision,
    so the plans are the same on every machine (what the tests use). `source(engine, budget_bytes, kv_floor)`
    builds the plan source instead of the in-process controller (the service run passes a `ServiceLink`; its
    decisions are then read from the service, and the result's history is empty); `pace()` runs after each
    step (the service run keeps wall time at the trace's virtual time there); `clock` stamps the telemetry
    windows (the agent's default, monotonic, unless given: a service's readers plot wall-clock time)."""
    from tierplan.agent.closed_loop import InProcessLoop
    from tierplan.runtime.device import Device
    from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
    from tierplan.runtime.engine.presets import preset
    from tierplan.runtime.engine.routing_trace import RoutingTrace
    from tierplan.runtime.engine.runner import ForcedRouter, Runner
    from tierplan.runtime.engine.scheduler import PreemptMode, Scheduler

    spec = preset("tiny")
    reqs, phase_of = phased_requests(num_requests)
    phase_at_window: dict[int, str] = {}
    kv_floor = max(-(-(r.prompt_len + r.output_len) // BLOCK_TOKENS) for r in reqs) + 1
    unit = UNIT_BYTES
    budget = BUDGET_UNITS * unit
    n_experts = len(spec.moe_layers) * spec.num_experts
    stride_units = 3  # 12 KiB expert records
    static_slots = min(n_experts, (BUDGET_UNITS - kv_floor) // stride_units)
    static_kv = BUDGET_UNITS - static_slots * stride_units  # the rest of the budget (4 KiB blocks)
    eng = ReferenceEngine(spec, Device("cpu"), EngineConfig(
        block_tokens=BLOCK_TOKENS, resident_frac=1.0 if with_controller else static_slots / n_experts,
        kv_gpu_blocks=KV_GPU_CAPACITY, kv_cpu_blocks=KV_CPU_BLOCKS, kv_nvme_blocks=KV_NVME_BLOCKS, workdir=workdir))
    try:
        if eng.pool.layout.stride_bytes != stride_units * unit or eng.cache.block_bytes != unit:
            raise RuntimeError(f"demo sizes changed: stride {eng.pool.layout.stride_bytes}, block "
                               f"{eng.cache.block_bytes} bytes")
        trace = RoutingTrace.load(DATA / "routing/flame_moe_290m_sample.npz")
        # With the controller the scheduler may use the whole GPU tier; each applied plan's KV share bounds it.
        sched = Scheduler(KV_GPU_CAPACITY if with_controller else static_kv, BLOCK_TOKENS, max_batch=MAX_BATCH,
                          preempt=PreemptMode.SWAP)
        ctl, loop = None, None
        if with_controller:
            ctl = source(eng, budget, kv_floor) if source is not None else _controller(eng, budget, kv_floor,
                                                                                          calibrate)

            def follow(plan: Any) -> None:  # admission follows the plan's GPU KV share
                sched.gpu_blocks = min(KV_GPU_CAPACITY, plan.kv_blocks_per_tier["gpu"])

            virtual = {"t": 0.0}  # the runner's step clock, as far as the hook can see it (arrivals admitted)

            def queued_blocks() -> int:
                """KV blocks of the swapped-out requests and of the arrived waiting ones the batch limit would
                admit next (what a larger GPU KV share would let run now)."""
                room = max(0, MAX_BATCH - len(sched.running) - len(sched.swapped))
                waiting = [s for s in sched.waiting if s.arrival_s <= virtual["t"]][:room]
                return sum(-(-(len(s.tokens) + 1) // BLOCK_TOKENS) for s in [*waiting, *sched.swapped])

            adapter_kw: dict[str, Any] = {"agent_id": ctl.agent_id, "rank": ctl.rank} if source is not None else {}
            if clock is not None:
                adapter_kw["clock"] = clock
            loop = InProcessLoop(eng, ctl, window_steps=WINDOW_STEPS, on_applied=follow, hbm_budget_bytes=budget,
                                 queue_probe=queued_blocks, **adapter_kw)

            def hook(batch: Any, step_s: float) -> None:
                virtual["t"] = max([virtual["t"] + VIRTUAL_STEP_S, *(s.arrival_s for s in batch.prefills)])
                loop.on_step(batch, step_s)
                if pace is not None:
                    pace()
                if loop.adapter.steps % WINDOW_STEPS == 0:
                    newest = max(s.seq_id for s in batch.prefills + batch.decodes)
                    phase_at_window[loop.adapter.steps // WINDOW_STEPS] = phase_of[newest]
        else:
            hook = None  # type: ignore[assignment]
        report = Runner(eng, sched, ForcedRouter(trace, eng), on_step=hook, virtual_step_s=VIRTUAL_STEP_S).run(reqs)
        if loop is not None:
            loop.finish()
        history = ctl.history if ctl is not None and source is None else []
        stats = loop.stats() if loop is not None else {"static_slots": static_slots, "kv_blocks": static_kv}
        totals = ([sum(p.expert_bytes_per_layer) + p.kv_blocks_per_tier["gpu"] * unit for p in loop.plans]
                  if loop is not None else [(static_slots * stride_units + static_kv) * unit])
        return LoopResult("controller" if with_controller else "static split", report.summary(),
                          {s.seq_id: s.output for s in sched.finished}, history, stats, budget, totals,
                          phase_at_window)
    finally:
        eng.close()
