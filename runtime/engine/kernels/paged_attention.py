"""Paged decode attention (GQA) in Triton, with its torch reference (inference process).

One query token per sequence reads its K/V through a block table (flash-decoding): program (sequence b,
KV head h, split s) loads the G = Hq / Hkv query heads that share head h, walks its share of the context
BLOCK_T tokens at a time (each token's block looked up in the table) with an online softmax (running max,
running sum, float32 accumulator), and a second kernel combines the splits in a fixed order. The number of
splits depends only on the shapes (batch, head counts, and the fewest rows of the batch that hold a sequence)
and the walk order is fixed, so the result is the same whichever tier a block was fetched from. On a CPU,
Triton runs the same kernel in its interpreter (TRITON_INTERPRET=1), which is how CI checks it. Never moves
blocks; reads only.
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


BLOCK_T = 64  # tokens per inner step (several KV blocks gathered through the table at once)
TARGET_PROGRAMS = 512  # splits of the context so that B * Hkv * splits reaches this (flash-decoding)
MAX_SPLITS = 32


def num_splits(batch: int, kv_heads: int, real_rows: int | None = None) -> int:
    """Context splits per (sequence, KV head): a function of the shapes only, never of where blocks live.

    `real_rows`: the fewest of the `batch` rows that can hold a sequence (a CUDA-graph bucket pads the rest with
    one-token rows, whose programs end at once). The splits are sized so that those rows alone reach
    TARGET_PROGRAMS: sized by the padded batch, 9 sequences in a bucket of 16 got 288 working programs where 8 in
    a bucket of 8 got 512, each walking twice the context (`tierplan bench engine` times both sizings)."""
    rows = batch if real_rows is None else max(1, min(batch, real_rows))
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // (rows * kv_heads))))


if HAS_TRITON:

    @triton.jit
    def _paged_split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr,
                            stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, scale, NSPLIT,
                            G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                            BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr):
        b = tl.program_id(0)
        hk = tl.program_id(1)
        sp = tl.program_id(2)
        ctx = tl.load(lens_ptr + b)
        ntiles = tl.cdiv(ctx, BLOCK_T)
        per = tl.cdiv(ntiles, NSPLIT)
        t_lo = sp * per
        t_hi = tl.minimum(t_lo + per, ntiles)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        tok = tl.arange(0, BLOCK_T)
        gmask = g < G
        heads = hk * G + g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None],
                    other=0.0)  # [BG, D]
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for ti in range(t_lo, t_hi):
            pos = ti * BLOCK_T + tok  # [BT]
            live = pos < ctx  # rows past the context may hold anything, NaN included
            slot = tl.load(tables_ptr + b * stride_tb + pos // T, mask=live, other=0).to(tl.int64)  # [BT]
            off = slot[:, None] * stride_kb + (pos % T)[:, None] * stride_kt + hk * stride_kh + d[None, :]
            k = tl.load(k_ptr + off, mask=live[:, None], other=0.0)  # [BT, D]
            v = tl.load(v_ptr + off, mask=live[:, None], other=0.0)  # [BT, D]
            if DOT_F32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [BG, BT]
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])  # [BG, BT]
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        idx = (b * tl.num_programs(1) * G + heads) * NSPLIT + sp  # [BG] partial of (b, head, split)
        tl.store(m_ptr + idx, m_i, mask=gmask)
        tl.store(l_ptr + idx, l_i, mask=gmask)
        tl.store(acc_ptr + idx[:, None] * D + d[None, :], acc, mask=gmask[:, None])

    @triton.jit
    def _paged_reduce_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh, NSPLIT,
                             D: tl.constexpr, BLOCK_S: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, BLOCK_S)
        d = tl.arange(0, D)
        smask = sp < NSPLIT
        idx = (b * tl.num_programs(1) + h) * NSPLIT + sp  # [BS]
        m = tl.load(m_ptr + idx, mask=smask, other=float("-inf"))
        lsum = tl.load(l_ptr + idx, mask=smask, other=0.0)
        m_all = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # empty splits (past the context) weigh 0
        acc = tl.load(acc_ptr + idx[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)  # [BS, D]
        out = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def interpreted() -> bool:
    """True when Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           real_rows: int | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k/v_cache [Nblk, T, Hkv, D] (any block stride); block_tables [B, M] int32 GPU slots;
    context_lens [B] int32 -> out [B, Hq, D]. `real_rows`: see `num_splits` (None: every row holds one)."""
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
    ns = num_splits(bsz, hkv, real_rows)
    m = torch.empty(bsz, hq, ns, dtype=torch.float32, device=q.device)  # [B, Hq, S] running max per split
    l_sum = torch.empty_like(m)  # [B, Hq, S]
    acc = torch.empty(bsz, hq, ns, d, dtype=torch.float32, device=q.device)  # [B, Hq, S, D]
    interp = interpreted()  # Triton's CPU interpreter gets bf16 dots wrong (seen with triton 3.9): upcast there
    _paged_split_kernel[(bsz, hkv, ns)](
        q, k_cache, v_cache, block_tables, context_lens, m, l_sum, acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        1.0 / math.sqrt(d), ns, G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, T=t, BLOCK_T=BLOCK_T,
        DOT_F32=interp,
    )
    _paged_reduce_kernel[(bsz, hq)](m, l_sum, acc, out, out.stride(0), out.stride(1), ns, D=d,
                                    BLOCK_S=max(2, triton.next_power_of_2(ns)))
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
