"""OLMoE checkpoints (inference process, load time): config keys and tensor names.

Experts: `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`; router `mlp.gate`; q/k norms over the
whole projection; `clip_qkv` clamps q, k and v after the norms. Never reads tensors itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tierplan.runtime.engine.families.base import (
    COMMON_IMPLEMENTED,
    COMMON_INERT,
    COMMON_REFUSED,
    Family,
    fail,
    mlp_names,
    swiglu_expert_names,
)


def _check(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    clip = cfg.get("clip_qkv")
    if clip is None:
        return {"clip_qkv": 0.0}
    if not isinstance(clip, int | float) or isinstance(clip, bool) or not 0 < clip < math.inf:
        raise fail(source, "clip_qkv", "a finite number > 0 or null", clip)
    return {"clip_qkv": float(clip)}


FAMILY = Family(
    model_type="olmoe",
    implemented=COMMON_IMPLEMENTED | {"head_dim", "intermediate_size", "num_experts", "norm_topk_prob",
                                      "attention_bias", "clip_qkv"},
    inert=COMMON_INERT,
    refused=COMMON_REFUSED,
    check=_check,
    layer_names=mlp_names("mlp", "gate"),
    expert_names=swiglu_expert_names,
)
