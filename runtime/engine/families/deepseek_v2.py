"""DeepSeek-V2 checkpoints (inference process, load time): config keys, tensor names, the rope permutation.

MLA with or without compressed queries (`q_lora_rank`, as V2 full and V3's attention), yarn rope, routed
scaling, greedy or group-limited routing, shared experts, a float32 router (transformers keeps `gate.weight`
in float32). Transformers' DeepSeek-V2 stores rope dims interleaved: the rope rows of the query projection
(per head) and of kv_a_proj_with_mqa are permuted on load into the engine's rotate-half order. Keys whose
meaning differs between transformers and DeepSeek's own code (`norm_topk_prob`, `moe_layer_freq`) are
accepted only at the value where both agree. Never reads tensors itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tierplan.runtime.engine.config import ModelSpec
from tierplan.runtime.engine.families.base import (
    COMMON_IMPLEMENTED,
    COMMON_INERT,
    COMMON_REFUSED,
    Family,
    fail,
    mlp_names,
    swiglu_expert_names,
)
from tierplan.runtime.errors import ConfigError

_YARN_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                        "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"})


def _rope(cfg: Mapping[str, Any], source: str) -> tuple[tuple[str, float], ...]:
    """rope_parameters / rope_scaling: the default rope () or yarn's parameters as (key, value) pairs."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise fail(source, key, "an object or null", rope)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "default" and not set(rope) - {"rope_type", "type", "rope_theta"}:
            continue
        extra = sorted(set(rope) - _YARN_KEYS)
        if kind != "yarn" or extra:
            raise ConfigError(f"{source}: field '{key}' must be the default rope or yarn; got rope_type {kind!r}"
                              + (f" with unsupported key(s) {extra}" if extra else ""))
        params = {k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta") and v is not None}
        for k in ("factor", "original_max_position_embeddings"):
            if not isinstance(params.get(k), int | float) or isinstance(params.get(k), bool) or params[k] <= 0:
                raise fail(source, f"{key}.{k}", "a number > 0 (yarn needs it)", params.get(k))
        if "truncate" in params:
            params["truncate"] = float(bool(params["truncate"]))
        return tuple(sorted((k, float(v)) for k, v in params.items()))
    return ()


def _check(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    method = cfg.get("topk_method", "greedy")
    groups = (0, 0)
    if method == "group_limited_greedy":
        n, k = cfg.get("n_group"), cfg.get("topk_group")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (n, k)):
            raise fail(source, "n_group/topk_group", "ints >= 1 with topk_method 'group_limited_greedy'", (n, k))
        groups = (n, k)
    elif method != "greedy":
        raise fail(source, "topk_method", "'greedy' or 'group_limited_greedy' (V3's 'noaux_tc' is not supported)",
                   method)
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise fail(source, "scoring_func", "'softmax'", cfg.get("scoring_func"))
    if cfg.get("norm_topk_prob"):
        raise fail(source, "norm_topk_prob", "false (transformers' DeepSeek-V2 ignores it, DeepSeek's code applies "
                   "it: the two disagree)", cfg["norm_topk_prob"])
    if cfg.get("moe_layer_freq", 1) != 1:
        raise fail(source, "moe_layer_freq", "1 (transformers ignores it; DeepSeek's code reads it)",
                   cfg["moe_layer_freq"])
    if cfg.get("n_shared_experts") is None:
        raise fail(source, "n_shared_experts", "an int >= 1 (transformers always builds the shared experts)", None)
    return {"rope_scaling": _rope(cfg, source), "num_expert_groups": groups[0], "topk_groups": groups[1]}


def _normalize(cfg: dict[str, Any]) -> dict[str, Any]:
    """What the shape parser reads: routing groups come in through the spec changes, norm_topk_prob is false."""
    return {**cfg, "topk_method": "greedy", "norm_topk_prob": False}


def _interleaved_to_halves(p: int) -> torch.Tensor:
    """Row order taking rope dims (2i, 2i+1) pairs to (i, i + P/2) pairs."""
    return torch.cat([torch.arange(0, p, 2), torch.arange(1, p, 2)])


def _fix(name: str, t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    p, dn = spec.qk_rope_head_dim, spec.qk_nope_head_dim
    perm = _interleaved_to_halves(p)
    if name.endswith(("attn.q_proj", "attn.q_b_proj")):  # [Hq*(Dn+P), in]: the last P rows of every head
        heads = t.view(spec.num_heads, dn + p, -1)
        return torch.cat([heads[:, :dn], heads[:, dn:][:, perm]], 1).view_as(t)
    if name.endswith(("attn.kv_a_proj_with_mqa", "attn.kv_a_proj_with_mqa.bias")):  # [R+P, ...]: the last P rows
        r = spec.kv_lora_rank
        return torch.cat([t[:r], t[r:][perm]])
    return t


FAMILY = Family(
    model_type="deepseek_v2",
    implemented=COMMON_IMPLEMENTED | {
        "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
        "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "routed_scaling_factor", "topk_method", "n_group", "topk_group", "norm_topk_prob", "attention_bias",
        "scoring_func", "moe_layer_freq"},
    # head_dim and qk_head_dim are derived by transformers from the qk dims; the rest act only in training
    inert=COMMON_INERT | {"head_dim", "qk_head_dim", "aux_loss_alpha", "seq_aux", "ep_size"},
    refused=COMMON_REFUSED | {"mlp_bias"},
    check=_check,
    layer_names=mlp_names("mlp", "gate", shared="shared_experts"),
    expert_names=swiglu_expert_names,
    fix_tensor=_fix,
    bias_projections=("q_a_proj", "kv_a_proj_with_mqa", "o_proj"),
    router_fp32=True,
    normalize=_normalize,
)
