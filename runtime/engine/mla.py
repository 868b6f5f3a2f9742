"""DeepSeek-V2 multi-head latent attention over the paged KV cache, absorbed form (inference process).

The cache holds, per token and layer, only the compressed latent c_kv [R] and the shared rope key k_pe [P]
(one row [R + P]); per-head keys and values are never materialised. Instead the key up-projection W_UK is
absorbed into the query (q_latent = q_nope @ W_UK) and the value up-projection W_UV is applied after the
softmax (out = (probs @ c_kv) @ W_UV^T), which is what DeepSeek's decode path does and what makes the
small cache pay. This is the torch reference path (CPU, and the correctness oracle on the GPU).
Never moves blocks between tiers: the engine brings them to the GPU tier before the step.

RoPE uses the engine's rotate-half pairing (dims i and i + P/2); HF DeepSeek-V2 pairs interleaved dims
(2i, 2i + 1), so the checkpoint loader (`families/deepseek_v2.py`) permutes the rope rows of the query
projection (per head) and the last P rows of kv_a_proj_with_mqa on load, after which the two are identical.
`rope_scaling` (yarn) changes the rotary frequencies, scales cos/sin by its attention factor and the softmax
scale by mscale(factor, mscale_all_dim)^2, as transformers does (`rope_yarn.py`).

Letters: N rows of the batch, n rows of one segment, C context tokens of that segment, Hq heads,
Dn = qk_nope_head_dim, P = qk_rope_head_dim, R = kv_lora_rank, Dv = v_head_dim, H hidden, T block tokens.
"""

from __future__ import annotations

import torch

from tierplan.runtime.engine.attention import Segment, linear, rms_norm, rope
from tierplan.runtime.engine.config import AttentionKind, ModelSpec
from tierplan.runtime.engine.kv_cache import PagedKVCache
from tierplan.runtime.engine.rope_yarn import mla_rope_tables, mla_softmax_scale
from tierplan.runtime.errors import ConfigError


def split_kv_b(kv_b_proj: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [Hq*(Dn+Dv), R] -> (W_UK [Hq, Dn, R], W_UV [Hq, Dv, R]), views, no copy."""
    nh, dn, dv, r = spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    wkv = kv_b_proj.view(nh, dn + dv, r)  # [Hq, Dn+Dv, R]
    return wkv[:, :dn], wkv[:, dn:]


def mla_project(x: torch.Tensor, w: dict[str, torch.Tensor], positions: torch.Tensor,
                spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] -> (q_nope [N, Hq, Dn], q_pe [N, Hq, P] roped, latent row [N, R+P] = cat(c_kv, roped k_pe))."""
    n = x.shape[0]
    nh, dn, p, r = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    if spec.q_lora_rank:  # compressed queries (V2 full, V3): x -> [N, Rq] -> norm -> [N, Hq*(Dn+P)]
        q = linear(rms_norm(linear(x, w, "q_a_proj"), w["q_a_layernorm"], spec.rms_norm_eps), w, "q_b_proj")
    else:
        q = x @ w["q_proj"].t()
    q = q.view(n, nh, dn + p)  # [N, Hq, Dn+P]
    tables = mla_rope_tables(positions, spec)  # cos, sin [N, 1, P]
    q_nope, q_pe = q[..., :dn], rope(q[..., dn:], positions, spec.rope_theta, tables)  # [N, Hq, Dn], [N, Hq, P]
    kv_a = linear(x, w, "kv_a_proj_with_mqa")  # [N, R+P]
    c_kv = rms_norm(kv_a[:, :r], w["kv_a_layernorm"], spec.rms_norm_eps)  # [N, R]
    k_pe = rope(kv_a[:, r:].view(n, 1, p), positions, spec.rope_theta, tables).view(n, p)  # [N, P]
    return q_nope, q_pe, torch.cat([c_kv, k_pe], -1)  # [N, R+P]


def mla_attention(x: torch.Tensor, w: dict[str, torch.Tensor], positions: torch.Tensor, segments: list[Segment],
                  cache: PagedKVCache, layer: int, spec: ModelSpec) -> torch.Tensor:
    """x [N, H] -> [N, H]; writes the N new latent rows into the cache first (contract of gqa_attention)."""
    if spec.attention is not AttentionKind.MLA:
        raise ConfigError(f"{spec.name}: mla_attention needs attention kind {AttentionKind.MLA.value}, "
                          f"got {spec.attention.value}")
    n = x.shape[0]
    nh, dv, r = spec.num_heads, spec.v_head_dim, spec.kv_lora_rank
    softmax_scale = mla_softmax_scale(spec)  # over the full nope+rope width, times yarn's mscale^2
    q_nope, q_pe, latent = mla_project(x, w, positions, spec)
    w_uk, w_uv = split_kv_b(w["kv_b_proj"], spec)  # [Hq, Dn, R], [Hq, Dv, R]
    w_uk32, w_uv32 = w_uk.float(), w_uv.float()
    # The absorption moves GEMMs around; float32 keeps it within rounding of the decompressed form.
    q_latent = torch.einsum("nhd,hdr->nhr", q_nope.float(), w_uk32)  # [N, Hq, R]
    q_pe32 = q_pe.float()  # [N, Hq, P]
    bt = cache.block_tokens
    kvc = cache.gpu[:, layer]  # [Nblk, T, R+P]
    out = torch.empty(n, nh, dv, dtype=x.dtype, device=x.device)  # [N, Hq, Dv]
    for s in segments:
        slots = s.slots(cache)  # [B]
        rows = slice(s.row_start, s.row_start + s.num_tokens)
        pos = positions[rows]  # [n]
        kvc[slots[pos // bt], pos % bt] = latent[rows]
        ctx = s.context_len
        nb = cache.num_blocks_for(ctx)
        seq = kvc[slots[:nb]].reshape(nb * bt, r + spec.qk_rope_head_dim)[:ctx].float()  # [C, R+P]
        c_kv, k_pe = seq[:, :r], seq[:, r:]  # [C, R], [C, P]
        scores = (torch.einsum("nhr,cr->hnc", q_latent[rows], c_kv)
                  + torch.einsum("nhp,cp->hnc", q_pe32[rows], k_pe)) * softmax_scale  # [Hq, n, C]
        mask = torch.arange(ctx, device=x.device)[None, :] <= pos[:, None]  # [n, C]
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # [Hq, n, C] float32
        out_latent = torch.einsum("hnc,cr->nhr", probs, c_kv)  # [n, Hq, R]
        out[rows] = torch.einsum("nhr,hvr->nhv", out_latent, w_uv32).to(x.dtype)  # [n, Hq, Dv]
    return linear(out.reshape(n, nh * dv), w, "o_proj")  # [N, H]
