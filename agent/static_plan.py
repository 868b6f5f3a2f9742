"""A built-in static plan for the reference engine, until the controller (step 3) computes real ones.

Agent code; runs where the demo or a test builds it (no process boundary: it only fills a `controller.protocol.Plan`).
From a warm-up window of real routing it pins, per MoE layer, the experts activated most often, caps
each layer at an even share of the expert slots (pins leave at least one of them free), ranks the coldest
experts first for eviction, and keeps the KV capacity per tier as configured. The reason string says all
of that, so the choice is visible.
It must never apply anything (the enforcer does) or learn online (that is the controller's job).
"""

from __future__ import annotations

import numpy as np

from tierplan.controller.protocol import ExpertKey, LayerEviction, Plan, Tier
from tierplan.runtime.engine.config import ModelSpec


def static_plan(spec: ModelSpec, routes: np.ndarray, num_slots: int, stride_bytes: int,
                kv_blocks: dict[str, int], kv_block_bytes: int, pin_per_layer: int = 1, base_version: int = 0,
                created_s: float = 0.0) -> Plan:
    """routes: expert ids [T, L_moe, k] of a warm-up window (e.g. the first tokens of the routing trace)."""
    n_moe = len(spec.moe_layers)
    per_layer = max(1, num_slots // n_moe)
    counts = np.stack([np.bincount(routes[:, m].reshape(-1), minlength=spec.num_experts) for m in range(n_moe)])
    pinned, evictions = [], []
    for m, layer in enumerate(spec.moe_layers):
        hot = np.argsort(-counts[m], kind="stable")
        # A pin per slot would leave none to compute the layer's other experts through (the enforcer refuses it).
        num_pins = min(pin_per_layer, per_layer if per_layer >= spec.num_experts else per_layer - 1)
        pinned += [ExpertKey(layer=layer, expert=int(e)) for e in hot[:num_pins]]
        evictions.append(LayerEviction(layer=layer, order=tuple(int(e) for e in hot[::-1])))  # coldest first
    moe = set(spec.moe_layers)  # one entry per model layer; dense layers hold no experts
    expert_bytes = [per_layer * stride_bytes if layer in moe else 0 for layer in range(spec.num_layers)]
    kv = {Tier(k): v for k, v in kv_blocks.items()}
    return Plan(
        plan_id=f"static-{base_version + 1}", version=base_version + 1, base_version=base_version,
        created_s=created_s, hbm_budget_bytes=sum(expert_bytes) + kv.get(Tier.GPU, 0) * kv_block_bytes,
        expert_bytes_per_layer=tuple(expert_bytes), kv_blocks_per_tier=kv, pinned_experts=tuple(pinned),
        eviction_priority=tuple(evictions),
        reason=(f"static plan from {routes.shape[0]} warm-up tokens: {per_layer} expert slots per MoE layer, "
                f"pin the {pin_per_layer} most activated expert(s) of each layer, evict coldest first; "
                f"KV blocks per tier {dict(kv_blocks)}"),
    )
