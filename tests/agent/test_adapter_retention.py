"""The reference engine's agent and a plan's KV retention order: its KV blocks carry no prefix hash, so the
order cannot be followed; the plan is still applied, and the ack and the next window say what was not done."""

from __future__ import annotations

from pathlib import Path

from tests.agent import flame_trace, tiny_engine
from tierplan.agent.adapters.reference import ReferenceAdapter
from tierplan.agent.static_plan import static_plan
from tierplan.controller.protocol import AckStatus


def test_a_retention_order_it_cannot_follow_is_acked_and_counted(tmp_path: Path) -> None:
    eng = tiny_engine(tmp_path)
    spec = eng.spec
    try:
        agent = ReferenceAdapter(eng, window_steps=4)
        warm, _ = flame_trace().routes(256, len(spec.moe_layers), spec.top_k, spec.num_experts)
        base = static_plan(spec, warm, eng.pool.num_slots, eng.pool.layout.stride_bytes,
                           {"gpu": 8, "cpu": 8, "nvme": 16}, eng.cache.block_bytes, pin_per_layer=1)
        plain = agent.apply(base)
        assert plain.status is AckStatus.APPLIED and "retention" not in plain.reason
        assert "plan_kv_retention_unsupported" not in agent._fallbacks()
        plan = base.model_copy(update={"plan_id": "with-retention", "version": 2, "base_version": 1,
                                       "kv_retention": ("9f3a", "0c11")})
        ack = agent.apply(plan)
        assert ack.status is AckStatus.APPLIED and agent.enforcer.applied_version == 2
        assert "KV retention of 2 prefixes not applied" in ack.reason
        assert agent.kv_retention_unsupported == 1
        last = agent.flush()
        agent.close()
    finally:
        eng.close()
    assert last.fallbacks["plan_kv_retention_unsupported"] == 1
