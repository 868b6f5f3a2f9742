"""Qwen3-MoE checkpoints (inference process, load time): config keys and tensor names.

Experts: `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`; router `mlp.gate`; per-head q/k norms.
The sliding window applies to every layer when `use_sliding_window` is set (transformers 5); `max_window_layers`
(older configs) is refused while a window is on, because its meaning differs between transformers versions.
Never reads tensors itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierplan.runtime.engine.families.base import (
    COMMON_IMPLEMENTED,
    COMMON_INERT,
    COMMON_REFUSED,
    Family,
    fail,
    mlp_names,
    sliding_window,
    swiglu_expert_names,
)


def _check(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    on = cfg.get("use_sliding_window", False)
    if not isinstance(on, bool):
        raise fail(source, "use_sliding_window", "true or false", on)
    window = sliding_window(cfg, source, enabled=on)
    layers = cfg.get("max_window_layers")
    if window and layers is not None and layers < cfg.get("num_hidden_layers", 0):
        raise fail(source, "max_window_layers", "null or >= num_hidden_layers while use_sliding_window is true "
                   "(a window on only some layers is not supported)", layers)
    return {"sliding_window": window}


FAMILY = Family(
    model_type="qwen3_moe",
    implemented=COMMON_IMPLEMENTED | {
        "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
        "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "attention_bias", "use_sliding_window",
        "sliding_window", "max_window_layers"},
    inert=COMMON_INERT,
    refused=COMMON_REFUSED,
    check=_check,
    layer_names=mlp_names("mlp", "gate"),
    expert_names=swiglu_expert_names,
)
