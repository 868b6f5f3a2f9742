"""The service calls one Repository from many threads (FastAPI's threadpool, the planner thread): on a SQLite
file and on the shared in-memory database (`sqlite://`, one connection for all) every transaction stays whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.db.builders import plan, registration, windows
from tests.conftest import start_thread
from tierplan.api.db import migrate
from tierplan.api.db.engine import make_engine
from tierplan.api.db.repo import Repository

NUM_THREADS, NUM_STEPS = 4, 25


@pytest.mark.parametrize("where", ["memory", "file"])
def test_threads_share_one_repository(where: str, tmp_path: Path) -> None:
    engine = make_engine("sqlite://" if where == "memory" else f"sqlite:///{tmp_path / 't.db'}")
    migrate.upgrade(engine)
    repo = Repository(engine)

    def work(agent_id: str) -> None:
        repo.register_agent(registration(agent_id))
        for step in range(NUM_STEPS):
            repo.add_windows(windows(2, agent_id=agent_id, first_seq=2 * step))
            repo.insert_plan(agent_id, plan(step + 1))
            assert repo.current_plan(agent_id).plan.version == step + 1  # type: ignore[union-attr]

    started = [start_thread(lambda a=f"agent-{i}": work(a)) for i in range(NUM_THREADS)]
    for thread, _ in started:
        thread.join(timeout=120)
    errors = [e for _, errs in started for e in errs]
    assert errors == []
    assert [(s.windows, s.issued_version) for s in repo.list_agents()] == [(2 * NUM_STEPS, NUM_STEPS)] * NUM_THREADS
    engine.dispose()
