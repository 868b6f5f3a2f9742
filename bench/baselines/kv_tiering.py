"""`kv_tiering`: experts static, KV over the GPU, CPU and NVMe tiers (LMCache / vLLM OffloadingConnector style).

Bench driver code. A KV-offload deployment keeps the weights where it put them and moves KV instead, so HBM
goes to experts:
- KV: a small GPU share, the least the scheduler can run (the largest request whole, plus one block:
  `kv_floor_blocks`); the sequences that do not fit there are preempted by SWAP, their blocks kept on the CPU
  tier (spilled on to NVMe when the CPU tier is at its limit, both tiers at their full capacity in the plan)
  and fetched back to the GPU before they run again (the KV cache's `ensure_on_gpu`). Only where every expert
  is resident does the GPU share grow: the rest of the budget, which no expert could use.
- Experts: every byte the KV share leaves, as a static placement. Each MoE layer first gets room for the
  experts one decode step of this batch uses at once (`union_room`: the largest per-step union measured on
  batch-sized samples of the routing table's warm-up window, plus one token's top_k for margin, never more
  than top_k x batch or num_experts), so a decode step's experts always fit beside the pins and no layer is
  pushed onto the chunked eager path; the slots left over are spread evenly. Within each layer the hottest
  experts of the warm-up window fill every slot beyond the union room as pins (never evicted, never moved);
  the union room streams the rest through LRU slots.
Against `resident`: where experts all fit, the same split (with every expert pinned); where they do not,
both keep KV at the floor, and kv_tiering differs by its union room per layer and its static pins where
resident's LRU lets cold streamed experts evict hot ones. If the budget cannot give every layer its union
room, no split can: the layers share the slots evenly, nothing is pinned, and the notes say so.
Not modelled: prefix offload or reuse across requests (LMCache's main use): this engine's KV blocks carry no
prefix hash, so no request can read another's KV; KV moves only as swaps and spills of one sequence's blocks.
It must never move bytes itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tierplan.bench.baselines.base import (
    PointContext,
    PolicyRun,
    Split,
    clamp_split,
    kv_floor_blocks,
    make_plan,
    warmup_counts,
)
from tierplan.bench.baselines.static import all_experts_bytes
from tierplan.runtime.engine.victims import lru_victim_order

if TYPE_CHECKING:
    from tierplan.runtime.engine.engine import ReferenceEngine

WARMUP_TOKENS = 1024  # the routing table's warm-up window the union and the pins are measured on
UNION_SAMPLES = 256  # batch-sized row samples drawn from it (seeded: the same room on every run)


def union_room(ids: np.ndarray | None, batch: int, top_k: int, num_experts: int,
               samples: int = UNION_SAMPLES, seed: int = 0) -> tuple[int, ...] | None:
    """Per MoE layer the slots one decode step of `batch` sequences needs at once: the largest union of the
    experts `batch` distinct rows of `ids` [T, L, k] route to (over `samples` seeded draws), plus `top_k`,
    capped at min(num_experts, top_k x batch); None without a table."""
    if ids is None or ids.shape[0] == 0:
        return None
    bound = min(num_experts, top_k * batch)
    rng = np.random.default_rng(seed)
    n = min(batch, ids.shape[0])
    worst = np.zeros(ids.shape[1], dtype=np.int64)
    for _ in range(samples):
        rows = ids[rng.choice(ids.shape[0], n, replace=False)]  # [n, L, k]
        worst = np.maximum(worst, [len(np.unique(rows[:, m])) for m in range(ids.shape[1])])
    return tuple(int(min(bound, u + top_k)) for u in worst)


def union_first_slots(total_slots: int, room: tuple[int, ...], num_experts: int) -> tuple[int, ...] | None:
    """`total_slots` with every layer at its union room first, the rest spread evenly (the first layers take
    the remainder, each layer at most num_experts); None when the rooms alone do not fit."""
    if sum(room) > total_slots:
        return None
    slots, left = list(room), total_slots - sum(room)
    while left > 0:
        open_layers = [m for m in range(len(slots)) if slots[m] < num_experts]
        if not open_layers:
            break
        share, extra = divmod(left, len(open_layers))
        for i, m in enumerate(open_layers):
            add = min(num_experts - slots[m], share + (1 if i < extra else 0))
            slots[m] += add
            left -= add
        if share == 0 and extra == 0:
            break
    return tuple(slots)


def static_pins(counts: np.ndarray | None, slots_per_layer: tuple[int, ...], room: tuple[int, ...],
                num_experts: int) -> list[tuple[int, int]]:
    """Per pool layer its hottest experts by `counts` [L, E] (ties: lower id) in every slot beyond the layer's
    union `room`, or every expert where the layer holds them all; none without counts."""
    if counts is None:
        return []
    pins = []
    for m, slots in enumerate(slots_per_layer):
        n = num_experts if slots >= num_experts else max(0, slots - room[m])
        hot = np.argsort(-counts[m], kind="stable")[:n]
        pins += [(m, int(e)) for e in sorted(hot)]
    return pins


def _table_window(engine: ReferenceEngine) -> np.ndarray | None:
    table = engine.model.forced_routes
    return None if table is None else table.ids_host[:WARMUP_TOKENS]


class KVTiering:
    name = "kv_tiering"
    needs_future = False

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        return {}

    def plan_split(self, ctx: PointContext, engine: ReferenceEngine) -> tuple[Split, tuple[int, ...], str]:
        """(split, union room per layer, what the room is) for this point (module docstring)."""
        kv = kv_floor_blocks(ctx)
        room_bytes = max(0, ctx.hbm_budget_bytes - kv * ctx.kv_block_bytes)
        total = min(room_bytes, all_experts_bytes(ctx)) // ctx.expert_stride_bytes
        measured = union_room(_table_window(engine), ctx.batch, ctx.top_k, ctx.num_experts)
        room = measured or (min(ctx.num_experts, ctx.top_k * ctx.batch),) * ctx.num_moe
        what = "measured on the warm-up window" if measured else "top_k x batch (no routing table)"
        slots = union_first_slots(total, room, ctx.num_experts)
        if slots is None:  # no split gives every layer its union: share evenly, and pin nothing
            base, extra = divmod(max(total, ctx.num_moe), ctx.num_moe)
            slots = tuple(min(ctx.num_experts, base + (1 if m < extra else 0)) for m in range(ctx.num_moe))
            room = slots
            what = f"budget below the union room ({what}): no layer can hold a step's experts beside pins"
        kv_blocks = (ctx.hbm_budget_bytes - sum(slots) * ctx.expert_stride_bytes) // ctx.kv_block_bytes
        split = clamp_split(ctx, Split(slots, kv_blocks), engine)
        return split, tuple(min(r, s) for r, s in zip(room, split.expert_slots_per_layer, strict=True)), what

    def start(self, engine: ReferenceEngine, ctx: PointContext) -> PolicyRun:
        split, room, what = self.plan_split(ctx, engine)
        table = engine.model.forced_routes
        counts = None if table is None else warmup_counts(engine, WARMUP_TOKENS)
        pins = static_pins(counts, split.expert_slots_per_layer, room, ctx.num_experts)
        why = (f"experts static: {split.expert_slots_per_layer} slots per layer, union room {room} ({what}), "
               f"{len(pins)} hottest pinned; KV {split.kv_gpu_blocks} GPU blocks (floor {kv_floor_blocks(ctx)}), "
               f"the rest swapped to CPU {ctx.kv_cpu_blocks} / NVMe {ctx.kv_nvme_blocks} blocks and fetched back")
        notes = ("static pins beyond a per-layer union room; small GPU KV share, sequences swapped to the CPU/NVMe "
                 "tiers and fetched back; no prefix offload (the engine's KV carries no prefix hash)")
        if "budget below" in what:
            notes += "; budget below the union room: nothing pinned"
        return PolicyRun(make_plan(ctx, split, self.name, why, pinned=pins), victim_order=lru_victim_order,
                         split=split, notes=notes)
