"""The fused RMSNorm kernel (Triton's interpreter on a CPU) against the torch path."""

from __future__ import annotations

import pytest
import torch

from tierplan.runtime.engine.attention import rms_norm
from tierplan.runtime.engine.kernels.paged_attention import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


@pytest.mark.parametrize("shape", [(3, 64), (2, 4, 16), (1, 96)])  # rows, per-head rows, H not a power of 2
def test_fused_rmsnorm_matches_torch(shape: tuple[int, ...]) -> None:
    from tierplan.runtime.engine.kernels.rmsnorm import rms_norm_fused

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    w = (torch.randn(shape[-1], generator=g) * 0.1 + 1).to(torch.bfloat16)
    out = rms_norm_fused(x, w, 1e-6)
    ref = rms_norm(x, w, 1e-6)  # the torch path on a CPU
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="do not match"):
        rms_norm_fused(x, w[:-1], 1e-6)
