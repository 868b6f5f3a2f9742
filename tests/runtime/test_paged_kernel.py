"""The Triton paged decode-attention kernel against its torch reference (interpreter on CPU, real on GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierplan.runtime.engine.kernels.paged_attention import HAS_TRITON, paged_decode_attention, paged_decode_reference
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.selfcheck.exact import run_exact_check

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b: int, hq: int, hkv: int, d: int, t: int, lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    nblk = sum(-(-n // t) for n in lens) + 3
    kv = torch.randn(nblk, 2, t, hkv, d, generator=g).to(torch.bfloat16).to(DEV)  # [N, 2, T, Hkv, D]
    perm = torch.randperm(nblk, generator=g)  # scattered blocks: the table, not the layout, gives the order
    width = max(-(-n // t) for n in lens)
    table = torch.zeros(b, width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // t)
        table[i, :k] = perm[used : used + k]
        used += k
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16).to(DEV)
    return q, kv[:, 0], kv[:, 1], table.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize(("hq", "hkv", "lens"), [(4, 4, [1, 16, 17]), (8, 2, [5, 33, 64]), (16, 2, [31, 2, 48, 7])])
def test_kernel_matches_the_reference(hq: int, hkv: int, lens: list[int]) -> None:
    q, k, v, table, ctx = _case(len(lens), hq, hkv, 32, 16, lens, seed=hq + hkv)
    out = paged_decode_attention(q, k, v, table, ctx)
    ref = paged_decode_reference(q, k, v, table, ctx)
    assert torch.isfinite(out.float()).all()
    rel = (out.float() - ref.float()).norm() / ref.float().norm()
    assert rel < 1e-2, f"relative error {rel:.2e}"


@pytest.mark.parametrize("target", [1, 64])  # one split; many splits, some past the shortest context (empty)
def test_context_splits_combine_to_the_reference(target: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierplan.runtime.engine.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "TARGET_PROGRAMS", target)
    q, k, v, table, ctx = _case(2, 8, 2, 32, 16, [3, 200], seed=11)
    assert pa.num_splits(2, 2) == (1 if target == 1 else 16)
    ref = paged_decode_reference(q, k, v, table, ctx)
    out = paged_decode_attention(q, k, v, table, ctx)
    assert torch.isfinite(out.float()).all()
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 1e-2


def test_padding_rows_of_a_bucket_do_not_thin_the_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket's splits are sized by the fewest sequences it can hold, not by its padded rows (phase run 61:
    9 sequences in a bucket of 16 walked twice the context per program of 8 in a bucket of 8)."""
    import tierplan.runtime.engine.kernels.paged_attention as pa
    from tierplan.runtime.engine.graphs import fewest_rows

    assert [fewest_rows(b) for b in (1, 2, 4, 8, 16, 20, 24, 256)] == [1, 2, 3, 5, 9, 17, 17, 193]
    monkeypatch.setattr(pa, "TARGET_PROGRAMS", 512)
    assert pa.num_splits(16, 4) == 8  # sized by the padded batch: 9 sequences got 9 x 4 x 8 = 288 programs
    assert pa.num_splits(16, 4, real_rows=fewest_rows(16)) == pa.num_splits(9, 4) == 15
    assert pa.num_splits(8, 4, real_rows=99) == pa.num_splits(8, 4)  # never more rows than the batch has


def test_a_padded_batch_with_its_real_rows_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """5 sequences padded to a bucket of 8 (padding rows: one token): more splits, same attention."""
    import tierplan.runtime.engine.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "TARGET_PROGRAMS", 64)
    lens = [40, 3, 64, 17, 29, 1, 1, 1]
    q, k, v, table, ctx = _case(8, 4, 2, 32, 16, lens, seed=5)
    assert pa.num_splits(8, 2, real_rows=5) > pa.num_splits(8, 2)
    ref = paged_decode_reference(q, k, v, table, ctx)
    out = paged_decode_attention(q, k, v, table, ctx, real_rows=5)
    assert torch.isfinite(out.float()).all()
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 1e-2


def test_kernel_only_reads_the_context() -> None:
    """Poison everything past each context: the output must not change."""
    q, k, v, table, ctx = _case(2, 4, 2, 16, 16, [9, 20], seed=3)
    a = paged_decode_attention(q, k, v, table, ctx)
    k2, v2 = k.clone(), v.clone()
    for i, n in enumerate(ctx.tolist()):
        last = int(table[i, (n - 1) // 16])
        k2[last, n % 16 or 16 :] = float("nan")
        v2[last, n % 16 or 16 :] = float("nan")
    assert torch.equal(paged_decode_attention(q, k2, v2, table, ctx), a)


def test_engine_decode_through_the_kernel_is_exact_across_tiers(tmp_path: Path) -> None:
    r = run_exact_check(preset("tiny"), 0.25, workdir=tmp_path, new_tokens=4, decode_kernel=True)
    assert r.line() == "exact: max_abs_diff=0.0 tokens_equal=True ok"
