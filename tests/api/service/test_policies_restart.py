"""Policies over HTTP (versioned, who and why recorded, expected_version conflicts, knobs an agent cannot run
with refused by name, the group's controllers rebuilt with the new knobs) and a service restarted on the same
SQLite file resuming its plan versions."""

from __future__ import annotations

from tests.api.service.conftest import AUTH, READ_AUTH, Service, make_service, windows
from tests.api.service.test_plans_acks import ack_for
from tests.conftest import FakeClock
from tierplan.controller.protocol_service import PolicyKnobs, PolicyUpdate


def put(svc: Service, group: str, headers: dict[str, str] = AUTH, **body: object):
    update = PolicyUpdate.model_validate({"why": "test", **body})
    return svc.client.put(f"/v1/policies/{group}", content=update.model_dump_json(), headers=headers)


def test_policies_are_versioned_with_author_and_why(svc: Service) -> None:
    first = svc.client.get("/v1/policies/fast")
    assert first.status_code == 200 and first.json()["version"] == 0
    assert first.json()["knobs"] == PolicyKnobs().model_dump(mode="json")
    r = put(svc, "fast", knobs={"hysteresis": 0.2}, why="calmer", expected_version=0)
    assert r.status_code == 200 and r.json()["version"] == 1 and r.json()["author"] == "bootstrap"
    stale = put(svc, "fast", knobs={"hysteresis": 0.3}, expected_version=0)
    assert stale.status_code == 409 and "version 1" in stale.json()["detail"]
    assert put(svc, "fast", knobs={"hysteresis": 0.3}).json()["version"] == 2  # no expected_version: lands
    history = svc.client.get("/v1/policies/fast/history").json()
    assert [(h["version"], h["why"]) for h in history] == [(2, "test"), (1, "calmer")]
    groups = [p["group"] for p in svc.client.get("/v1/policies").json()]
    assert groups == ["default", "fast"]
    assert put(svc, "fast", headers=READ_AUTH, knobs={}).status_code == 403
    bad = svc.client.put("/v1/policies/fast", json={"knobs": {"hysteresis": 2}, "why": "x"}, headers=AUTH)
    assert bad.status_code == 422 and "body.knobs.hysteresis" in bad.json()["detail"]
    unknown = svc.client.put("/v1/policies/fast", json={"knobs": {"turbo": True}, "why": "x"}, headers=AUTH)
    assert unknown.status_code == 422 and "turbo" in unknown.json()["detail"]
    assert 'tierplan_policy_version{group="fast"} 2.0' in svc.client.get("/metrics").text


def test_a_knob_an_agent_of_the_group_cannot_run_with_is_refused(svc: Service) -> None:
    svc.register()
    r = put(svc, "default", knobs={"pinned_experts": [{"layer": 0, "expert": 9}]})
    assert r.status_code == 422 and "pinned_experts.0" in r.json()["detail"] and "agent-0" in r.json()["detail"]
    assert svc.client.get("/v1/policies/default").json()["version"] == 0  # nothing stored
    # and an agent whose group's policy does not fit it is refused at registration
    assert put(svc, "big", knobs={"min_slots_per_layer": 8}).status_code == 200
    reg = svc.register("agent-9", group="big", kv_gpu_blocks_min=60)
    assert reg.status_code == 422 and "min_slots_per_layer" in reg.json()["detail"]


def test_a_policy_change_rebuilds_the_groups_controllers(svc: Service) -> None:
    svc.register()
    svc.send(windows("agent-0", 0, 3))
    svc.hub.plan_once()
    plan = svc.client.get("/v1/agents/agent-0/plan").json()["plan"]
    assert svc.client.post("/v1/acks", content=ack_for(plan).model_dump_json(), headers=AUTH).status_code == 200
    assert max(plan["expert_bytes_per_layer"]) > 2 * 3 * 4096
    assert put(svc, "default", knobs={"max_slots_per_layer": 2, "calibrate": False}).status_code == 200
    slot = svc.hub._slot("agent-0")
    assert slot is not None and slot.needs_rebuild
    svc.send(windows("agent-0", 3, 1, applied_plan_version=1))
    svc.hub.plan_once()
    assert slot.knobs.max_slots_per_layer == 2 and slot.policy_version == 1
    decisions = svc.client.get("/v1/decisions").json()
    assert decisions[0]["policy_version"] == 1 and max(decisions[0]["split"]["expert_slots_per_layer"]) <= 2


def test_a_restarted_service_resumes_plan_versions(db_file: str) -> None:
    clock = FakeClock(1000.0)
    gen = make_service(db_file, clock)
    svc = next(gen)
    svc.register()
    svc.send(windows("agent-0", 0, 3))
    svc.hub.plan_once()
    plan = svc.client.get("/v1/agents/agent-0/plan").json()["plan"]
    assert plan["version"] == 1
    gen.close()  # shuts the app down (lifespan exit)

    again = make_service(db_file, clock)
    svc2 = next(again)
    try:
        slot = svc2.hub._slot("agent-0")
        assert slot is not None and slot.controller.state.issued_version == 1  # rebuilt from the database
        # the agent applied plan 1; its next windows say so and are accepted, the next plan is version 2
        r = svc2.send(windows("agent-0", 3, 3, applied_plan_version=1, kv_blocks=50, batch_tokens=12))
        assert r.json() == {"accepted": 3, "rejected": []}
        assert svc2.send(windows("agent-0", 2, 1)).json()["rejected"][0]["code"] == "seq_not_increasing"
        svc2.hub.plan_once()
        history = [h["plan"]["version"] for h in svc2.client.get("/v1/agents/agent-0/plans").json()]
        assert history[-1] == 1 and history == sorted(history, reverse=True) and len(set(history)) == len(history)
        assert svc2.client.get("/v1/agents/agent-0/plan").headers["etag"] == f'"v{history[0]}"'
    finally:
        again.close()


def test_the_planner_prunes_windows_past_the_retention(db_file: str) -> None:
    clock = FakeClock(100_000.0)
    gen = make_service(db_file, clock, retention_s=3600.0)
    svc = next(gen)
    try:
        svc.register()
        svc.send(windows("agent-0", 0, 3))
        assert svc.hub.prune() == 0  # nothing old yet
        clock.now_s += 2 * 3600
        svc.send(windows("agent-0", 3, 2))
        assert svc.hub.prune() == 3  # the first three were received over an hour ago
        assert [w.window_seq for w in svc.app.state.repo.recent_windows("agent-0", 10)] == [3, 4]
    finally:
        gen.close()
