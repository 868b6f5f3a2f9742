"""Fills a running controller service with real decisions: the CPU reference engine and its agent replay the
bundled Mooncake requests and routing trace (api/demo_loop.py's phased workload) in a closed loop whose plan
source is the service's HTTP API (register with api/bench_api.py's registration of that agent, POST telemetry, GET the
plan, POST acks).

Test code (the pytest process); the engine runs here, the service wherever `base_url` points. The loop waits
for the service to decide on each window before asking for a plan (so the run resembles the in-process
loop); it never plans anything itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from api.demo_loop import (
    BLOCK_TOKENS,
    KV_CPU_BLOCKS,
    KV_GPU_CAPACITY,
    KV_NVME_BLOCKS,
    MAX_BATCH,
    VIRTUAL_STEP_S,
    tiny_registration,
)
from api.demo_loop import UNIT_BYTES as TINY_UNIT_BYTES
from controller.protocol import Plan, PlanAck, Telemetry
from controller.protocol_service import IngestResult, PlanRecord, TelemetryBatch

WINDOW_STEPS = 4
BUDGET_BYTES = 64 * TINY_UNIT_BYTES  # api/demo_loop.py's budget
DECIDE_TIMEOUT_S = 5.0  # how long a window waits for the service's decision on it


@dataclass
class HttpPlanSource:
    """agent.closed_loop.PlanSource over the service's JSON API."""

    client: httpx.Client
    agent_id: str
    sent: int = 0
    version: int = 0
    refused: list[str] = field(default_factory=list)

    def sync_from(self, telemetry: Telemetry) -> None:
        body = TelemetryBatch(windows=(telemetry,)).model_dump(mode="json")
        r = self.client.post("/v1/telemetry", json=body)
        r.raise_for_status()
        result = IngestResult.model_validate(r.json())
        if result.rejected:
            raise ValueError("; ".join(f"{x.code}: {x.message}" for x in result.rejected))
        self.sent += 1

    def step_next(self) -> Plan | None:
        deadline = time.monotonic() + DECIDE_TIMEOUT_S
        while time.monotonic() < deadline:  # the service plans in the background; wait for it to see this window
            newest = self.client.get("/v1/decisions", params={"agent_id": self.agent_id, "limit": 1}).json()
            if newest and newest[0]["window"] >= self.sent:
                break
            time.sleep(0.05)
        r = self.client.get(f"/v1/agents/{self.agent_id}/plan", params={"since_version": self.version})
        if r.status_code in (204, 304):
            return None
        r.raise_for_status()
        plan = PlanRecord.model_validate(r.json()).plan
        self.version = plan.version
        return plan

    def record_ack(self, ack: PlanAck) -> None:
        self.client.post("/v1/acks", json=ack.model_dump(mode="json")).raise_for_status()


def replay(base_url: str, token: str, workdir: Path, agent_id: str = "replay-0",
           num_requests: int = 24) -> dict[str, Any]:
    """Run the phased demo workload against the service at `base_url`; returns the loop's stats."""
    from agent.closed_loop import InProcessLoop
    from api.demo_loop import phased_requests
    from runtime.device import Device
    from runtime.engine.engine import EngineConfig, ReferenceEngine
    from runtime.engine.presets import preset
    from runtime.engine.routing_trace import RoutingTrace
    from runtime.engine.runner import ForcedRouter, Runner
    from runtime.engine.scheduler import PreemptMode, Scheduler

    data = Path(__file__).resolve().parents[3] / "data"
    reqs, _ = phased_requests(num_requests)
    kv_floor = max(-(-(r.prompt_len + r.output_len) // BLOCK_TOKENS) for r in reqs) + 1
    engine = ReferenceEngine(preset("tiny"), Device("cpu"), EngineConfig(
        block_tokens=BLOCK_TOKENS, resident_frac=1.0, kv_gpu_blocks=KV_GPU_CAPACITY, kv_cpu_blocks=KV_CPU_BLOCKS,
        kv_nvme_blocks=KV_NVME_BLOCKS, workdir=workdir))
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=10.0) as client:
        try:
            if engine.pool.layout.stride_bytes != 3 * TINY_UNIT_BYTES or engine.cache.block_bytes != TINY_UNIT_BYTES:
                raise RuntimeError("the tiny engine's sizes changed: api/bench_api.py's registration no longer fits")
            reg = tiny_registration(agent_id, kv_gpu_blocks_min=kv_floor, registered_s=time.time())
            client.post("/v1/agents", json=reg.model_dump(mode="json")).raise_for_status()
            sched = Scheduler(KV_GPU_CAPACITY, BLOCK_TOKENS, max_batch=MAX_BATCH, preempt=PreemptMode.SWAP)

            def follow(plan: Plan) -> None:  # admission follows the plan's GPU KV share, as in the demo
                sched.gpu_blocks = min(KV_GPU_CAPACITY, plan.kv_blocks_per_tier["gpu"])

            source = HttpPlanSource(client, agent_id)
            loop = InProcessLoop(engine, source, window_steps=WINDOW_STEPS, on_applied=follow,
                                 hbm_budget_bytes=BUDGET_BYTES, agent_id=agent_id, clock=time.time)
            trace = RoutingTrace.load(data / "routing/flame_moe_290m_sample.npz")
            Runner(engine, sched, ForcedRouter(trace, engine), on_step=loop.on_step,
                   virtual_step_s=VIRTUAL_STEP_S).run(reqs)
            loop.finish()
            return {**loop.stats(), "refused_messages": loop.refused, "errors": loop.planner_errors}
        finally:
            engine.close()
