"""Messages made in the test and a fake controller service (httpx.MockTransport) for the sidecar tests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from tierplan.controller.protocol import Footprint, KVStats, Link, Plan, PlanAck, StepTimings, Telemetry, Tier
from tierplan.controller.protocol_service import AgentRegistration, HardwareSheet, ShapeSpec, SplitSheet

AGENT = "agent-t"


def telemetry(seq: int, agent_id: str = AGENT, applied: int = 0) -> Telemetry:
    zero = dict.fromkeys(Tier, 0)
    return Telemetry(agent_id=agent_id, rank=0, window_seq=seq, window_start_s=float(seq), window_end_s=seq + 1.0,
                     model="tiny", num_layers=2, num_experts=4, layers=(),
                     kv=KVStats(blocks_per_tier=zero, hits_per_tier=zero, misses_per_tier=zero),
                     step_timings_ms=StepTimings(num_steps=4, mean=1.0, p50=1.0, p99=2.0), expert_hits=0,
                     expert_misses=0, applied_plan_version=applied)


def registration(agent_id: str = AGENT) -> AgentRegistration:
    return AgentRegistration(
        agent_id=agent_id, engine="tierplan-reference", registered_s=0.0,
        shape=ShapeSpec(name="tiny", num_layers=2, moe_layers=(0, 1), num_experts=4, top_k=2, expert_bytes=4096,
                        dense_bytes=0, kv_bytes_per_token=256, block_tokens=16),
        hardware=HardwareSheet(name="cpu twin", link_bytes_per_s=dict.fromkeys(Link, 2e9), transfer_overhead_s=2e-4,
                               hbm_bytes=1 << 20),
        split=SplitSheet(hbm_budget_bytes=1 << 20, dense_bytes=0, workspace_bytes=0, slot_bytes=4096,
                         kv_block_bytes=4096, kv_gpu_blocks_max=64, kv_gpu_blocks_min=1, kv_block_tokens=16,
                         kv_cpu_blocks=0, kv_nvme_blocks=0))


def plan(version: int) -> Plan:
    return Plan(plan_id=f"p{version}", version=version, base_version=version - 1, created_s=0.0,
                hbm_budget_bytes=1 << 20, expert_bytes_per_layer=(8192, 8192), kv_blocks_per_tier={Tier.GPU: 8},
                reason=f"test plan {version}")


def ack(version: int, agent_id: str = AGENT) -> PlanAck:
    return PlanAck(agent_id=agent_id, rank=0, plan_id=f"p{version}", version=version, status="applied",
                   applied_s=0.0, footprint=Footprint(expert_bytes_per_layer=(0, 0), kv_blocks_per_tier={},
                                                      total_hbm_bytes=0))


@dataclass
class FakeService:
    """The contract's endpoints, in memory. `down`: every request fails to connect. `reject`: window_seq ->
    rejection code. `refuse_status`: status answered to POST /v1/telemetry instead of storing."""

    down: bool = False
    read_timeout: bool = False  # the request reaches the service, the answer is lost
    reject: dict[int, str] = field(default_factory=dict)
    refuse_status: int | None = None
    forgot: bool = False  # every window is unknown_agent until the next registration (a fresh database)
    windows: list[dict[str, Any]] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    registrations: int = 0
    acks: list[dict[str, Any]] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # "METHOD path" of every answered request, in order
    polls: list[tuple[str | None, str | None]] = field(default_factory=list)  # (since_version, If-None-Match)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path, method = request.url.path, request.method
        if method == "POST" and path == "/v1/telemetry":
            body = json.loads(request.content)
            if self.refuse_status is not None:
                self.requests.append(f"{method} {path}")
                return httpx.Response(self.refuse_status, json={"detail": "refused by the test"})
            rejected, stored = [], {w["window_seq"] for w in self.windows}
            for i, w in enumerate(body["windows"]):
                code = ("unknown_agent" if self.forgot else self.reject.get(w["window_seq"])
                        or ("seq_not_increasing" if w["window_seq"] in stored else None))
                if code:
                    rejected.append({"index": i, "agent_id": w["agent_id"], "window_seq": w["window_seq"],
                                     "code": code, "message": "test"})
                else:
                    self.windows.append(w)
            self.batches.append(len(body["windows"]))
            if self.read_timeout:
                raise httpx.ReadTimeout("the answer was lost", request=request)
            self.requests.append(f"{method} {path}")
            return httpx.Response(200, json={"accepted": len(body["windows"]) - len(rejected),
                                             "rejected": rejected})
        self.requests.append(f"{method} {path}")
        if method == "POST" and path == "/v1/agents":
            self.registrations += 1
            self.forgot = False
            return httpx.Response(201, json={"agent_id": AGENT, "rank": 0, "group": "default",
                                             "engine": "tierplan-reference", "model": "tiny", "registered_s": 0.0,
                                             "last_seen_s": None, "state": "new", "windows": 0,
                                             "issued_version": 0, "applied_version": 0})
        if method == "POST" and path == "/v1/acks":
            body = json.loads(request.content)
            self.acks.append(body)
            return httpx.Response(200, json={"plan": self.plans[-1].model_dump(mode="json"), "issued_s": 0.0,
                                             "state": "applied", "ack": body})
        if method == "GET" and path.endswith("/plan"):
            since, etag = request.url.params.get("since_version"), request.headers.get("If-None-Match")
            self.polls.append((since, etag))
            if not self.plans:
                return httpx.Response(204)
            newest = self.plans[-1]
            if etag == f'"v{newest.version}"' or int(since or 0) >= newest.version:
                return httpx.Response(304)
            return httpx.Response(200, json={"plan": newest.model_dump(mode="json"), "issued_s": 0.0,
                                             "state": "issued"}, headers={"ETag": f'"v{newest.version}"'})
        return httpx.Response(404, json={"detail": f"no route {method} {path}"})


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class TopRng:
    """A random.Random stand-in whose uniform(a, b) is b: the backoff's ceiling, so a schedule is exact."""

    def uniform(self, a: float, b: float) -> float:
        return b


def wait_until(pred: Any, what: str, limit_s: float = 30.0) -> None:
    """Poll `pred` until true. The limit only keeps a broken run from hanging; no test asserts on time."""
    import time

    deadline = time.monotonic() + limit_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


def balanced_link(st: dict[str, Any]) -> bool:
    """ServiceLink.stats(): every window produced is sent, dropped, queued or in flight; acks alike."""
    return (st["produced"] == st["sent"] + sum(st["dropped"].values()) + st["queued"] + st["in_flight"]
            and st["acks_produced"] == st["acks_sent"] + sum(st["acks_dropped"].values()) + st["acks_queued"]
            + st["acks_in_flight"])
