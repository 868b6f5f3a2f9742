"""`kv_tiering`: experts static, KV over the GPU, CPU and NVMe tiers (LMCache / vLLM OffloadingConnector style).

Bench driver code. Weights come first, as in a vLLM deployment with KV offload: the most expert slots that fit
beside the KV the largest request needs, an even share per layer, and the placement never changes: each
layer's hottest experts of a warm-up window (the routing table's first tokens, as agent/static_plan.py
reads them) are pinned, leaving one slot a layer to compute the others through when not all fit (no caching).
The GPU KV cache takes the rest of the budget; KV that does not fit there lives on the CPU and NVMe tiers
at their full capacity (preempted sequences swap out, plans spill down). Not modelled: prefix offload and
reuse across requests (this engine's KV blocks carry no prefix hash). It must never move bytes itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tierplan.bench.baselines.base import PointContext, PolicyRun, make_plan, warmup_counts
from tierplan.bench.baselines.static import all_experts_bytes, fixed_split
from tierplan.runtime.engine.victims import lru_victim_order

if TYPE_CHECKING:
    from tierplan.runtime.engine.engine import ReferenceEngine


def static_pins(counts: np.ndarray | None, slots_per_layer: tuple[int, ...], num_experts: int
                ) -> list[tuple[int, int]]:
    """Per pool layer its hottest experts by `counts` [L, E] (ties: lower id), every slot but one unless the
    layer holds all its experts; none without counts."""
    if counts is None:
        return []
    pins = []
    for m, slots in enumerate(slots_per_layer):
        n = slots if slots >= num_experts else slots - 1
        hot = np.argsort(-counts[m], kind="stable")[:n]
        pins += [(m, int(e)) for e in sorted(hot)]
    return pins


class KVTiering:
    name = "kv_tiering"
    needs_future = False

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        return {}

    def start(self, engine: ReferenceEngine, ctx: PointContext) -> PolicyRun:
        split = fixed_split(ctx, engine, all_experts_bytes(ctx))
        pins = static_pins(warmup_counts(engine), split.expert_slots_per_layer, ctx.num_experts)
        why = (f"experts static: {len(pins)} pinned by warm-up frequency in {split.expert_slots} slots; KV "
               f"{split.kv_gpu_blocks} GPU blocks, then CPU {ctx.kv_cpu_blocks} and NVMe {ctx.kv_nvme_blocks}")
        return PolicyRun(make_plan(ctx, split, self.name, why, pinned=pins), victim_order=lru_victim_order,
                         split=split, notes="static pinned experts; KV tiers take swaps/spills (no prefix offload)")
