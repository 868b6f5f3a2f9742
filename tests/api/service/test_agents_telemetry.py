"""Agents and telemetry over HTTP: register (201, 200 unchanged, 409 different shape), read back (404 unknown),
ingest batches (accepted, unknown agent, repeated and out-of-order windows), and the client errors every write
endpoint gives (400 bad JSON, 422 wrong types with the field path, 413 oversize, 401 no token, 403 read token)."""

from __future__ import annotations

import json

from sqlalchemy import text

from tests.api.service.conftest import AUTH, READ_AUTH, READ_TOKEN, WRITE_TOKEN, Service, windows
from tierplan.api.demo_loop import tiny_registration


def test_register_is_201_then_200_unchanged_then_409_for_another_shape(svc: Service) -> None:
    first = svc.register()
    assert first.status_code == 201, first.text
    assert first.json()["agent_id"] == "agent-0" and first.json()["state"] == "new"
    assert svc.register().status_code == 200
    other = tiny_registration("agent-0").model_copy(update={"engine": "vllm"})
    r = svc.client.post("/v1/agents", content=other.model_dump_json(), headers=AUTH)
    assert r.status_code == 409 and "agent-0" in r.json()["detail"]
    assert [a["agent_id"] for a in svc.client.get("/v1/agents").json()] == ["agent-0"]
    assert svc.client.get("/v1/agents/agent-0").json()["windows"] == 0
    missing = svc.client.get("/v1/agents/nobody")
    assert missing.status_code == 404 and "nobody" in missing.json()["detail"]


def test_ingest_accepts_windows_and_names_each_rejection(svc: Service) -> None:
    svc.register()
    r = svc.send(windows("agent-0", 0, 5))
    assert r.status_code == 200 and r.json() == {"accepted": 5, "rejected": []}
    # Repeated (seq 3, 4), then one for an agent nobody registered, then a fresh one.
    batch = [*windows("agent-0", 3, 2), *windows("ghost", 0, 1), *windows("agent-0", 5, 1)]
    r = svc.send(batch)
    body = r.json()
    assert r.status_code == 200 and body["accepted"] == 1
    codes = {(x["index"], x["code"]) for x in body["rejected"]}
    assert codes == {(0, "seq_not_increasing"), (1, "seq_not_increasing"), (2, "unknown_agent")}
    assert svc.client.get("/v1/agents/agent-0").json()["windows"] == 6


def test_a_window_naming_a_plan_never_issued_is_refused(svc: Service) -> None:
    svc.register()
    r = svc.send(windows("agent-0", 0, 1, applied_plan_version=3))
    assert r.json()["rejected"][0]["code"] == "plan_version_ahead"


def test_client_errors_are_4xx_with_a_precise_detail(svc: Service) -> None:
    svc.register()
    bad_json = svc.client.post("/v1/telemetry", content=b'{"windows": [', headers=AUTH)
    assert bad_json.status_code == 400 and "invalid JSON" in bad_json.json()["detail"]
    body = json.loads('{"windows": [' + windows("agent-0", 0, 1)[0].model_dump_json() + "]}")
    body["windows"][0]["rank"] = "zero"
    wrong = svc.client.post("/v1/telemetry", json=body, headers=AUTH)
    assert wrong.status_code == 422 and "body.windows.0.rank" in wrong.json()["detail"], wrong.text
    empty = svc.client.post("/v1/telemetry", json={"windows": []}, headers=AUTH)
    assert empty.status_code == 422 and "body.windows" in empty.json()["detail"]
    no_type = svc.client.post("/v1/telemetry", content=json.dumps(body),
                              headers={"Authorization": AUTH["Authorization"]})
    assert no_type.status_code == 415 and "Content-Type" in no_type.json()["detail"]
    unknown_field = svc.client.post("/v1/telemetry", json={"windows": body["windows"], "extra": 1}, headers=AUTH)
    assert unknown_field.status_code == 422 and "extra" in unknown_field.json()["detail"]


def test_a_body_over_the_limit_is_413_declared_or_chunked(svc: Service) -> None:
    limit = svc.app.state.settings.max_body_bytes
    big = b'{"windows": [' + b" " * limit + b"]}"
    r = svc.client.post("/v1/telemetry", content=big, headers=AUTH)
    assert r.status_code == 413 and "limit" in r.json()["detail"]

    def chunks():
        for _ in range(5):
            yield b" " * (limit // 4)

    r = svc.client.post("/v1/telemetry", content=chunks(), headers=AUTH)
    assert r.status_code == 413


def test_write_endpoints_need_a_write_token(svc: Service) -> None:
    reg = tiny_registration().model_dump_json()
    none = svc.client.post("/v1/agents", content=reg, headers={"Content-Type": "application/json"})
    assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer"
    unknown = svc.client.post("/v1/agents", content=reg, headers={"Authorization": "Bearer tp_nope"})
    assert unknown.status_code == 401 and "unknown token" in unknown.json()["detail"]
    basic = svc.client.post("/v1/agents", content=reg, headers={"Authorization": "Basic abc"})
    assert basic.status_code == 401
    read = svc.client.post("/v1/agents", content=reg, headers=READ_AUTH)
    assert read.status_code == 403 and "scope 'read'" in read.json()["detail"]
    assert svc.client.get("/v1/agents").status_code == 200  # reads are open by default


def test_tokens_are_stored_only_as_their_hash(svc: Service) -> None:
    with svc.app.state.repo.engine.connect() as conn:
        tables = [r[0] for r in conn.execute(text("SELECT name FROM sqlite_master WHERE type='table'"))]
        dump = " ".join(str(v) for t in tables for row in conn.execute(text(f'SELECT * FROM "{t}"')) for v in row)
    assert WRITE_TOKEN not in dump and READ_TOKEN not in dump
    import hashlib

    assert hashlib.sha256(WRITE_TOKEN.encode()).hexdigest() in dump


def test_reads_need_a_token_when_the_settings_say_so(db_file: str) -> None:
    from tests.api.service.conftest import make_service
    from tests.conftest import FakeClock

    gen = make_service(db_file, FakeClock(1000.0), read_needs_token=True)
    svc = next(gen)
    try:
        for path in ("/v1/agents", "/v1/policies", "/v1/decisions", "/v1/agents/agent-0/plan"):
            assert svc.client.get(path).status_code == 401, path
        assert svc.client.get("/v1/agents", headers=READ_AUTH).status_code == 200
        assert svc.client.get("/healthz").status_code == 200  # probes stay open
    finally:
        gen.close()


def test_readyz_says_why_the_database_is_not_ready(svc: Service, monkeypatch) -> None:
    from tierplan.api.db.errors import Unavailable

    def down() -> None:
        raise Unavailable("database sqlite:///x is not reachable: disk I/O error")

    monkeypatch.setattr(svc.app.state.repo, "ping", down)
    r = svc.client.get("/readyz")
    assert r.status_code == 503 and "disk I/O error" in r.json()["detail"]
