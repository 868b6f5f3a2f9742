"""Messages the storage tests store: the tiny model's registration (the numbers of tests/controller/loop_fixtures),
real telemetry windows from its `Windows` builder, plans, acks and decisions made in the test."""

from __future__ import annotations

from typing import Any

from tests.controller.loop_fixtures import BLOCK_BYTES, BUDGET_BYTES, KV_MAX, KV_MIN, SLOT_BYTES, Windows
from tierplan.controller.model_shape import builtin_shape
from tierplan.controller.protocol import AckStatus, Footprint, Link, Plan, PlanAck, Telemetry, Tier
from tierplan.controller.protocol_service import (
    AgentRegistration,
    DecisionOutcome,
    DecisionRecord,
    HardwareSheet,
    ShapeSpec,
    SplitSheet,
    SplitView,
)


def registration(agent_id: str = "agent-0", group: str = "default", registered_s: float = 1.0,
                 **split_over: Any) -> AgentRegistration:
    shape = builtin_shape("tiny")
    split = dict(hbm_budget_bytes=BUDGET_BYTES, dense_bytes=0, workspace_bytes=0, slot_bytes=SLOT_BYTES,
                 kv_block_bytes=BLOCK_BYTES, kv_gpu_blocks_max=KV_MAX, kv_gpu_blocks_min=KV_MIN,
                 kv_cpu_blocks=128, kv_nvme_blocks=128) | split_over
    return AgentRegistration(
        agent_id=agent_id, group=group, engine="tierplan-reference", registered_s=registered_s,
        shape=ShapeSpec(name=shape.name, num_layers=shape.num_layers, moe_layers=shape.moe_layers,
                        num_experts=shape.num_experts, top_k=shape.top_k, expert_bytes=shape.expert_bytes,
                        dense_bytes=shape.dense_bytes, kv_bytes_per_token=shape.kv_bytes_per_token),
        hardware=HardwareSheet(link_bytes_per_s=dict.fromkeys(Link, 2e9), transfer_overhead_s=2e-4,
                               hbm_bytes=BUDGET_BYTES),
        split=SplitSheet(**split))


def windows(n: int, agent_id: str = "agent-0", seed: int = 0, first_seq: int = 0) -> list[Telemetry]:
    """`n` consecutive real windows of the tiny model (loop_fixtures.Windows), for `agent_id`."""
    source = Windows(seed=seed)
    source.seq = first_seq
    return [source.next(batch=4, kv_live=20, queued=1, agent_id=agent_id) for _ in range(n)]


def plan(version: int, slots: int = 4, reason: str = "test plan") -> Plan:
    return Plan(plan_id=f"p-{version}", version=version, base_version=version - 1, created_s=float(version),
                hbm_budget_bytes=BUDGET_BYTES, expert_bytes_per_layer=(slots * SLOT_BYTES, slots * SLOT_BYTES),
                kv_blocks_per_tier={Tier.GPU: KV_MIN, Tier.CPU: 128}, reason=reason)


def ack(p: Plan, agent_id: str = "agent-0", status: AckStatus = AckStatus.APPLIED) -> PlanAck:
    fp = Footprint(expert_bytes_per_layer=p.expert_bytes_per_layer, kv_blocks_per_tier={Tier.GPU: KV_MIN},
                   total_hbm_bytes=sum(p.expert_bytes_per_layer) + KV_MIN * BLOCK_BYTES)
    extra: dict[str, Any] = {} if status is AckStatus.APPLIED else {"reason_code": "over_budget",
                                                                    "reason": "test refusal"}
    return PlanAck(agent_id=agent_id, rank=0, plan_id=p.plan_id, version=p.version, status=status, applied_s=2.0,
                   footprint=fp, **extra)


def decision(version: int, created_s: float, agent_id: str = "agent-0",
             outcome: DecisionOutcome = DecisionOutcome.ISSUED) -> DecisionRecord:
    return DecisionRecord(
        id=0, agent_id=agent_id, created_s=created_s, outcome=outcome, version=version, window=version * 3,
        policy_version=0, batch_tokens=4.0, kv_demand_blocks=12.5,
        split=SplitView(expert_slots_per_layer=(4, 4), expert_bytes=8 * SLOT_BYTES,
                        kv_blocks_per_tier={Tier.GPU: KV_MIN}, kv_gpu_bytes=KV_MIN * BLOCK_BYTES),
        predicted_step_ms=3.5, reason=f"decision for v{version}")
