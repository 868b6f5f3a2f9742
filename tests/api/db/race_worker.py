"""One of the service processes in the plan-version race (tests/api/db/test_plan_race.py runs two of these).

Run as `python -m tests.api.db.race_worker URL AGENT_ID NUM_VERSIONS NAME GO_FILE`: says it is ready
(NAME.ready beside GO_FILE) and waits for GO_FILE, so both processes start racing together; then does what a
service's planner does: reads the agent's newest plan version and stores the next one (stamped with NAME),
until NUM_VERSIONS exist. Prints one JSON line: the versions it won and, for each loss, (attempted, the
PlanConflict's current_version). A NAME starting with "acker" acks instead: it applies the newest plan
whenever it has no ack yet, until version NUM_VERSIONS is acked, and prints the versions it acked. It
touches only the database it is given.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tests.api.db.builders import ack, plan
from tierplan.api.db.engine import make_engine
from tierplan.api.db.errors import PlanConflict
from tierplan.api.db.repo import Repository


def main(url: str, agent_id: str, num_versions: int, name: str, go_file: Path) -> None:
    engine = make_engine(url)
    repo = Repository(engine)
    repo.ping()  # connect before the start line, so both start equally warm
    go_file.with_name(f"{name}.ready").touch()
    end = time.monotonic() + 60
    while not go_file.exists() and time.monotonic() < end:
        time.sleep(0.001)
    if name.startswith("acker"):
        print(json.dumps({"name": name, "acked": _ack_until(repo, agent_id, num_versions)}))
        engine.dispose()
        return
    won: list[int] = []
    lost: list[tuple[int, int]] = []
    while (version := repo.newest_version(agent_id) + 1) <= num_versions:
        try:
            repo.insert_plan(agent_id, plan(version, reason=f"by {name}"))
            won.append(version)
        except PlanConflict as exc:
            lost.append((version, exc.current_version))
    engine.dispose()
    print(json.dumps({"name": name, "won": won, "lost": lost}))


def _ack_until(repo: Repository, agent_id: str, num_versions: int) -> list[int]:
    acked: list[int] = []
    while not acked or acked[-1] < num_versions:
        rec = repo.current_plan(agent_id)
        if rec is None or rec.ack is not None:
            continue
        repo.record_ack(ack(rec.plan, agent_id=agent_id))  # the only acker: a Conflict here is a bug
        acked.append(rec.plan.version)
    return acked


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))
