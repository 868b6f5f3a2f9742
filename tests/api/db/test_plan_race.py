"""Two real service processes race to issue plan versions for one agent against one database (PostgreSQL, and
a SQLite file): every version is stored exactly once, by the process that was told it won, and every loser
got a PlanConflict naming a version at least as new as the one it tried, which the other process stored.
Each process reads the newest version and stores the next, as the service's planner does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.api.db.builders import registration
from tests.conftest import wait_until
from tierplan.api.db import migrate
from tierplan.api.db.engine import make_engine
from tierplan.api.db.repo import Repository
from tierplan.controller.protocol_service import PlanState

NUM_VERSIONS = 150
ROOT = Path(__file__).resolve().parents[3]


def _url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    url = request.getfixturevalue("fresh_pg_url") if backend == "postgresql" else f"sqlite:///{tmp_path / 'r.db'}"
    migrate.upgrade(url)
    return url


def _race(url: str, tmp_path: Path, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Run one race worker per name against `url`, started together; their JSON results by name."""
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.api.db.race_worker", url, "agent-0", str(NUM_VERSIONS),
                               name, str(go)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for name in names]
    for name in names:  # all connected and waiting: then start them together
        wait_until(lambda n=name: (tmp_path / f"{n}.ready").exists() or any(p.poll() is not None for p in procs),
                   timeout_s=120, what=f"race worker {name} ready")
    go.touch()
    results = {}
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        results[got["name"]] = got
    return results


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_two_processes_never_store_one_version_twice(backend: str, tmp_path: Path,
                                                     request: pytest.FixtureRequest) -> None:
    url = _url(backend, tmp_path, request)
    engine = make_engine(url)
    repo = Repository(engine)
    repo.register_agent(registration())
    results = _race(url, tmp_path, ("A", "B"))

    winner = {}
    for name, got in results.items():
        for version in got["won"]:
            assert version not in winner, f"version {version} won by both {winner[version]} and {name}"
            winner[version] = name
    assert sorted(winner) == list(range(1, NUM_VERSIONS + 1))  # each version stored once, none skipped
    stored = repo.plan_history("agent-0", limit=NUM_VERSIONS + 10)
    assert [r.plan.version for r in stored] == list(range(NUM_VERSIONS, 0, -1))
    assert {r.plan.version: r.plan.reason for r in stored} == {v: f"by {n}" for v, n in winner.items()}
    num_lost = 0
    for name, got in results.items():
        num_lost += len(got["lost"])
        for attempted, current in got["lost"]:
            assert current >= attempted, f"{name} lost v{attempted} to a conflict naming older v{current}"
            assert winner[attempted] != name
    assert num_lost > 0, "no process ever lost: the two did not race, so this run proved nothing"
    assert repo.newest_version("agent-0") == NUM_VERSIONS
    engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_acks_while_two_processes_issue(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A third process acks each newest plan while two issue: no lock waits on each other (a deadlock would
    surface as Unavailable and a failed worker), and the applied version ends at the newest acked."""
    url = _url(backend, tmp_path, request)
    engine = make_engine(url)
    repo = Repository(engine)
    repo.register_agent(registration())
    results = _race(url, tmp_path, ("A", "B", "acker"))
    acked = results["acker"]["acked"]
    assert acked == sorted(set(acked)) and acked[-1] == NUM_VERSIONS
    states = {r.plan.version: r.state for r in repo.plan_history("agent-0", limit=NUM_VERSIONS)}
    assert {v for v, s in states.items() if s is PlanState.APPLIED} == set(acked)
    assert repo.agent_status("agent-0").applied_version == NUM_VERSIONS  # type: ignore[union-attr]
    engine.dispose()
