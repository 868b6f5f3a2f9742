"""Property tests of the whole HTTP API from its own /openapi.json (schemathesis): no input, valid or not,
gets a 5xx, and no write endpoint does anything without a token (401, or 403 with a read token). Examples are
capped so the file stays fast."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode

from tests.api.service.conftest import READ_TOKEN, WRITE_TOKEN, windows
from tierplan.api.app import create_app
from tierplan.api.auth import hash_token
from tierplan.api.db import migrate
from tierplan.api.db.engine import make_engine
from tierplan.api.db.repo import Repository, Scope
from tierplan.api.demo_loop import tiny_registration
from tierplan.api.settings import Settings

MAX_EXAMPLES = 8
ACCEPTED = {"params", "headers", "content", "data", "files"}
WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


@pytest.fixture
def api_schema(tmp_path: Path) -> Iterator[Any]:
    url = f"sqlite:///{tmp_path / 'st.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    repo = Repository(engine)
    repo.add_token("bootstrap", Scope.WRITE, hash_token(WRITE_TOKEN))
    repo.add_token("reader", Scope.READ, hash_token(READ_TOKEN))
    repo.register_agent(tiny_registration("agent-0"))
    repo.add_windows(windows("agent-0", 0, 2))
    app = create_app(Settings(db_url=url, plan_interval_s=3600.0), repository=repo)
    with TestClient(app) as client:
        yield schemathesis.openapi.from_asgi("/openapi.json", app), client
    engine.dispose()


def send(client: TestClient, case: Any, authorization: str) -> httpx.Response:
    """The case through Starlette's (httpx) test client: schemathesis' own transport needs requests' urllib3,
    which the urllib3-future package in this environment replaces."""
    kw = case.as_transport_kwargs(base_url="http://testserver")
    kw.pop("cookies", None)
    kw["headers"] = {**{k: v for k, v in (kw.get("headers") or {}).items() if k.lower() != "authorization"},
                     "Authorization": authorization}
    if "json" in kw:
        kw["content"] = json.dumps(kw.pop("json")).encode()
    if isinstance(kw.get("data"), bytes | str):
        kw["content"] = kw.pop("data")
    return client.request(kw.pop("method"), kw.pop("url"), **{k: v for k, v in kw.items() if k in ACCEPTED})


_fast = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))


def operations(schema: Any, methods: set[str] | None = None) -> list[Any]:
    ops = [r.ok() for r in schema.get_all_operations()]
    return [op for op in ops if methods is None or op.method.upper() in methods]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_gets_a_server_error(api_schema: Any, mode: GenerationMode) -> None:
    schema, client = api_schema
    ops = operations(schema)
    assert len(ops) >= 12  # every route is in the schema

    for op in ops:
        @given(op.as_strategy(generation_mode=mode))
        @_fast
        def check(case: Any) -> None:
            response = send(client, case, f"Bearer {WRITE_TOKEN}")
            case.validate_response(response, checks=[not_a_server_error])

        try:
            check()
        except Unsatisfiable:  # an operation without inputs (/healthz) has no invalid request to make
            assert mode is GenerationMode.NEGATIVE and not op.query and not op.body, op.path


def test_writes_need_a_write_token(api_schema: Any) -> None:
    schema, client = api_schema
    ops = operations(schema, WRITE_METHODS)
    assert {(op.method.upper(), op.path) for op in ops} == {
        ("POST", "/v1/agents"), ("POST", "/v1/telemetry"), ("POST", "/v1/acks"), ("PUT", "/v1/policies/{group}")}
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(op.as_strategy(generation_mode=mode))
            @_fast
            def check(case: Any) -> None:
                bare = send(client, case, "")
                assert bare.status_code == 401, (case.method, case.path, bare.status_code, bare.text[:200])
                read = send(client, case, f"Bearer {READ_TOKEN}")
                assert read.status_code == 403, (case.method, case.path, read.status_code, read.text[:200])

            check()
