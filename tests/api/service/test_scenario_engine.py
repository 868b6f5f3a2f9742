"""Story: the CPU reference engine with its agent runs the demo's phased workload (bundled Mooncake requests,
FLAME-MoE routing) with the controller behind the HTTP service instead of in process. Every window goes
through POST /v1/telemetry, the planner pass plans (as the planner thread would), the agent polls the plan
endpoint, applies what it gets and acks it. The run ends with several issued and applied plans, no window
refused, the budget held, the same outputs as the static split, and decisions with measured step times."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.api.service.conftest import AUTH, Service
from tierplan.api.demo_loop import tiny_registration
from tierplan.controller.protocol import Plan, PlanAck, Telemetry
from tierplan.controller.protocol_service import PlanRecord, PolicyUpdate


class HttpPlanSource:
    """agent.closed_loop.PlanSource over the service's HTTP API (what the sidecar does, minus its queues)."""

    def __init__(self, svc: Service) -> None:
        self.svc, self.version, self.posts = svc, 0, 0

    def sync_from(self, telemetry: Telemetry) -> None:
        body = self.svc.send([telemetry]).json()
        self.posts += 1
        if body["rejected"]:
            raise ValueError(body["rejected"][0]["message"])

    def step_next(self) -> Plan | None:
        self.svc.hub.plan_once()
        r = self.svc.client.get("/v1/agents/agent-0/plan", params={"since_version": self.version})
        if r.status_code != 200:
            return None
        plan = PlanRecord.model_validate(r.json()).plan
        self.version = plan.version
        return plan

    def record_ack(self, ack: PlanAck) -> None:
        r = self.svc.client.post("/v1/acks", content=ack.model_dump_json(), headers=AUTH)
        assert r.status_code == 200, r.text

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.svc.client.get("/v1/decisions", params={"agent_id": "agent-0"}).json()


@pytest.mark.parametrize("num_requests", [24])
def test_engine_windows_through_the_service_end_in_applied_plans_with_measured_outcomes(
        svc: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, num_requests: int) -> None:
    import tierplan.api.demo_loop as demo

    sources: list[HttpPlanSource] = []

    def controller_behind_http(engine: Any, budget_bytes: int, kv_floor: int, calibrate: bool) -> HttpPlanSource:
        assert budget_bytes == 64 * 4096 and engine.pool.layout.stride_bytes == 3 * 4096
        knobs = {"min_slots_per_layer": engine.spec.top_k, "horizon_steps": 4 * demo.WINDOW_STEPS,
                 "calibrate": calibrate}
        update = PolicyUpdate.model_validate({"knobs": knobs, "why": "the demo's controller settings"})
        assert svc.client.put("/v1/policies/default", content=update.model_dump_json(), headers=AUTH).status_code == 200
        reg = tiny_registration("agent-0", kv_gpu_blocks_min=kv_floor)
        assert svc.client.post("/v1/agents", content=reg.model_dump_json(), headers=AUTH).status_code == 201
        sources.append(HttpPlanSource(svc))
        return sources[0]

    monkeypatch.setattr(demo, "_controller", controller_behind_http)
    served = demo.run_loop_job(tmp_path / "served", True, num_requests=num_requests, calibrate=False)
    static = demo.run_loop_job(tmp_path / "static", False, num_requests=num_requests)

    stats = served.stats
    assert stats["telemetry_refused"] == 0 and stats["planner_errors"] == 0, stats
    assert stats["plans"] >= 2 and stats["applied"] == stats["plans"], stats
    assert stats["peak_over_budget_bytes"] <= 0
    assert served.outputs == static.outputs  # moving experts and KV never changes a token
    agent = svc.client.get("/v1/agents/agent-0").json()
    assert agent["windows"] == stats["windows"] == sources[0].posts
    assert agent["issued_version"] == agent["applied_version"] == stats["plans"]
    decisions = served.history
    issued = [d for d in decisions if d["outcome"] == "issued"]
    assert len(issued) == stats["plans"]
    measured = [d for d in issued if d["measured_step_ms"] is not None]
    assert measured and all(d["measured_step_ms"] > 0 and d["predicted_step_ms"] > 0 for d in measured)
    assert all(d["reason"] for d in decisions)
    history = svc.client.get("/v1/agents/agent-0/plans").json()
    assert history[0]["state"] == "applied"
    assert {h["state"] for h in history[1:]} <= {"applied", "superseded"}
