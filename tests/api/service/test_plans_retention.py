"""The service's per-agent controller learns KV reuse from the windows it ingests: a prefix the windows report
reused often is first in the stored plan's `kv_retention`, and the plan and its decision say why."""

from __future__ import annotations

from tests.api.service.conftest import Service, windows
from tierplan.controller.protocol import ReuseEvent, Tier


def test_the_stored_plan_keeps_the_often_reused_prefix_first(svc: Service) -> None:
    svc.register()
    sent = []
    for i, w in enumerate(windows("agent-0", 0, 3)):
        hashes = ["aa01", "aa01", "aa01"] + (["bb02"] if i == 0 else [])
        events = tuple(ReuseEvent(prefix_hash=h, age_s=2.0, tier=Tier.CPU) for h in hashes)
        sent.append(w.model_copy(update={"kv": w.kv.model_copy(update={"reuse_events": events})}))
    svc.send(sent)
    assert svc.hub.plan_once() == 1
    plan = svc.client.get("/v1/agents/agent-0/plan").json()["plan"]
    assert plan["schema_version"] == 3 and plan["kv_retention"] == ["aa01", "bb02"]
    assert "KV retention: 2 prefixes kept first" in plan["reason"]
    history = svc.client.get("/v1/agents/agent-0/plans").json()
    assert history[0]["plan"]["kv_retention"] == ["aa01", "bb02"]  # stored as JSON and read back whole
    decisions = svc.client.get("/v1/decisions?agent_id=agent-0").json()
    assert "KV retention: 2 prefixes kept first" in decisions[0]["reason"]
