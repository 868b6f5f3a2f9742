"""The Triton grouped expert GEMM (Triton's interpreter on a CPU): values, grouping invariance, engine bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierplan.runtime.engine.kernels import moe_gemm
from tierplan.runtime.engine.kernels.paged_attention import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


def _case(seed: int = 0, experts: int = 6, n: int = 96, k: int = 160):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([3, 0, 17, 1, 0, 5])[:experts]  # empty groups and one longer than BLOCK_M
    m = int(counts.sum())
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)  # [M, K]
    stride = n * k + 64  # experts sit apart, as in the slot pool
    raw = torch.randn(experts * stride, generator=g).to(torch.bfloat16)
    w = raw.as_strided((experts, n, k), (stride, k, 1))  # [E, N, K] strided view
    return x, w, counts, torch.cumsum(counts, 0).to(torch.int32)


def test_matches_a_per_expert_reference() -> None:
    x, w, counts, offs = _case()
    out = moe_gemm.grouped_gemm(x, w, offs)  # [M, N]
    ref, r = torch.empty(out.shape), 0
    for e, c in enumerate(counts.tolist()):
        ref[r : r + c] = x[r : r + c].float() @ w[e].float().t()
        r += c
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_a_rows_bits_do_not_depend_on_how_experts_are_grouped() -> None:
    """The engine runs a layer as one call when all experts are resident, in chunks otherwise."""
    x, w, counts, offs = _case(1)
    whole = moe_gemm.grouped_gemm(x, w, offs)
    e0, e1 = 2, 5
    r0, r1 = int(counts[:e0].sum()), int(counts[:e1].sum())
    part = moe_gemm.grouped_gemm(x[r0:r1], w[e0:e1], torch.cumsum(counts[e0:e1], 0).to(torch.int32))
    assert torch.equal(whole[r0:r1], part)


def test_bad_shapes_are_refused() -> None:
    x, w, _, offs = _case()
    with pytest.raises(ValueError, match="bad shapes"):
        moe_gemm.grouped_gemm(x[:, :-1], w, offs)
    with pytest.raises(ValueError, match="bad shapes"):
        moe_gemm.grouped_gemm(x, w, offs[:-1])


def test_engine_exact_through_the_triton_moe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierplan.runtime.engine.presets import preset
    from tierplan.runtime.selfcheck.exact import run_exact_check

    monkeypatch.setattr(moe_gemm, "FORCE", True)
    calls = []
    real = moe_gemm.grouped_gemm
    monkeypatch.setattr(moe_gemm, "grouped_gemm", lambda *a: calls.append(1) or real(*a))
    r = run_exact_check(preset("tiny"), 0.25, workdir=tmp_path, new_tokens=4)
    assert r.line() == "exact: max_abs_diff=0.0 tokens_equal=True ok" and calls
