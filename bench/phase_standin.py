"""TEMPORARY stand-in for bench/baselines/base.py (the baselines helper's interface) until it lands: the same
names, one trivial policy (`resident`). Deleted once the real module is merged."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierplan.controller.protocol import Plan, Tier


@dataclass(frozen=True)
class PointContext:
    model: str
    layers: int
    batch: int
    context_tokens: int
    hbm_budget_bytes: int
    block_tokens: int
    kv_block_bytes: int
    expert_stride_bytes: int
    moe_layers: tuple[int, ...]
    num_experts: int
    kv_cpu_blocks: int
    kv_nvme_blocks: int
    link_bytes_per_s: float
    requests: tuple[Any, ...]
    future: Any = None


@dataclass
class PolicyRun:
    initial_plan: Plan
    source: Any = None
    window_steps: int = 8
    victim_order: Any = None
    on_step: Callable[[Any, float], None] | None = None
    notes: str = ""


class Resident:
    name = "resident"
    needs_future = False

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        return {}

    def start(self, engine: Any, ctx: PointContext) -> PolicyRun:
        n_layers = engine.spec.num_layers
        slots = min(len(ctx.moe_layers) * ctx.num_experts, ctx.hbm_budget_bytes // ctx.expert_stride_bytes)
        per = slots // len(ctx.moe_layers)
        kv = (ctx.hbm_budget_bytes - per * len(ctx.moe_layers) * ctx.expert_stride_bytes) // ctx.kv_block_bytes
        per_layer = [per * ctx.expert_stride_bytes if i in ctx.moe_layers else 0 for i in range(n_layers)]
        plan = Plan(plan_id="resident-0", version=1, base_version=0, created_s=0.0,
                    hbm_budget_bytes=ctx.hbm_budget_bytes, expert_bytes_per_layer=tuple(per_layer),
                    kv_blocks_per_tier={Tier.GPU: max(1, kv)}, reason="stand-in")
        return PolicyRun(plan)


BASELINES: tuple[str, ...] = ("resident",)


def make(name: str) -> Resident:
    if name not in BASELINES:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(BASELINES)}")
    return Resident()
