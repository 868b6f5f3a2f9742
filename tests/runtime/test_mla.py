"""MLA (DeepSeek-V2) on the CPU twin: the absorbed form over the paged latent cache equals naive attention
over decompressed per-head keys and values, and a shrunk DeepSeek-V2-Lite runs bit-exactly across KV tiers.

Letters: C context tokens, Hq heads, Dn nope width, P rope width, R latent rank, Dv value width, H hidden.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tierplan.runtime.engine.model as model_mod
from tierplan.runtime.device import Device
from tierplan.runtime.engine import mla
from tierplan.runtime.engine.attention import Segment, attention, gqa_attention
from tierplan.runtime.engine.config import ModelSpec
from tierplan.runtime.engine.kv_cache import PagedKVCache
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.kv import Tier
from tierplan.runtime.selfcheck.exact import auto_block_tokens, run_exact_check
from tierplan.runtime.transfer import TransferEngine
from tierplan.runtime.weights.format import dtype_from_name


def small_v2_lite() -> ModelSpec:
    return preset("deepseek-v2-lite").truncated(2).with_(
        hidden_size=128, num_heads=4, num_kv_heads=4, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, head_dim=48, num_experts=8, top_k=2, expert_intermediate=64, shared_intermediate=128,
        dense_intermediate=256, vocab_size=512)


def random_mla_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Fan-in scaled weights, so that scores spread over O(1) and softmax is far from uniform."""
    g = torch.Generator().manual_seed(seed)
    nh, dn, p, r, dv, h = (spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank,
                           spec.v_head_dim, spec.hidden_size)

    def mat(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * gain / cols**0.5

    w = {"q_proj": mat(nh * (dn + p), h, 2.0), "kv_a_proj_with_mqa": mat(r + p, h, 2.0),
         "kv_a_layernorm": 0.5 + torch.rand(r, generator=g), "kv_b_proj": mat(nh * (dn + dv), r, 2.0),
         "o_proj": mat(h, nh * dv)}
    dt = dtype_from_name(spec.dtype)
    return {k: v.to(dt) for k, v in w.items()}


def ref_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE written independently: dims (i, i + D/2) as one complex number. x [C, heads, D]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [D/2]
    rot = torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64),
                      positions.double()[:, None] * inv[None, :])[:, None, :]  # [C, 1, D/2]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rot
    return torch.cat([z.real, z.imag], -1).float()


