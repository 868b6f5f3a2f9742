"""Mixtral checkpoints (inference process, load time): config keys and tensor names.

Experts: `model.layers.{i}.block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down); router
`block_sparse_moe.gate`; no q/k norm, no attention bias. `router_jitter_noise` only acts in training.
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
    mlp_names,
    sliding_window,
)


def _check(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    return {"sliding_window": sliding_window(cfg, source)}


def _experts(i: int, e: int) -> tuple[str, str, str]:
    p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
    return p + "w1.weight", p + "w3.weight", p + "w2.weight"


FAMILY = Family(
    model_type="mixtral",
    implemented=COMMON_IMPLEMENTED | {"head_dim", "intermediate_size", "num_local_experts", "sliding_window"},
    inert=COMMON_INERT | {"router_jitter_noise"},
    refused=COMMON_REFUSED,
    check=_check,
    layer_names=mlp_names("block_sparse_moe", "gate"),
    expert_names=_experts,
)
