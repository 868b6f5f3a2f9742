"""Rotary tables of DeepSeek's MLA: the default rotary embedding or yarn (inference process, every MLA layer).

Yarn (transformers' `_compute_yarn_parameters`): frequencies blended between extrapolation and interpolation
by `factor` over a linear ramp set by beta_fast/beta_slow and original_max_position_embeddings; cos/sin
scaled by the attention factor (mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given);
DeepSeek's softmax scale multiplied by mscale(factor, mscale_all_dim)^2. Tables come in the engine's
rotate-half layout. Pure math on the spec; never reads anything.
"""

from __future__ import annotations

import math

import torch

from tierplan.runtime.engine.config import ModelSpec


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(d: int, theta: float, params: dict[str, float]) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention factor) of a yarn rope over d dims."""
    factor = params["factor"]
    pos_freqs = theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [D/2]
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    orig = params["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(params.get("beta_fast") or 32), dim_of(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]
    keep = 1 - ramp  # share of extrapolation
    attn = params.get("attention_factor")
    if attn is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)
    return inter * (1 - keep) + extra * keep, float(attn)


def mla_rope_tables(positions: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, 1, P] float32 for positions [N] (P = qk_rope_head_dim), rotate-half layout."""
    d = spec.qk_rope_head_dim
    params = dict(spec.rope_scaling)
    if params:
        inv, attn = yarn_inv_freq(d, spec.rope_theta, params)
    else:
        inv, attn = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)), 1.0
    ang = positions.to(torch.float32)[:, None] * inv.to(positions.device)[None, :]  # [N, P/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1) * attn, torch.cat([ang.sin(), ang.sin()], -1) * attn
    return cos[:, None, :], sin[:, None, :]


def mla_softmax_scale(spec: ModelSpec) -> float:
    scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5
    params = dict(spec.rope_scaling)
    if params.get("mscale_all_dim"):
        scale *= _mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale
