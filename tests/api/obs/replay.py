"""Real telemetry through the real path: the CPU reference engine and its agent replay the bundled Mooncake
requests and routing trace (api/demo_loop.py's phased workload) with a `ServiceLink` to a running sidecar as
the closed loop's plan source (engine -> agent -> unix socket -> sidecar -> HTTP -> service, and plans back).

Test code (the pytest process runs the engine; the sidecar and the service are other processes). Each step is
paced by a few real milliseconds so the service's background planner has time to issue plans that the agent
then applies; the engine thread itself never waits on the sidecar (ServiceLink's contract).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from api.demo_loop import (
    BLOCK_TOKENS,
    DATA,
    KV_CPU_BLOCKS,
    KV_GPU_CAPACITY,
    KV_NVME_BLOCKS,
    MAX_BATCH,
    VIRTUAL_STEP_S,
    phased_requests,
)
from controller.protocol import Link
from controller.protocol_service import AgentRegistration, HardwareSheet, ShapeSpec, SplitSheet

WINDOW_STEPS = 4
BUDGET_BYTES = 64 * 4096  # api/demo_loop.py's budget: 64 units of 4 KiB
PACE_S = 0.01  # real time per engine step, so plans land during the replay


def registration(engine: Any, agent_id: str, kv_floor: int) -> AgentRegistration:
    """The agent as the service must know it: the numbers api/demo_loop.py's in-process controller uses."""
    from controller.model_shape import builtin_shape

    s = builtin_shape("tiny", block_tokens=BLOCK_TOKENS)
    return AgentRegistration(
        agent_id=agent_id, engine="tierplan-reference",
        shape=ShapeSpec(name=s.name, num_layers=s.num_layers, moe_layers=s.moe_layers, num_experts=s.num_experts,
                        top_k=s.top_k, expert_bytes=s.expert_bytes, dense_bytes=s.dense_bytes,
                        kv_bytes_per_token=s.kv_bytes_per_token, block_tokens=s.block_tokens),
        hardware=HardwareSheet(name="cpu twin", link_bytes_per_s=dict.fromkeys(Link, 2e9), transfer_overhead_s=2e-4,
                               hbm_bytes=BUDGET_BYTES),
        split=SplitSheet(hbm_budget_bytes=BUDGET_BYTES, dense_bytes=0, workspace_bytes=0,
                         slot_bytes=engine.pool.layout.stride_bytes, kv_block_bytes=engine.cache.block_bytes,
                         kv_gpu_blocks_max=KV_GPU_CAPACITY, kv_gpu_blocks_min=kv_floor, kv_block_tokens=BLOCK_TOKENS,
                         kv_cpu_blocks=KV_CPU_BLOCKS, kv_nvme_blocks=KV_NVME_BLOCKS),
        registered_s=time.time())


def replay_through_sidecar(socket_path: str, workdir: Path, agent_id: str, num_requests: int = 24) -> dict[str, Any]:
    """Runs the phased workload with the sidecar at `socket_path` as plan source; the loop's and link's stats."""
    from agent.closed_loop import InProcessLoop
    from agent.service_link import ServiceLink
    from runtime.device import Device
    from runtime.engine.engine import EngineConfig, ReferenceEngine
    from runtime.engine.presets import preset
    from runtime.engine.routing_trace import RoutingTrace
    from runtime.engine.runner import ForcedRouter, Runner
    from runtime.engine.scheduler import PreemptMode, Scheduler

    reqs, _ = phased_requests(num_requests)
    kv_floor = max(-(-(r.prompt_len + r.output_len) // BLOCK_TOKENS) for r in reqs) + 1
    engine = ReferenceEngine(preset("tiny"), Device("cpu"), EngineConfig(
        block_tokens=BLOCK_TOKENS, resident_frac=1.0, kv_gpu_blocks=KV_GPU_CAPACITY, kv_cpu_blocks=KV_CPU_BLOCKS,
        kv_nvme_blocks=KV_NVME_BLOCKS, workdir=workdir))
    link = ServiceLink(socket_path, registration(engine, agent_id, kv_floor))
    try:
        sched = Scheduler(KV_GPU_CAPACITY, BLOCK_TOKENS, max_batch=MAX_BATCH, preempt=PreemptMode.SWAP)

        def follow(plan: Any) -> None:  # admission follows the plan's GPU KV share, as in the demo
            sched.gpu_blocks = min(KV_GPU_CAPACITY, plan.kv_blocks_per_tier["gpu"])

        loop = InProcessLoop(engine, link, window_steps=WINDOW_STEPS, on_applied=follow,
                             hbm_budget_bytes=BUDGET_BYTES, agent_id=agent_id)

        def hook(batch: Any, step_s: float) -> None:
            loop.on_step(batch, step_s)
            time.sleep(PACE_S)

        trace = RoutingTrace.load(DATA / "routing/flame_moe_290m_sample.npz")
        Runner(engine, sched, ForcedRouter(trace, engine), on_step=hook, virtual_step_s=VIRTUAL_STEP_S).run(reqs)
        loop.finish()
        link.drain(timeout_s=15.0)
        return {"loop": loop.stats(), "link": link.stats()}
    finally:
        link.close()
        engine.close()