def naive_mla(x: torch.Tensor, w: dict[str, torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """Textbook MLA of one whole sequence x [C, H] at positions 0..C-1, in float32: decompress k_nope and v
    for every head from c_kv through kv_b_proj, then ordinary causal multi-head attention."""
    c = x.shape[0]
    nh, dn, p, r, dv = (spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank,
                        spec.v_head_dim)
    w = {k: v.float() for k, v in w.items()}
    x, pos = x.float(), torch.arange(c)
    q = (x @ w["q_proj"].t()).view(c, nh, dn + p)  # [C, Hq, Dn+P]
    q = torch.cat([q[..., :dn], ref_rope(q[..., dn:], pos, spec.rope_theta)], -1)
    kv_a = x @ w["kv_a_proj_with_mqa"].t()  # [C, R+P]
    lat = kv_a[:, :r]
    c_kv = lat / (lat.pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps).sqrt() * w["kv_a_layernorm"]  # [C, R]
    k_pe = ref_rope(kv_a[:, r:].view(c, 1, p), pos, spec.rope_theta)  # [C, 1, P]
    kv = (c_kv @ w["kv_b_proj"].t()).view(c, nh, dn + dv)  # [C, Hq, Dn+Dv]
    k = torch.cat([kv[..., :dn], k_pe.expand(c, nh, p)], -1)  # [C, Hq, Dn+P]
    v = kv[..., dn:]  # [C, Hq, Dv]
    scores = torch.einsum("qhd,khd->hqk", q, k) / (dn + p) ** 0.5  # [Hq, C, C]
    scores = scores.masked_fill(~torch.ones(c, c, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [C, Hq, Dv]
    return out.reshape(c, nh * dv) @ w["o_proj"].t()  # [C, H]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.fixture
def make_cache() -> Iterator:
    made: list[tuple[TransferEngine, PagedKVCache]] = []

    def make(spec: ModelSpec, num_blocks: int = 16) -> PagedKVCache:
        dev = Device("cpu")
        eng = TransferEngine(dev)
        cache = PagedKVCache(spec, dev, eng, auto_block_tokens(spec), {Tier.GPU: num_blocks})
        made.append((eng, cache))
        return cache

    yield make
    for eng, cache in made:
        cache.close()
        eng.close()


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_absorbed_mla_over_the_paged_cache_equals_decompressed_attention(make_cache, dtype: str, tol: float) -> None:
    """Two sequences, prefilled in two chunks each (ragged, crossing block edges), then decoded token by token in
    one batch; every step's rows must match the naive model recomputed over the whole history."""
    spec = small_v2_lite().with_(dtype=dtype)
    w = random_mla_weights(spec, seed=3)
    cache = make_cache(spec)
    g = torch.Generator().manual_seed(7)
    chunks = {0: [21, 5, 1, 1, 1], 1: [3, 30, 1, 1, 1]}  # tokens per step, per sequence
    history = {s: torch.empty(0, spec.hidden_size) for s in chunks}
    for step in range(5):
        segs, xs, pos, row = [], [], [], 0
        for s, sizes in chunks.items():
            first, n = sum(sizes[:step]), sizes[step]
            cache.grow(s, first + n)
            segs.append(Segment(s, row, n, first))
            xs.append(torch.randn(n, spec.hidden_size, generator=g))
            pos.append(torch.arange(first, first + n))
            row += n
        x = torch.cat(xs).to(dtype_from_name(dtype))  # [N, H]
        out = mla.mla_attention(x, w, torch.cat(pos), segs, cache, 0, spec)  # [N, H]
        assert out.dtype == x.dtype and out.shape == x.shape
        for seg, xi in zip(segs, xs, strict=True):
            history[seg.seq_id] = torch.cat([history[seg.seq_id], xi.to(x.dtype).float()])
            want = naive_mla(history[seg.seq_id].to(x.dtype), w, spec)[seg.first_pos:]  # [n, H]
            got = out[seg.row_start:seg.row_start + seg.num_tokens]
            assert rel_err(got, want) < tol, (dtype, step, seg.seq_id, rel_err(got, want))


def test_cache_holds_only_the_latent_and_rope_key_rows(make_cache) -> None:
    spec = small_v2_lite().with_(dtype="float32")
    w = random_mla_weights(spec, seed=1)
    cache = make_cache(spec)
    n = cache.block_tokens + 3  # spans two blocks
    x, pos = torch.randn(n, spec.hidden_size), torch.arange(n)
    cache.grow(0, n)
    cache.gpu.fill_(7.0)  # block memory starts uninitialised; a sentinel shows what was written
    mla.mla_attention(x, w, pos, [Segment(0, 0, n, 0)], cache, 1, spec)
    slots = cache.gpu_slots(0)
    rows = cache.gpu[slots, 1].reshape(-1, spec.kv_lora_rank + spec.qk_rope_head_dim)  # [2T, R+P]
    assert torch.equal(rows[:n], mla.mla_project(x, w, pos, spec)[2])
    assert (rows[n:] == 7.0).all() and (cache.gpu[slots, 0] == 7.0).all()  # later rows and layer 0 untouched


def test_dispatcher_routes_by_attention_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = small_v2_lite()
    calls: list[int] = []
    monkeypatch.setattr(mla, "mla_attention", lambda *a: calls.append(a[5]) or a[0])
    x = torch.zeros(1, spec.hidden_size)
    assert attention(x, {}, torch.zeros(1, dtype=torch.int64), [], None, 4, spec) is x  # type: ignore[arg-type]
    assert calls == [4]


def test_each_kernel_refuses_the_other_kind() -> None:
    x, pos = torch.zeros(1, 8), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ConfigError, match="mla_attention needs attention kind mla, got gqa"):
        mla.mla_attention(x, {}, pos, [], None, 0, preset("tiny"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="attention kind mla has no reference kernel yet"):
        gqa_attention(x, {}, pos, [], None, 0, small_v2_lite())  # type: ignore[arg-type]


def test_shrunk_deepseek_v2_lite_is_exact_across_kv_tiers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine with MLA wired in: a quarter of the experts resident and every latent block spilled to CPU or
    NVMe after each step and fetched back must reproduce the all-resident run bit for bit."""
    used: list[str] = []

    def counting_attention(x, w, positions, segments, cache, layer, spec, decode_kernel=False, observer=None,
                           meta=None):
        used.append(spec.attention.value)
        return attention(x, w, positions, segments, cache, layer, spec, decode_kernel, observer, meta)

    monkeypatch.setattr(model_mod, "attention", counting_attention)
    spec = small_v2_lite()
    assert spec.moe_layers == (1,) and spec.dense_layers == (0,)
    r = run_exact_check(spec, 0.25, workdir=tmp_path)
    assert r.line() == "exact: max_abs_diff=0.0 tokens_equal=True ok"
    assert r.kv_fetches > 0 and r.kv_spills > 0 and r.expert_misses_tight > r.expert_misses_full
    assert used and set(used) == {"mla"}
