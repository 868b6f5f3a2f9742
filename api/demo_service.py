"""The demo's controller run through the real service: `tierplan serve` on SQLite, a `tierplan sidecar` beside the
engine, the tiny engine's agent talking to it over a unix socket (`ServiceLink`).

Composition root (the user's process; the service and the sidecar are its children, see api/stack.py). The
demo group's policy is PUT through the API (so the decisions page shows who set it and why), the phased
requests are replayed with each engine step paced to the trace's virtual clock (plans arrive over HTTP in
real time, as they would beside a real server), then the decisions and the plan history are read back over
HTTP. Nothing here decides: the service's controller does, the agent applies.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tierplan.api import demo_loop as d
from tierplan.api.stack import service_stack

AGENT_ID = "demo-agent"
SERVICE_ARGS = ("--plan-interval-s", "0.05")
SIDECAR_ARGS = ("--flush-s", "0.02", "--poll-s", "0.05")


@dataclass
class ServiceRun:
    result: d.LoopResult
    url: str
    decisions: list[dict[str, Any]]  # DecisionRecords, oldest first
    plans: list[dict[str, Any]]  # PlanRecords, oldest first
    policy: dict[str, Any]  # the group's current PolicyRecord
    link: dict[str, Any]  # ServiceLink.stats() at the end
    sidecar_log: str = field(default="")


def _paced(step_s: float) -> Any:
    """A step hook that keeps wall time at least the trace's virtual time (one `step_s` per engine step)."""
    start = time.monotonic()
    steps = {"n": 0}

    def pace() -> None:
        steps["n"] += 1
        ahead_s = start + steps["n"] * step_s - time.monotonic()
        if ahead_s > 0:
            time.sleep(ahead_s)

    return pace


def _put_policy(client: httpx.Client, token: str, calibrate: bool) -> None:
    knobs = d.demo_knobs(calibrate).model_dump(mode="json")
    why = "demo: at least top_k slots per MoE layer; plans priced over 4 windows"
    r = client.put(f"/v1/policies/{d.DEMO_GROUP}", json={"knobs": knobs, "why": why},
                   headers={"Authorization": f"Bearer {token}"})
    r.raise_for_status()


def replay_through_sidecar(socket_path: str, workdir: Path, agent_id: str, num_requests: int = d.NUM_REQUESTS,
                           calibrate: bool = True, group: str = "default",
                           pace_s: float = d.VIRTUAL_STEP_S) -> tuple[d.LoopResult, dict[str, Any]]:
    """The phased workload with the sidecar at `socket_path` as the closed loop's plan source (engine -> agent
    -> unix socket -> sidecar -> HTTP -> service, and plans back), each step paced to `pace_s` of wall time and
    each window stamped with wall-clock time (as the service's decisions are); the run's result and the link's
    stats once everything queued was sent (`drained`)."""
    from tierplan.agent.service_link import ServiceLink

    links: list[Any] = []

    def source(engine: Any, budget: int, kv_floor: int) -> Any:
        reg = d.engine_registration(engine, budget, kv_floor, agent_id, group, registered_s=time.time())
        links.append(ServiceLink(socket_path, reg))
        return links[-1]

    try:
        result = d.run_loop_job(workdir, True, num_requests, calibrate, source=source, pace=_paced(pace_s),
                                clock=time.time)
        drained = links[0].drain(timeout_s=30)
        return result, {**links[0].stats(), "drained": drained}
    finally:
        for link in links:
            link.close()


def run_service_job(workdir: Path, num_requests: int = d.NUM_REQUESTS, calibrate: bool = True,
                    keep: Any = None) -> ServiceRun:
    """The controller run through the service. `keep(url)`, when given, is called with the service still up
    (the demo's `--serve` waits there until the user stops it)."""
    token = "tp_demo_" + secrets.token_hex(16)
    workdir.mkdir(parents=True, exist_ok=True)
    stack = service_stack(workdir, token, service_args=SERVICE_ARGS, sidecar_args=SIDECAR_ARGS)
    with stack as (svc, car), httpx.Client(base_url=svc.url, timeout=10.0) as client:
        _put_policy(client, token, calibrate)
        result, stats = replay_through_sidecar(car.socket_path, workdir / "engine", AGENT_ID, num_requests,
                                               calibrate, group=d.DEMO_GROUP)
        _wait_settled(client)
        decisions = client.get("/v1/decisions", params={"agent_id": AGENT_ID, "limit": 1000}).json()[::-1]
        plans = client.get(f"/v1/agents/{AGENT_ID}/plans", params={"limit": 1000}).json()[::-1]
        policy = client.get(f"/v1/policies/{d.DEMO_GROUP}").json()
        if keep is not None:
            keep(svc.url)
    return ServiceRun(result, svc.url, decisions, plans, policy, stats, car.proc.log_tail(1500))


def _wait_settled(client: httpx.Client, timeout_s: float = 10.0) -> None:
    """Until the service has stored every window the agent sent and the planner has had a turn at them."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        r = client.get(f"/v1/agents/{AGENT_ID}")
        windows = r.json().get("windows", 0) if r.status_code == 200 else 0
        if windows == last:
            return
        last = windows
        time.sleep(0.3)
