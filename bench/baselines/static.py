"""The fixed-split baselines: `resident` (vLLM's default) and `static_lru` (MoE-Infinity's device-memory ratio).

Bench driver code. Each answers one plan for the whole point and no live source: the split is fixed, victims
are chosen by least recently used (the expert provider's own order). It must never move bytes itself.

- resident: every expert in HBM where they fit beside the KV the largest request needs; if they do not fit,
  as many slots as fit (an even share per layer) with LRU streaming; the KV cache takes the rest of the budget.
- static_lru: a fixed share of the budget (75%, MoE-Infinity's `--device-memory-ratio 0.75`: the device memory
  its expert cache may use) for experts, an even share per layer, LRU eviction; the rest is a fixed KV share.
  The share never drops the KV below what the largest request needs (the scheduler could not run it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierplan.bench.baselines.base import (
    PointContext,
    PolicyRun,
    Split,
    clamp_split,
    kv_floor_blocks,
    make_plan,
    split_for,
)
from tierplan.runtime.engine.victims import lru_victim_order

if TYPE_CHECKING:
    from tierplan.runtime.engine.engine import ReferenceEngine

DEVICE_MEMORY_RATIO = 0.75


def expert_room_bytes(ctx: PointContext) -> int:
    """The most bytes experts may take and still leave the KV the largest request needs."""
    return max(0, ctx.hbm_budget_bytes - kv_floor_blocks(ctx) * ctx.kv_block_bytes)


def all_experts_bytes(ctx: PointContext) -> int:
    return ctx.num_moe * ctx.num_experts * ctx.expert_stride_bytes


def fixed_split(ctx: PointContext, engine: ReferenceEngine, expert_bytes: int) -> Split:
    """Even expert slots within `expert_bytes` (at most every expert, at least one a layer) and the rest KV."""
    return clamp_split(ctx, split_for(ctx, min(expert_bytes, all_experts_bytes(ctx), expert_room_bytes(ctx))), engine)


def resident_split(ctx: PointContext, engine: ReferenceEngine) -> Split:
    """Every expert that fits (even per layer), KV the rest: `resident`'s split, `tierplan_rs`'s start, and
    tierplan's where KV first's share would run too few sequences (`tierplan_live.chosen_start`)."""
    return fixed_split(ctx, engine, all_experts_bytes(ctx))


class Resident:
    name = "resident"
    needs_future = False

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        return {}

    def start(self, engine: ReferenceEngine, ctx: PointContext) -> PolicyRun:
        split = resident_split(ctx, engine)
        fit = split.expert_slots == ctx.num_moe * ctx.num_experts
        why = ("every expert resident" if fit else f"{split.expert_slots} of {ctx.num_moe * ctx.num_experts} experts "
               "fit (even per layer, LRU streaming)") + f"; KV gets the rest: {split.kv_gpu_blocks} GPU blocks"
        return PolicyRun(make_plan(ctx, split, self.name, why), victim_order=lru_victim_order, split=split,
                         notes="" if fit else "experts do not all fit: the rest stream through LRU slots")


class StaticLRU:
    name = "static_lru"
    needs_future = False

    def __init__(self, device_memory_ratio: float = DEVICE_MEMORY_RATIO) -> None:
        if not 0.0 < device_memory_ratio < 1.0:
            raise ValueError(f"device_memory_ratio must be in (0, 1), got {device_memory_ratio}")
        self.ratio = device_memory_ratio

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        return {}

    def start(self, engine: ReferenceEngine, ctx: PointContext) -> PolicyRun:
        split = fixed_split(ctx, engine, int(self.ratio * ctx.hbm_budget_bytes))
        why = (f"{self.ratio:.0%} of the budget for the expert cache: {split.expert_slots} slots (even per layer), "
               f"LRU eviction; fixed KV share {split.kv_gpu_blocks} GPU blocks")
        return PolicyRun(make_plan(ctx, split, self.name, why), victim_order=lru_victim_order, split=split,
                         notes=f"expert cache {self.ratio:.0%} of the HBM budget (capped at all experts / KV floor)")
