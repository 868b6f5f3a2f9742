"""Story: two real `tierplan serve` processes share one PostgreSQL database and one agent. Its windows go to
one process or the other in turn, its acks to the other one, and both planner threads race to plan for it.
However they interleave, every plan version is stored once, both processes serve the same plan history,
and each issued version has exactly one decision: the loser of a race adopts the winner's plan."""

from __future__ import annotations

import time

import httpx
import numpy as np

from tierplan.api.bench_api import serve_process, synthetic_window
from tierplan.api.db import migrate
from tierplan.api.demo_loop import tiny_registration
from tierplan.controller.protocol import AckStatus, Footprint, Plan, PlanAck
from tierplan.controller.protocol_service import PlanRecord, PolicyUpdate

TOKEN = "tp_two_processes_token"
ROUNDS = 14
# Whether two planners collide in a round is timing: on a loaded box a run of 14 rounds once saw none (session 38's
# clean-clone CI). Rounds go on, up to this many, until a race has been lost at least once, so the test always
# exercises the conflict path it is about, and still fails if no race is ever seen.
MAX_ROUNDS = 80


def _conflicts(*clients: httpx.Client) -> float:
    """Plan conflicts the processes have counted (each loser of a race adopted the stored plan)."""
    text = "".join(c.get("/metrics").text for c in clients)
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("tierplan_plan_conflicts_total"))


def _ack(plan: Plan) -> PlanAck:
    fp = Footprint(expert_bytes_per_layer=plan.expert_bytes_per_layer, kv_blocks_per_tier=plan.kv_blocks_per_tier,
                   total_hbm_bytes=plan.hbm_budget_bytes)
    return PlanAck(agent_id="agent-0", rank=0, plan_id=plan.plan_id, version=plan.version,
                   status=AckStatus.APPLIED, applied_s=1.0, footprint=fp)


def _newest(client: httpx.Client, since: int, timeout_s: float = 3.0) -> Plan | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = client.get("/v1/agents/agent-0/plan", params={"since_version": since})
        if r.status_code == 200:
            return PlanRecord.model_validate(r.json()).plan
        time.sleep(0.05)
    return None


def test_two_services_on_one_postgresql_never_issue_conflicting_plans(fresh_pg_url: str) -> None:
    migrate.upgrade(fresh_pg_url)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    rng = np.random.default_rng(3)
    with serve_process(fresh_pg_url, TOKEN, plan_interval_s=0.05) as url_a, \
            serve_process(fresh_pg_url, TOKEN, plan_interval_s=0.05) as url_b, \
            httpx.Client(base_url=url_a, headers=headers, timeout=10) as a, \
            httpx.Client(base_url=url_b, headers=headers, timeout=10) as b:
        update = PolicyUpdate.model_validate({"knobs": {"hysteresis": 0.0, "calibrate": False}, "why": "race"})
        assert a.put("/v1/policies/default", content=update.model_dump_json()).status_code == 200
        assert a.post("/v1/agents", content=tiny_registration().model_dump_json()).status_code == 201
        applied, seq = 0, 0
        r = 0
        while r < ROUNDS or (r < MAX_ROUNDS and _conflicts(a, b) < 1):
            # one window to each process: both planners have news and race for the next version
            first, second = (a, b) if r % 2 == 0 else (b, a)
            for i, to in enumerate((first, second)):
                win = synthetic_window("agent-0", seq, rng, applied_plan_version=applied,
                                       kv_blocks=10 + 40 * (r % 3 == 2), batch_tokens=2 + 10 * (r % 2), hot=r + i)
                seq += 1
                res = to.post("/v1/telemetry", content='{"windows": [' + win.model_dump_json() + "]}")
                assert res.status_code == 200 and res.json()["accepted"] == 1, res.text
            plan = _newest(second, applied, timeout_s=1.5)
            if plan is not None:
                ack = first.post("/v1/acks", content=_ack(plan).model_dump_json())
                assert ack.status_code == 200, ack.text
                applied = plan.version
            r += 1
        time.sleep(0.3)  # let both planners finish their last pass
        hist_a = a.get("/v1/agents/agent-0/plans", params={"limit": 1000}).json()
        hist_b = b.get("/v1/agents/agent-0/plans", params={"limit": 1000}).json()
        decisions = a.get("/v1/decisions", params={"limit": 1000}).json()
        conflicts = _conflicts(a, b)
    versions = [h["plan"]["version"] for h in hist_a]
    assert len(versions) >= 2 and versions == list(range(len(versions), 0, -1))
    assert [(h["plan"]["plan_id"], h["plan"]["reason"]) for h in hist_a] == \
        [(h["plan"]["plan_id"], h["plan"]["reason"]) for h in hist_b]
    issued = sorted(d["version"] for d in decisions if d["outcome"] == "issued")
    assert issued == sorted(versions)  # one decision per stored version: a loser stored none
    assert conflicts >= 1, r  # the race did happen (and was lost by someone, who adopted the stored plan)
