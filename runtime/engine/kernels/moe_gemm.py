"""Grouped expert GEMM in Triton that reads only the experts a batch routes to (inference process).

`torch._grouped_mm` walks every group of the layer: at decode batch sizes (a few rows per expert, most
experts idle at B=1) it spends its time on empty groups. Here program (e, n) reads expert e's row range
from the cumulative offsets on the device and multiplies those rows by a BLOCK_N slice of its weight,
looping over K in fixed BLOCK_K steps; experts with no rows cost two scalar loads. The tile sizes are
constants, never chosen by batch or by group, so a row's result depends only on that row and its expert's
weights: the same bits whether the layer runs as one grouped call or in chunks of resident experts.
Weights are read through any strides (the slot pool's strided expert views). On a CPU the kernel runs in
Triton's interpreter (tests). Never moves experts; reads only.
"""

from __future__ import annotations

import torch

from tierplan.runtime.engine.kernels.paged_attention import HAS_TRITON, interpreted

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 128
MAX_ROWS = 2048  # above this many routed rows per layer the layer is compute-bound: torch._grouped_mm then

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _grouped_gemm_kernel(x_ptr, w_ptr, offs_ptr, slots_ptr, out_ptr, N, K, stride_xm, stride_we, stride_wn,
                             stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             DOT_F32: tl.constexpr, W_ADDR: tl.constexpr):
        if W_ADDR:  # w_ptr is the weights' address as an int64 (its first expert may be unmapped)
            w_ptr = w_ptr.to(tl.pointer_type(x_ptr.dtype.element_ty))
        e = tl.program_id(0)
        we = tl.load(slots_ptr + e).to(tl.int64)  # where group e's weights sit in w (its slot, or e itself)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        start = tl.load(offs_ptr + e)
        end = tl.load(offs_ptr + e + 1)
        for m0 in range(start, end, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            mmask = m < end
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                kmask = k < K
                a = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + k[None, :],
                            mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BM, BK]
                b = tl.load(w_ptr + we * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None],
                            mask=nmask[None, :] & kmask[:, None], other=0.0)  # [BK, BN]
                if DOT_F32:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc += tl.dot(a, b)
            tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


FORCE: bool | None = None  # tests: True runs it on a CPU too (Triton's interpreter), False never


def usable(x: torch.Tensor, total_rows: int) -> bool:
    """Whether a layer with `total_rows` routed rows runs through this kernel, decided once per layer from the
    whole layer's rows (never per chunk: chunks of one layer must all take the same kernel)."""
    if not HAS_TRITON or total_rows > MAX_ROWS or FORCE is False:
        return False
    return x.is_cuda or (FORCE is True and interpreted())


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                 slots: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] rows sorted by expert; w [S, N, K] (K contiguous, any expert/row stride); offs [E] int
    cumulative row ends (as for torch._grouped_mm); slots [E] int64: group e reads w[slots[e]] (a slot table;
    None: w[e], E = S) -> [M, N] in x's dtype. Every call indexes through slots (one compiled kernel, whether
    the weights are read through experts' ranges or the slot window: the same bits)."""
    m, k = x.shape
    s_, n, kw = w.shape
    e = offs.shape[0] if offs.dim() == 1 else -1
    if slots is None and e == s_:
        slots = torch.arange(e, dtype=torch.int64, device=x.device)
    if kw != k or w.stride(-1) != 1 or x.stride(-1) != 1 or slots is None or slots.shape != (e,):
        raise ValueError(f"grouped_gemm: bad shapes/strides x={tuple(x.shape)} w={tuple(w.shape)} "
                         f"offs={tuple(offs.shape)} slots={None if slots is None else tuple(slots.shape)}")
    bounds = torch.zeros(e + 1, dtype=torch.int32, device=x.device)  # [E+1] row starts, then the end
    bounds[1:] = offs
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if w.dtype != x.dtype:
        raise ValueError(f"grouped_gemm: weights are {w.dtype}, rows {x.dtype} (expected the same)")
    # On a GPU the weights go in by address: Triton checks that a tensor argument's first byte is mapped, and a
    # layer's range may have its first experts absent (unmapped) while only routed experts are read.
    addr = w.is_cuda and not interpreted()
    _grouped_gemm_kernel[(e, triton.cdiv(n, BLOCK_N))](
        x, w.data_ptr() if addr else w, bounds, slots, out, n, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_F32=interpreted(), W_ADDR=addr, num_warps=4,
        num_stages=4)
    return out
