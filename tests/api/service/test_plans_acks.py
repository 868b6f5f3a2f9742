"""Plans, acks and decisions over HTTP, planned by the hub's planner pass (never on the request path): the
poll answers 204 before any plan, 200 with an ETag, 304 for If-None-Match / since_version; the ack is
recorded once (409 the second time, 404 for a plan never issued); windows run under a plan give its
decision a measured step time."""

from __future__ import annotations

import httpx
import pytest

from tests.api.service.conftest import AUTH, Service, windows
from tierplan.controller.protocol import AckStatus, Footprint, PlanAck, Tier


def ack_for(plan: dict, status: AckStatus = AckStatus.APPLIED, **kw: object) -> PlanAck:
    fp = Footprint(expert_bytes_per_layer=tuple(plan["expert_bytes_per_layer"]),
                   kv_blocks_per_tier={Tier(k): v for k, v in plan["kv_blocks_per_tier"].items()},
                   total_hbm_bytes=plan["hbm_budget_bytes"])
    return PlanAck(agent_id="agent-0", rank=0, plan_id=plan["plan_id"], version=plan["version"], status=status,
                   applied_s=5.0, footprint=fp, **kw)


def post_ack(svc: Service, ack: PlanAck) -> httpx.Response:
    return svc.client.post("/v1/acks", content=ack.model_dump_json(), headers=AUTH)


def test_ingest_never_plans_the_planner_pass_does(svc: Service) -> None:
    svc.register()
    assert svc.client.get("/v1/agents/agent-0/plan").status_code == 204
    svc.send(windows("agent-0", 0, 3))
    assert svc.client.get("/v1/agents/agent-0/plan").status_code == 204  # nothing planned on the request path
    assert svc.hub.plan_once() == 1
    r = svc.client.get("/v1/agents/agent-0/plan")
    assert r.status_code == 200 and r.headers["etag"] == '"v1"'
    rec = r.json()
    assert rec["state"] == "issued" and rec["plan"]["version"] == 1 and rec["plan"]["base_version"] == 0
    assert svc.client.get("/v1/agents/agent-0/plan", headers={"If-None-Match": '"v1"'}).status_code == 304
    assert svc.client.get("/v1/agents/agent-0/plan", headers={"If-None-Match": 'W/"v1", "v0"'}).status_code == 304
    assert svc.client.get("/v1/agents/agent-0/plan", headers={"If-None-Match": '"v0"'}).status_code == 200
    assert svc.client.get("/v1/agents/agent-0/plan?since_version=1").status_code == 304
    assert svc.client.get("/v1/agents/agent-0/plan?since_version=0").status_code == 200
    assert svc.client.get("/v1/agents/agent-0/plan?since_version=-1").status_code == 422
    assert svc.client.get("/v1/agents/ghost/plan").status_code == 404
    history = svc.client.get("/v1/agents/agent-0/plans").json()
    assert [h["plan"]["version"] for h in history] == [1]


def test_an_ack_is_recorded_once_and_windows_under_the_plan_measure_it(svc: Service) -> None:
    svc.register()
    svc.send(windows("agent-0", 0, 3))
    svc.hub.plan_once()
    plan = svc.client.get("/v1/agents/agent-0/plan").json()["plan"]
    r = post_ack(svc, ack_for(plan))
    assert r.status_code == 200 and r.json()["state"] == "applied" and r.json()["ack"]["version"] == 1
    again = post_ack(svc, ack_for(plan))
    assert again.status_code == 409 and "1" in again.json()["detail"]
    never = post_ack(svc, ack_for({**plan, "version": 9, "plan_id": "plan-9"}))
    assert never.status_code == 404
    assert svc.client.get("/v1/agents/agent-0").json()["applied_version"] == 1
    decisions = svc.client.get("/v1/decisions?agent_id=agent-0").json()
    assert [d["outcome"] for d in decisions] == ["issued"] and decisions[0]["measured_step_ms"] is None
    assert decisions[0]["predicted_step_ms"] > 0 and decisions[0]["reason"]
    svc.send(windows("agent-0", 3, 2, applied_plan_version=1, step_ms=3.0))
    svc.hub.plan_once()
    measured = {d["version"]: d["measured_step_ms"] for d in svc.client.get("/v1/decisions").json()}
    assert measured[1] == 3.0  # the mean step p50 of the windows run under plan 1


