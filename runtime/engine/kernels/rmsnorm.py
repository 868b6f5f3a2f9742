"""Fused RMSNorm in Triton (inference process): one kernel instead of eight elementwise ones per norm.

Row r: y = bf16(x * rsqrt(mean(x^2) + eps)) computed in float32, then out = y * w rounded to x's dtype, the
same two roundings as the torch path (`attention.rms_norm`); only the order of the mean's additions may
differ, so GPU results need not equal CPU ones bit for bit, but they never depend on placement. On a CPU the
torch path is used (the kernel runs in Triton's interpreter in tests). Reads and writes only its tensors.
"""

from __future__ import annotations

import torch

from tierplan.runtime.engine.kernels.paged_attention import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_o, eps, BLOCK_H: tl.constexpr):
        r = tl.program_id(0)
        h = tl.arange(0, BLOCK_H)
        hmask = h < H
        x = tl.load(x_ptr + r.to(tl.int64) * stride_x + h, mask=hmask, other=0.0).to(tl.float32)
        rs = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
        y = (x * rs).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + h, mask=hmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + r.to(tl.int64) * stride_o + h, (y * w).to(out_ptr.dtype.element_ty), mask=hmask)


def rms_norm_fused(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] (rows contiguous in H), w [H] -> [..., H] in x's dtype."""
    h = x.shape[-1]
    if w.shape != (h,) or x.stride(-1) != 1:
        raise ValueError(f"rms_norm_fused: x {tuple(x.shape)} / w {tuple(w.shape)} do not match")
    rows = x.reshape(-1, h)  # a view for the layouts the engine passes
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rmsnorm_kernel[(rows.shape[0],)](rows, w, out, h, rows.stride(0), out.stride(0), eps,
                                          BLOCK_H=triton.next_power_of_2(h))
    return out.view(x.shape)
