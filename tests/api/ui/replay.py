"""Fills a running controller service with real decisions: the CPU reference engine and its agent replay the
bundled Mooncake requests and routing trace (api/demo_loop.py's phased workload) in a closed loop whose plan
source is the service's HTTP API (register with api/demo_loop.py's registration of that agent, POST telemetry,
GET the plan, POST acks).

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

from tierplan.controller.protocol import Plan, PlanAck, Telemetry
from tierplan.controller.protocol_service import IngestResult, PlanRecord, TelemetryBatch

# How long a window waits for the service's decision on it: a window that stops waiting goes on under the old
# plan, and the service's next decision then lands a window late. On a loaded 2-core box a CI run saw one plan
# where the fixture wants two (session 27); a generous wait costs nothing where decisions are quick.
DECIDE_TIMEOUT_S = 30.0


@dataclass
class HttpPlanSource:
    """agent.closed_loop.PlanSource over the service's JSON API."""

    client: httpx.Client
    agent_id: str
    rank: int = 0
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
    """Run the phased demo workload (api/demo_loop.run_loop_job) against the service at `base_url`, windows
    stamped with wall-clock time; returns the loop's stats."""
    from tierplan.api.demo_loop import engine_registration, run_loop_job

    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=10.0) as client:
        def source(engine: Any, budget: int, kv_floor: int) -> HttpPlanSource:
            reg = engine_registration(engine, budget, kv_floor, agent_id, "default", registered_s=time.time())
            client.post("/v1/agents", json=reg.model_dump(mode="json")).raise_for_status()
            return HttpPlanSource(client, agent_id)

        return run_loop_job(workdir, True, num_requests, source=source, clock=time.time).stats
