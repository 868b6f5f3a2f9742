"""Resident (non-expert) weights of the reference MoE engine (inference process).

Embeddings, attention, norms, routers, shared experts, dense MLPs and the LM head stay in device memory;
routed experts live in the expert slot pool and its stores (`runtime.weights`). Synthetic weights are
deterministic in (seed, name), drawn at the model's true shapes; a local safetensors checkpoint can supply
them instead (HF names). Never decides placement.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from tierplan.runtime.engine.config import AttentionKind, ModelSpec
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.weights.format import TENSOR_ALIGN_BYTES, ExpertFormat, dtype_from_name


def _seeded(name: str, seed: int) -> torch.Generator:
    h = int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little")
    return torch.Generator().manual_seed(h & ((1 << 63) - 1))


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_attn_norm: torch.Tensor  # [H]
    attn: dict[str, torch.Tensor]
    router: torch.Tensor | None = None  # [E, H] on MoE layers
    shared: dict[str, torch.Tensor] | None = None  # gate/up [S, H], down [H, S]
    dense: dict[str, torch.Tensor] | None = None  # gate/up [D, H], down [H, D] on dense layers
    router_bias: torch.Tensor | None = None  # [E] float32: DeepSeek-V3's e_score_correction_bias (None = zeros)


@dataclass
class DenseWeights:
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    layers: list[LayerWeights] = field(default_factory=list)


def expert_format(spec: ModelSpec) -> ExpertFormat:
    """Routed experts as packed records: gate and up [I, H] back to back (one [2I, H] GEMM), down [H, I]."""
    if not spec.moe_layers:
        raise ConfigError(f"ModelSpec {spec.name!r}: no MoE layer (moe_layers is empty); the engine needs at least one")
    gate_bytes = spec.expert_intermediate * spec.hidden_size * spec.dtype_bytes
    if gate_bytes % TENSOR_ALIGN_BYTES:  # up_proj starts at the next aligned offset: it would not follow gate_proj
        raise ConfigError(f"ModelSpec {spec.name!r}: hidden_size={spec.hidden_size} x expert_intermediate="
                          f"{spec.expert_intermediate} x {spec.dtype_bytes} bytes = {gate_bytes} bytes per gate "
                          f"projection; the expert record packs gate and up back to back, so this must be a "
                          f"multiple of {TENSOR_ALIGN_BYTES} bytes (e.g. hidden_size a multiple of 128)")
    return ExpertFormat.swiglu(spec.hidden_size, spec.expert_intermediate, spec.dtype)


def _attn_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h = spec.hidden_size
    if spec.attention is AttentionKind.GQA:
        s = {
            "q_proj": (spec.num_heads * spec.head_dim, h),
            "k_proj": (spec.num_kv_heads * spec.head_dim, h),
            "v_proj": (spec.num_kv_heads * spec.head_dim, h),
            "o_proj": (h, spec.num_heads * spec.head_dim),
        }
        if spec.qk_norm and spec.qk_norm_per_head:  # Qwen3: one RMSNorm over each head
            s |= {"q_norm": (spec.head_dim,), "k_norm": (spec.head_dim,)}
        elif spec.qk_norm:  # OLMoE: one RMSNorm over the whole q (and k) projection
            s |= {"q_norm": (spec.num_heads * spec.head_dim,), "k_norm": (spec.num_kv_heads * spec.head_dim,)}
        return s
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    q = {"q_proj": (spec.num_heads * qk, h)} if not spec.q_lora_rank else {  # V2 full / V3: compressed queries
        "q_a_proj": (spec.q_lora_rank, h), "q_a_layernorm": (spec.q_lora_rank,),
        "q_b_proj": (spec.num_heads * qk, spec.q_lora_rank)}
    return {
        **q,
        "kv_a_proj_with_mqa": (spec.kv_lora_rank + spec.qk_rope_head_dim, h),
        "kv_a_layernorm": (spec.kv_lora_rank,),
        "kv_b_proj": (spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
        "o_proj": (h, spec.num_heads * spec.v_head_dim),
    }


def synthetic_dense_weights(spec: ModelSpec, device: torch.device, seed: int = 0) -> DenseWeights:
    """Random weights at the true shapes: N(0, 0.02) matrices, unit norms; deterministic per (seed, name)."""
    dt = dtype_from_name(spec.dtype)

    def mat(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:  # norm weights
            return torch.ones(shape, dtype=dt, device=device)
        if device.type == "meta":  # shapes only (`dense_weights_for` checks a lent set)
            return torch.empty(shape, dtype=dt, device=device)
        return (torch.randn(shape, generator=_seeded(name, seed)) * 0.02).to(dt).to(device)

    h, v = spec.hidden_size, spec.vocab_size
    w = DenseWeights(mat("embed", (v, h)), mat("final_norm", (h,)), mat("lm_head", (v, h)))
    moe = set(spec.moe_layers)
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        lw = LayerWeights(mat(p + "input_norm", (h,)), mat(p + "post_attn_norm", (h,)),
                          {k: mat(p + k, s) for k, s in _attn_shapes(spec).items()})
        if i in moe:
            lw.router = mat(p + "router", (spec.num_experts, h))
            if spec.num_shared_experts:
                s = spec.shared_intermediate
                lw.shared = {"gate_proj": mat(p + "shared.gate", (s, h)), "up_proj": mat(p + "shared.up", (s, h)),
                             "down_proj": mat(p + "shared.down", (h, s))}
        else:
            d = spec.dense_intermediate
            lw.dense = {"gate_proj": mat(p + "mlp.gate", (d, h)), "up_proj": mat(p + "mlp.up", (d, h)),
                        "down_proj": mat(p + "mlp.down", (h, d))}
        w.layers.append(lw)
    return w


def _named(w: DenseWeights) -> dict[str, torch.Tensor]:
    """Every tensor of `w` by a dotted name."""
    out = {"embed": w.embed, "final_norm": w.final_norm, "lm_head": w.lm_head}
    for i, lw in enumerate(w.layers):
        p = f"layers.{i}."
        out |= {p + "input_norm": lw.input_norm, p + "post_attn_norm": lw.post_attn_norm}
        out |= {p + "router": lw.router, p + "router_bias": lw.router_bias}
        for group in ("attn", "shared", "dense"):
            out |= {f"{p}{group}.{k}": v for k, v in (getattr(lw, group) or {}).items()}
    return {k: v for k, v in out.items() if v is not None}


def dense_weights_for(spec: ModelSpec, device: torch.device, seed: int, borrowed: DenseWeights | None = None,
                      checkpoint: DenseWeights | None = None) -> DenseWeights:
    """An engine's dense weights: a checkpoint's, else the synthetic ones of `spec`, or `borrowed` (built once by
    `synthetic_dense_weights` and shared by several engines, as a bench shares its pinned expert store: drawing
    them costs seconds a model, and no engine writes them). ConfigError for borrowed weights beside a checkpoint,
    or naming the first tensor of `borrowed` whose shape, dtype or device is not this spec's on `device`."""
    if checkpoint is not None:
        if borrowed is not None:
            raise ConfigError("dense_weights: a checkpoint brings its own dense weights; borrow none with it")
        return checkpoint
    if borrowed is None:
        return synthetic_dense_weights(spec, device, seed=seed)
    want, got = _named(synthetic_dense_weights(spec, torch.device("meta"))), _named(borrowed)
    if set(want) != set(got):
        raise ConfigError(f"dense_weights: tensors {sorted(set(want) ^ set(got))[:4]} differ from what model "
                          f"{spec.name!r} has")
    for name, t in want.items():
        g = got[name]
        if g.shape != t.shape or g.dtype != t.dtype or g.device.type != device.type:
            raise ConfigError(f"dense_weights: {name} is {tuple(g.shape)} {g.dtype} on {g.device}, model "
                              f"{spec.name!r} wants {tuple(t.shape)} {t.dtype} on {device.type}")
    return borrowed
