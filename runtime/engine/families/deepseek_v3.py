"""DeepSeek-V3 checkpoints (inference process, load time): config keys, tensor names, V3's router.

The attention and the layer layout are DeepSeek-V2's (MLA with `q_lora_rank`, yarn rope, shared experts,
`first_k_dense_replace` dense layers first), so the shape parser reads the config as V2's; what differs is the
router (transformers' `DeepseekV3TopkRouter`, "noaux_tc"): sigmoid scores, experts chosen on score plus the
per-expert `e_score_correction_bias` within the `topk_group` best of `n_group` groups (a group scores the sum
of its two best), weights the unbiased scores, renormalized if `norm_topk_prob`, times `routed_scaling_factor`.
Rope rows are permuted from interleaved to rotate-half order on load only when `rope_interleave` is true (the
default), as transformers applies them. Multi-token-prediction layers (`num_nextn_predict_layers`, tensors
after the last layer) are not run by transformers' greedy decoding, nor here. Never reads tensors itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierplan.runtime.engine.families import deepseek_v2 as v2
from tierplan.runtime.engine.families.base import (
    COMMON_IMPLEMENTED,
    COMMON_INERT,
    COMMON_REFUSED,
    Family,
    fail,
    mlp_names,
    swiglu_expert_names,
)


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(cfg: Mapping[str, Any], source: str) -> dict[str, Any]:
    # Keys transformers' V3 does not read but DeepSeek's own configs carry: accepted where both agree.
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1)):
        if cfg.get(key, want) != want:
            raise fail(source, key, f"{want!r} (what transformers' DeepSeek-V3 always does)", cfg[key])
    n, k, e = cfg.get("n_group"), cfg.get("topk_group"), cfg.get("n_routed_experts")
    if not all(_int(v) and v >= 1 for v in (n, k, e)) or e % n or e // n < 2 or k > n:
        raise fail(source, "n_group/topk_group", "ints >= 1 with n_group dividing n_routed_experts into groups "
                   "of >= 2 experts (a group scores its two best) and topk_group <= n_group", (n, k))
    if cfg.get("n_shared_experts") is None:
        raise fail(source, "n_shared_experts", "an int >= 1 (transformers always builds the shared experts)", None)
    if not isinstance(cfg.get("rope_interleave", True), bool):
        raise fail(source, "rope_interleave", "true or false", cfg["rope_interleave"])
    norm = cfg.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise fail(source, "norm_topk_prob", "true or false", norm)
    mtp = cfg.get("num_nextn_predict_layers", 0)
    if not _int(mtp) or mtp < 0:
        raise fail(source, "num_nextn_predict_layers", "an int >= 0", mtp)
    return {"rope_scaling": v2._rope(cfg, source), "num_expert_groups": n, "topk_groups": k,
            "router_scoring": "sigmoid", "norm_topk_prob": norm}


def _normalize(cfg: dict[str, Any]) -> dict[str, Any]:
    """What the V2 shape parser reads: the layout is V2's; routing comes in through the spec changes."""
    return {**cfg, "model_type": "deepseek_v2", "topk_method": "greedy", "scoring_func": "softmax",
            "norm_topk_prob": False, "moe_layer_freq": 1}


FAMILY = Family(
    model_type="deepseek_v3",
    implemented=COMMON_IMPLEMENTED | {
        "intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
        "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "attention_bias", "rope_interleave",
        "num_nextn_predict_layers", "num_mtp_layers", "topk_method", "scoring_func", "moe_layer_freq"},
    # head_dim and qk_head_dim are derived by transformers from the qk dims; the rest act only in training
    inert=COMMON_INERT | {"head_dim", "qk_head_dim", "aux_loss_alpha", "seq_aux", "ep_size"},
    refused=COMMON_REFUSED | {"mlp_bias"},
    check=_check,
    layer_names=mlp_names("mlp", "gate", shared="shared_experts"),
    expert_names=swiglu_expert_names,
    fix_tensor=v2._fix,
    fix_when=lambda cfg: bool(cfg.get("rope_interleave", True)),
    router_bias=True,
    skipped_layers=lambda cfg: int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0),
    bias_projections=("q_a_proj", "kv_a_proj_with_mqa", "o_proj"),
    router_fp32=True,
    normalize=_normalize,
)
