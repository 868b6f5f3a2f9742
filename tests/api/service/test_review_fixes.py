"""Regression tests for what a review of the service found: each failed on the code before its fix."""

from __future__ import annotations

from typing import Any

from tests.api.service.conftest import AUTH, Service, windows
from tierplan.api.db.errors import Unavailable
from tierplan.api.demo_loop import tiny_registration
from tierplan.controller.protocol import ExpertKey
from tierplan.controller.protocol_service import PolicyKnobs


def test_a_store_failure_does_not_poison_the_mirror_and_the_retry_is_stored(svc: Service, monkeypatch) -> None:
    """A 503 from the database after the windows were mirrored: the retry must be accepted and stored, not
    refused as seq_not_increasing (which the sidecar would count as delivered: the windows would vanish)."""
    assert svc.register().status_code == 201
    batch = windows("agent-0", 0, 4)
    real = svc.app.state.repo.add_windows
    calls = {"n": 0}

    def fail_once(wins: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise Unavailable("database unavailable (injected)")
        real(wins)

    monkeypatch.setattr(svc.app.state.repo, "add_windows", fail_once)
    assert svc.send(batch).status_code == 503
    r = svc.send(batch)
    assert r.status_code == 200 and r.json()["accepted"] == 4, r.text
    assert svc.client.get("/v1/agents/agent-0").json()["windows"] == 4


def test_integers_beyond_64_bits_are_refused_with_422_not_500(svc: Service) -> None:
    body = tiny_registration("big").model_dump(mode="json")
    body["rank"] = 10**30
    r = svc.client.post("/v1/agents", json=body, headers=AUTH)
    assert r.status_code == 422 and "rank" in r.text, r.text
    assert svc.register().status_code == 201
    w = windows("agent-0", 0, 1)[0].model_dump(mode="json")
    w["window_seq"] = 10**30
    r = svc.client.post("/v1/telemetry", json={"windows": [w]}, headers=AUTH)
    assert r.status_code == 422 and "window_seq" in r.text, r.text
    assert svc.send(windows("agent-0", 5, 1)).json()["accepted"] == 1  # the agent is not poisoned


def test_control_characters_in_ids_are_refused(svc: Service) -> None:
    body = {**tiny_registration("ab").model_dump(mode="json"), "agent_id": "a\x00b"}
    r = svc.client.post("/v1/agents", json=body, headers=AUTH)
    assert r.status_code == 422, r.text
    assert svc.client.get("/v1/agents/a%00b").status_code in (404, 422)


def test_a_slot_cap_below_a_layers_pins_plus_top_k_is_refused_by_name(svc: Service) -> None:
    assert svc.register().status_code == 201
    pins = tuple(ExpertKey(layer=0, expert=e) for e in range(3))
    knobs = PolicyKnobs(max_slots_per_layer=2, pinned_experts=pins)
    r = svc.client.put("/v1/policies/default", json={"knobs": knobs.model_dump(mode="json"), "why": "too tight"},
                       headers=AUTH)
    assert r.status_code == 422 and "max_slots_per_layer" in r.text and "layer 0" in r.text, r.text


def test_the_write_gate_answers_503_when_the_token_table_cannot_be_read(svc: Service, monkeypatch) -> None:
    auth = svc.app.state.auth

    def down(*_: Any) -> None:
        raise Unavailable("database unavailable (injected)")

    monkeypatch.setattr(auth, "writer", down)
    r = svc.send(windows("agent-0", 0, 1))
    assert r.status_code == 503, r.text


def test_windows_from_unregistered_ids_share_one_metric_label(svc: Service) -> None:
    for i in range(20):
        assert svc.send(windows(f"ghost-{i}", 0, 1)).json()["rejected"][0]["code"] == "unknown_agent"
    text = svc.client.get("/metrics").text
    assert "ghost-" not in text
    assert 'tierplan_telemetry_windows_total{agent_id="unregistered",result="rejected"} 20.0' in text