def test_a_rejected_plan_is_replaced(svc: Service) -> None:
    svc.register()
    svc.send(windows("agent-0", 0, 3))
    svc.hub.plan_once()
    plan = svc.client.get("/v1/agents/agent-0/plan").json()["plan"]
    r = post_ack(svc, ack_for(plan, AckStatus.REJECTED, reason_code="over_budget", reason="too big"))
    assert r.status_code == 200 and r.json()["state"] == "rejected"
    svc.send(windows("agent-0", 3, 1))
    svc.hub.plan_once()
    newest = svc.client.get("/v1/agents/agent-0/plan").json()["plan"]
    assert newest["version"] == 2 and "rejected" in newest["reason"]
    assert 'tierplan_plans_rejected_total{agent_id="agent-0",reason="over_budget"} 1.0' in \
        svc.client.get("/metrics").text


def test_decisions_filter_by_agent_and_time(svc: Service) -> None:
    for agent in ("agent-0", "agent-1"):
        svc.register(agent)
        svc.send(windows(agent, 0, 3))
        svc.hub.plan_once()
        svc.clock.now_s += 100
    everything = svc.client.get("/v1/decisions").json()
    assert [d["agent_id"] for d in everything] == ["agent-1", "agent-0"]  # newest first
    assert [d["agent_id"] for d in svc.client.get("/v1/decisions?agent_id=agent-0").json()] == ["agent-0"]
    late = svc.client.get("/v1/decisions?since_s=1050").json()
    assert [d["agent_id"] for d in late] == ["agent-1"]
    assert svc.client.get("/v1/decisions?since_s=2000&until_s=1000").status_code == 422
    assert svc.client.get("/v1/decisions?limit=0").status_code == 422


def test_metrics_show_the_service_side(svc: Service) -> None:
    svc.register()
    svc.send(windows("agent-0", 0, 3))
    svc.hub.plan_once()
    text = svc.client.get("/metrics").text
    for needle in ('tierplan_telemetry_windows_total{agent_id="agent-0",result="accepted"} 3.0',
                   'tierplan_plans_issued_total{agent_id="agent-0"} 1.0',
                   'tierplan_plan_version{agent_id="agent-0",kind="issued"} 1.0',
                   'tierplan_split_kv_blocks{agent_id="agent-0",tier="gpu"}',
                   'tierplan_split_expert_slots{agent_id="agent-0",layer="0"}',
                   'tierplan_stall_seconds_total{agent_id="agent-0",cause="expert_miss"}',
                   'tierplan_step_seconds{agent_id="agent-0",quantile="p50"} 0.002',
                   "tierplan_telemetry_ingest_seconds_count 1.0",
                   'tierplan_http_requests_total{method="POST",route="/v1/telemetry",status="200"} 1.0'):
        assert needle in text, needle
    assert svc.client.get("/healthz").json() == {"status": "ok"}
    assert svc.client.get("/readyz").json() == {"status": "ready"}


def test_a_plan_the_database_did_not_store_is_planned_again(svc: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierplan.api.db.errors import Unavailable

    svc.register()
    svc.send(windows("agent-0", 0, 3))
    real = svc.app.state.repo.insert_plan
    monkeypatch.setattr(svc.app.state.repo, "insert_plan", lambda *a: (_ for _ in ()).throw(Unavailable("db down")))
    assert svc.hub.plan_once() == 0
    assert 'tierplan_planner_errors_total{agent_id="agent-0",kind="Unavailable"} 1.0' in svc.client.get("/metrics").text
    monkeypatch.setattr(svc.app.state.repo, "insert_plan", real)
    svc.send(windows("agent-0", 3, 1))
    assert svc.hub.plan_once() == 1
    assert svc.client.get("/v1/agents/agent-0/plan").json()["plan"]["version"] == 1  # not 2: nothing was skipped
