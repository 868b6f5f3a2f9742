"""A development stand-in for the service's read API: the GET endpoints the decisions page reads, answering
records built from controller/protocol_service.py models (so their JSON is exactly what the service sends).

Test code only, used while the real service (api/app.py `create_app`) is built, and to show the page's empty
state and many-layer grouping. It must never be used outside tests; it keeps its records in a dict it is given.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from tierplan.api.routes.ui import mount_ui
from tierplan.controller.protocol import (
    AckStatus,
    Footprint,
    KVStats,
    Plan,
    PlanAck,
    Stall,
    StallCause,
    StepTimings,
    Telemetry,
    Tier,
)
from tierplan.controller.protocol_service import (
    AgentState,
    AgentStatus,
    DecisionOutcome,
    DecisionRecord,
    PlanRecord,
    PlanState,
    PolicyKnobs,
    PolicyRecord,
    SplitView,
)

SLOT_BYTES = 12_288
KV_BLOCK_BYTES = 4096
BUDGET_BYTES = 64 * 4096


def sample_records(agent_id: str = "agent-a", num_layers: int = 4, num_decisions: int = 12,
                   t0_s: float = 1_764_000_000.0) -> dict[str, Any]:
    """One agent's decisions (a split that shifts from experts to KV and back), its plans (the last issued,
    one rejected, the rest applied), two policy versions and its telemetry windows (4 per decision)."""
    decisions, plans = [], []
    version = 0
    for i in range(num_decisions):
        kv_blocks = 16 + 4 * (i % 6)
        slots_total = (BUDGET_BYTES - kv_blocks * KV_BLOCK_BYTES) // SLOT_BYTES
        slots = [slots_total // num_layers + (1 if k < slots_total % num_layers else 0) for k in range(num_layers)]
        held = i % 4 == 3
        if not held:
            version += 1
        t_s = t0_s + 2.0 * i
        split = SplitView(expert_slots_per_layer=tuple(slots), expert_bytes=sum(slots) * SLOT_BYTES,
                          kv_blocks_per_tier={Tier.GPU: kv_blocks, Tier.CPU: 64, Tier.NVME: 0},
                          kv_gpu_bytes=kv_blocks * KV_BLOCK_BYTES)
        reason = f"KV demand {kv_blocks} blocks; " + ("kept (hysteresis)" if held else "moved slots to KV") * 3
        decisions.append(DecisionRecord(
            id=i + 1, agent_id=agent_id, created_s=t_s, outcome=DecisionOutcome.HELD if held else
            DecisionOutcome.ISSUED, version=max(version, 1), window=4 * (i + 1), policy_version=1 if i < 6 else 2,
            batch_tokens=8.0 + i, kv_demand_blocks=float(kv_blocks), split=split, predicted_step_ms=2.0 + 0.1 * i,
            measured_step_ms=None if i == num_decisions - 1 else 2.2 + 0.05 * i, reason=reason))
        if held:
            continue
        plan = Plan(plan_id=f"{agent_id}-v{version}", version=version, base_version=version - 1, created_s=t_s,
                    hbm_budget_bytes=BUDGET_BYTES,
                    expert_bytes_per_layer=tuple(s * SLOT_BYTES for s in slots),
                    kv_blocks_per_tier={Tier.GPU: kv_blocks, Tier.CPU: 64, Tier.NVME: 0}, reason=reason)
        plans.append((plan, t_s))
    records = []
    for k, (plan, t_s) in enumerate(plans):
        last = k == len(plans) - 1
        rejected = k == 2
        state = PlanState.ISSUED if last else PlanState.REJECTED if rejected else PlanState.APPLIED
        ack = None if last else PlanAck(
            agent_id=agent_id, rank=0, plan_id=plan.plan_id, version=plan.version,
            status=AckStatus.REJECTED if rejected else AckStatus.APPLIED,
            reason_code="over_budget" if rejected else None, reason="KV blocks busy" if rejected else "",
            applied_s=t_s + 0.5, footprint=Footprint(expert_bytes_per_layer=plan.expert_bytes_per_layer,
                                                     kv_blocks_per_tier=plan.kv_blocks_per_tier,
                                                     total_hbm_bytes=BUDGET_BYTES))
        records.append(PlanRecord(plan=plan, issued_s=t_s, state=state, ack=ack))
    policies = [
        PolicyRecord(group="default", version=2, knobs=PolicyKnobs(hysteresis=0.2, plan_every_windows=4),
                     author="ops", why="fewer plan flips under bursty traffic", created_s=t0_s + 11),
        PolicyRecord(group="default", version=1, knobs=PolicyKnobs(), author="bootstrap", why="initial",
                     created_s=t0_s),
    ]
    windows = [Telemetry(
        agent_id=agent_id, rank=0, window_seq=w, window_start_s=t0_s + 0.5 * w, window_end_s=t0_s + 0.5 * (w + 1),
        model="tiny", num_layers=num_layers, num_experts=8, layers=(),
        kv=KVStats(blocks_per_tier={Tier.GPU: 16}, hits_per_tier={Tier.GPU: 10}, misses_per_tier={Tier.GPU: 1}),
        stalls=(Stall(cause=StallCause.EXPERT_MISS, count=2, total_ms=0.4 + 0.1 * (w % 5)),
                Stall(cause=StallCause.KV_MISS, count=1, total_ms=0.2 * (w % 3))),
        step_timings_ms=StepTimings(num_steps=4, mean=2.5, p50=2.4, p99=3.0), expert_hits=60 + w % 20,
        expert_misses=20 - w % 20, applied_plan_version=max(0, w // 4 - 1)) for w in range(4 * num_decisions)]
    status = AgentStatus(agent_id=agent_id, rank=0, group="default", engine="tierplan-reference", model="tiny",
                         registered_s=t0_s - 5, last_seen_s=t0_s + 2.0 * num_decisions, state=AgentState.ACTIVE,
                         windows=4 * num_decisions, issued_version=version, applied_version=version - 1)
    return {"agents": [status], "decisions": {agent_id: decisions[::-1]}, "plans": {agent_id: records[::-1]},
            "policies": {"default": policies}, "windows": {agent_id: windows}}


def fake_app(records: dict[str, Any], with_windows: bool = False, read_token: str | None = None) -> FastAPI:
    """The page's read endpoints over `records` (as `sample_records` builds them), plus the page itself;
    `with_windows` adds the telemetry read endpoint the contract does not have yet; `read_token` makes every
    /v1 read need `Authorization: Bearer <read_token>` (the service's `read_needs_token`)."""
    app = FastAPI()
    app.state.settings = SimpleNamespace(read_needs_token=read_token is not None)

    @app.middleware("http")
    async def needs_token(request: Request, call_next: Any) -> Any:
        wanted = f"Bearer {read_token}"
        if read_token is not None and request.url.path.startswith("/v1") \
                and request.headers.get("authorization") != wanted:
            return JSONResponse({"detail": "a read token is required"}, status_code=401)
        return await call_next(request)

    def dump(items: list[Any]) -> list[dict[str, Any]]:
        return [m.model_dump(mode="json") for m in items]

    @app.get("/v1/agents")
    def agents() -> list[dict[str, Any]]:
        return dump(records["agents"])

    @app.get("/v1/decisions")
    def decisions(agent_id: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        return dump(records["decisions"].get(agent_id, [])[:limit])

    @app.get("/v1/agents/{agent_id}/plans")
    def plans(agent_id: str, limit: int = 50) -> list[dict[str, Any]]:
        if all(a.agent_id != agent_id for a in records["agents"]):
            raise HTTPException(404, f"no agent {agent_id!r}")
        return dump(records["plans"].get(agent_id, [])[:limit])

    @app.get("/v1/policies/{group}/history")
    def policy_history(group: str, limit: int = 50) -> list[dict[str, Any]]:
        return dump(records["policies"].get(group, [])[:limit])

    if with_windows:  # the read endpoint the page asks the service for (see api/routes/ui.py OPTIONAL_PATHS)
        @app.get("/v1/agents/{agent_id}/windows")
        def windows(agent_id: str, limit: int = 200) -> list[dict[str, Any]]:
            return dump(records["windows"].get(agent_id, [])[-limit:])

    mount_ui(app)
    return app
