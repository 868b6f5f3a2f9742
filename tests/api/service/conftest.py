"""Fixtures of the service tests: the app on a SQLite file with a write and a read token, a fake clock, and
helpers to register the tiny agent and send it windows (tests/api/service)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.conftest import FakeClock
from tierplan.api.app import create_app
from tierplan.api.auth import hash_token
from tierplan.api.bench_api import synthetic_window
from tierplan.api.db.repo import Scope
from tierplan.api.demo_loop import tiny_registration
from tierplan.api.hub import ControllerHub
from tierplan.api.settings import Settings
from tierplan.controller.protocol import Telemetry

WRITE_TOKEN = "tp_test_write_token_0123456789"
READ_TOKEN = "tp_test_read_token_0123456789"
AUTH = {"Authorization": f"Bearer {WRITE_TOKEN}", "Content-Type": "application/json"}
READ_AUTH = {"Authorization": f"Bearer {READ_TOKEN}", "Content-Type": "application/json"}


@dataclass
class Service:
    app: FastAPI
    client: TestClient
    clock: FakeClock
    db_url: str

    @property
    def hub(self) -> ControllerHub:
        return self.app.state.hub

    def register(self, agent_id: str = "agent-0", **kw: Any) -> Any:
        return self.client.post("/v1/agents", content=tiny_registration(agent_id, **kw).model_dump_json(),
                                headers=AUTH)

    def send(self, windows: list[Telemetry]) -> Any:
        body = '{"windows": [' + ",".join(w.model_dump_json() for w in windows) + "]}"
        return self.client.post("/v1/telemetry", content=body, headers=AUTH)


def windows(agent_id: str, first_seq: int, n: int, seed: int = 0, **kw: Any) -> list[Telemetry]:
    rng = np.random.default_rng(seed + first_seq)
    return [synthetic_window(agent_id, s, rng, **kw) for s in range(first_seq, first_seq + n)]


def make_service(db_url: str, clock: FakeClock, **settings: Any) -> Iterator[Service]:
    app = create_app(Settings(db_url=db_url, bootstrap_token=WRITE_TOKEN, plan_interval_s=3600.0, **settings),
                     clock=clock)
    with TestClient(app) as client:
        if app.state.repo.token_by_hash(hash_token(READ_TOKEN)) is None:
            app.state.repo.add_token("reader", Scope.READ, hash_token(READ_TOKEN))
        yield Service(app, client, clock, db_url)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def db_file(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'service.db'}"


@pytest.fixture
def svc(db_file: str, clock: FakeClock) -> Iterator[Service]:
    """The planner thread is parked (plan_interval_s = 1 h): tests run `svc.hub.plan_once()` themselves."""
    yield from make_service(db_file, clock)
