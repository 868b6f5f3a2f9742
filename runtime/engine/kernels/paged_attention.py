"""Paged decode attention (GQA) in Triton, with its torch reference (inference process).

One query token per sequence reads its K/V through a block table: program (sequence b, KV head h) loads the
G = Hq / Hkv query heads that share head h, walks the sequence's blocks in order with an online softmax
(running max, running sum, float32 accumulator) and writes [G, D] outputs. The order of the walk is fixed,
so the result is the same whichever tier a block was fetched from. On a CPU, Triton runs the same kernel in
its interpreter (TRITON_INTERPRET=1), which is how CI checks it. Never moves blocks; reads only.
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is a dev/gpu dependency
    HAS_TRITON = False


if HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
                             stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh,
                             scale, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                             DOT_F32: tl.constexpr):
        b = tl.program_id(0)
        hk = tl.program_id(1)
        ctx = tl.load(lens_ptr + b)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        t = tl.arange(0, T)
        gmask = g < G
        heads = hk * G + g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None],
                    other=0.0)  # [BG, D]
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for i in range(0, tl.cdiv(ctx, T)):
            slot = tl.load(tables_ptr + b * stride_tb + i).to(tl.int64)
            off = slot * stride_kb + hk * stride_kh + t[:, None] * stride_kt + d[None, :]
            live = (i * T + t < ctx)[:, None]  # rows past the context may hold anything, NaN included
            k = tl.load(k_ptr + off, mask=live, other=0.0)  # [T, D]
            v = tl.load(v_ptr + off, mask=live, other=0.0)  # [T, D]
            if DOT_F32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [BG, T]
            s = tl.where((i * T + t < ctx)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])  # [BG, T]
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, D]; k/v_cache [Nblk, T, Hkv, D] (any block stride); block_tables [B, M] int32 GPU slots;
    context_lens [B] int32 -> out [B, Hq, D]."""
    if not HAS_TRITON:
        raise RuntimeError("paged_decode_attention needs triton (pip install 'tierplan[gpu]' or '[dev]')")
    bsz, hq, d = q.shape
    _, t, hkv, dk = k_cache.shape
    if dk != d or hq % hkv or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"paged_decode_attention: bad shapes/strides q={tuple(q.shape)} k={tuple(k_cache.shape)}")
    for name, v in (("block_tokens", t), ("head_dim", d)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"paged_decode_attention: {name}={v} must be a power of two >= 16 (Triton tiles)")
    g = hq // hkv
    out = torch.empty_like(q)
    _paged_decode_kernel[(bsz, hkv)](
        q, k_cache, v_cache, block_tables, context_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), 1.0 / math.sqrt(d), G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, T=t,
        # Triton's CPU interpreter gets bf16 dots wrong (seen with triton 3.9): upcast there, never on a GPU.
        DOT_F32=_interpreted(),
    )
    return out


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """The same function in plain torch (float32 math): gather each sequence's blocks, then softmax(qK^T)V."""
    bsz, hq, d = q.shape
    t, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(bsz):
        n = int(context_lens[b])
        nb = -(-n // t)
        slots = block_tables[b, :nb].long()
        k = k_cache[slots].reshape(nb * t, hkv, d)[:n].float().repeat_interleave(hq // hkv, 1)  # [n, Hq, D]
        v = v_cache[slots].reshape(nb * t, hkv, d)[:n].float().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), k) / math.sqrt(d)  # [Hq, n]
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out
