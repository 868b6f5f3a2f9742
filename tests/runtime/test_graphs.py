"""The CUDA-graph decode path through its CPU twin (same static buffers, padding and taps; no capture)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agent.taps import AttentionMassTap, RouterTap
from runtime.device import Device
from runtime.engine.engine import EngineConfig, ReferenceEngine
from runtime.engine.presets import preset
from runtime.errors import ConfigError
from runtime.selfcheck.exact import auto_block_tokens

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [5] * 20, [11, 12]]


@pytest.fixture(scope="module")
def tiny():
    return preset("tiny")


def _engine(spec, tmp_path: Path, name: str, **kw) -> ReferenceEngine:
    kw.setdefault("decode_kernel", True)
    cfg = EngineConfig(block_tokens=auto_block_tokens(spec), workdir=tmp_path / name, **kw)
    return ReferenceEngine(spec, Device("cpu"), cfg)


@pytest.mark.parametrize("batch", [4, 3])  # 4 fills a bucket; 3 decodes with one padding row
def test_graph_steps_match_eager_steps(tiny, tmp_path: Path, batch: int) -> None:
    prompts = PROMPTS[:batch]
    eager = _engine(tiny, tmp_path, "eager", decode_graphs=False)
    a = eager.generate(prompts, 6)
    eager.close()
    graphed = _engine(tiny, tmp_path, "graphs", decode_graphs=True)
    b = graphed.generate(prompts, 6)
    assert graphed.graphs is not None and graphed.graphs.replays == 5  # every decode step after the prefill
    assert graphed.graphs.fallbacks == {"prefill": 1}
    # padding rows wrote only the scratch block: no real sequence's KV changed
    assert a.tokens == b.tokens
    if batch == 4:
        assert torch.equal(a.logits, b.logits)
    else:
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
    graphed.close()


def test_graph_path_falls_back_and_counts_why(tiny, tmp_path: Path) -> None:
    eng = _engine(tiny, tmp_path, "a", decode_graphs=True, resident_frac=0.25)
    eng.generate(PROMPTS[:2], 3)
    assert eng.graphs is not None and eng.graphs.replays == 0
    assert eng.graphs.fallbacks["experts_not_resident"] >= 1  # some decode step met a missing expert
    eng.close()
    eng = _engine(tiny, tmp_path, "b", decode_graphs=True, graph_max_batch=2)
    eng.generate(PROMPTS[:3], 3)
    assert eng.graphs is not None and eng.graphs.fallbacks["batch_too_large"] == 2
    eng.close()
    eng = _engine(tiny, tmp_path, "c", decode_graphs=True, decode_kernel=False)
    eng.generate(PROMPTS[:1], 2)
    assert eng.graphs is not None and eng.graphs.fallbacks["no_paged_decode_kernel"] == 1
    eng.close()
    with pytest.raises(ConfigError, match="graph_max_batch"):
        EngineConfig(graph_max_batch=0)


def test_taps_see_the_same_routes_and_mass_on_both_paths(tiny, tmp_path: Path) -> None:
    got = {}
    for graphs in (False, True):
        eng = _engine(tiny, tmp_path, f"g{graphs}", decode_graphs=graphs)
        tap = RouterTap(tiny.moe_layers, tiny.num_experts, torch.device("cpu"))
        mass = AttentionMassTap(layers=(0, 1), every_steps=1)
        mass.begin_step(0)
        eng.model.route_tap, eng.model.mass_observer = tap, mass
        eng.generate(PROMPTS[:3], 4)
        got[graphs] = (tap.drain(), mass.drain())
        eng.close()
    (layers_e, mass_e), (layers_g, mass_g) = got[False], got[True]
    assert [s.activation_counts for s in layers_e] == [s.activation_counts for s in layers_g]
    assert [s.num_tokens for s in layers_e] == [s.num_tokens for s in layers_g]
    assert [s.cooccurrence for s in layers_e] == [s.cooccurrence for s in layers_g]
    for a, b in zip(layers_e, layers_g, strict=True):
        assert a.router_entropy_mean == pytest.approx(b.router_entropy_mean, rel=1e-5)
    assert [(m.block, m.samples) for m in mass_e] == [(m.block, m.samples) for m in mass_g]
    for a, b in zip(mass_e, mass_g, strict=True):
        assert a.mass == pytest.approx(b.mass, abs=1e-5)


def test_router_tap_add_all_equals_per_layer_calls(tiny) -> None:
    g = torch.Generator().manual_seed(0)
    n_l, k = len(tiny.moe_layers), tiny.top_k
    ids = torch.stack([torch.randperm(tiny.num_experts, generator=g)[:k] for _ in range(n_l * 5)]).view(n_l, 5, k)
    w = torch.rand(n_l, 5, k, generator=g) + 0.01
    a, b = (RouterTap(tiny.moe_layers, tiny.num_experts, torch.device("cpu"), capacity_rows=8) for _ in range(2))
    for _ in range(3):  # the third call overflows the ring of 8 rows and folds first
        a.add_all(ids, w)
        for m, layer in enumerate(tiny.moe_layers):
            b(layer, ids[m], w[m])
    sa, sb = a.drain(), b.drain()
    assert [s.activation_counts for s in sa] == [s.activation_counts for s in sb]
    assert [s.num_tokens for s in sa] == [15] * n_l == [s.num_tokens for s in sb]
    with pytest.raises(ValueError, match="layers of routes"):
        a.add_all(ids[:1], w[:1])


@pytest.mark.parametrize("prompts", [3, 5])  # padded buckets (4 and 8): replayed and eager steps must agree
def test_placement_keeps_bits_when_steps_replay_or_not(tiny, tmp_path: Path, prompts: int) -> None:
    """All experts resident (steps replay) vs a quarter resident (steps run eagerly over the padded rows)."""
    from runtime.selfcheck.exact import run_exact_check

    r = run_exact_check(tiny, 0.25, workdir=tmp_path, num_prompts=prompts, new_tokens=5, decode_kernel=True,
                        decode_graphs=True)
    assert r.line() == "exact: max_abs_diff=0.0 tokens_equal=True ok"


def test_a_padded_eager_step_fetches_experts_only_for_real_rows(tiny, tmp_path: Path) -> None:
    eng = _engine(tiny, tmp_path, "p", decode_graphs=True, resident_frac=0.25)
    seen: list[int] = []
    real = eng.experts.ensure
    eng.experts.ensure = lambda layer, experts: seen.append(len(experts)) or real(layer, experts)  # type: ignore[method-assign]
    tap = RouterTap(tiny.moe_layers, tiny.num_experts, torch.device("cpu"))
    eng.model.route_tap = tap
    eng.generate(PROMPTS[:3], 3)
    assert eng.graphs is not None and eng.graphs.padded_eager == 2 and eng.graphs.replays == 0 and seen
    # the tap saw 3 real rows per decode step (plus the prefill rows), never the padding row
    assert [s.num_tokens for s in tap.drain()] == [sum(len(p) for p in PROMPTS[:3]) + 2 * 3] * len(tiny.moe_layers)
    eng.close()


def test_steps_that_do_not_fit_the_buffers_never_take_the_padded_path(tiny, tmp_path: Path) -> None:
    """Shape reasons win over placement reasons: a missing expert with a too-long context, or forced routes
    with a too-large batch, decode plainly (no crash, and the path does not depend on placement)."""
    eng = _engine(tiny, tmp_path, "long", decode_graphs=True, resident_frac=0.25, graph_max_blocks=1)
    eng.generate(PROMPTS[:3], 3)  # prompt 3 has 20 tokens: more than one block
    assert eng.graphs is not None and eng.graphs.fallbacks["context_too_long"] == 2
    eng.close()
    eng = _engine(tiny, tmp_path, "wide", decode_graphs=True, graph_max_batch=2)
    rows: list[int] = []

    def forced(layer: int, n: int):
        rows.append(n)
        ids = torch.arange(tiny.top_k).repeat(n, 1)
        return ids, torch.full((n, tiny.top_k), 1.0 / tiny.top_k)

    eng.model.forced_routes = forced
    eng.generate(PROMPTS[:3], 3)
    assert eng.graphs is not None and eng.graphs.fallbacks["batch_too_large"] == 2
    assert eng.graphs.fallbacks["forced_routes"] == 0 and eng.graphs.padded_eager == 0 and set(rows) >= {3}
    eng.close()


def replay_vs_padded_eager(spec, device: str, tmp_path: Path, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same decode step of one all-resident engine through the graph and through the padded eager path
    (re-writing the same K/V rows is idempotent)."""
    cfg = EngineConfig(block_tokens=auto_block_tokens(spec), decode_graphs=True, decode_kernel=True,
                       experts_on_device=True, workdir=tmp_path / f"rvp{batch}")
    eng = ReferenceEngine(spec, Device(device), cfg)
    try:
        seqs = list(range(batch))
        prompts = [[1 + (s * 5 + j) % 50 for j in range(3 + s)] for s in seqs]
        last = eng.step(seqs, prompts, [0] * batch).argmax(-1).tolist()
        starts = [len(p) for p in prompts]
        for s, p in zip(seqs, starts, strict=True):
            eng.cache.grow(s, p + 1)
        rows = [eng.cache.gpu_indices(s) for s in seqs]
        toks = [[t] for t in last]
        assert eng.graphs is not None and eng.graphs.why_not(toks, rows) is None
        a = eng.graphs.run(seqs, toks, starts, rows, replay=True)
        b = eng.graphs.run(seqs, toks, starts, rows, replay=False)
        return a.cpu(), b.cpu()
    finally:
        eng.close()


@pytest.mark.parametrize("batch", [3, 5])
def test_replayed_and_padded_eager_steps_are_bit_identical(tiny, tmp_path: Path, batch: int) -> None:
    a, b = replay_vs_padded_eager(tiny, "cpu", tmp_path, batch)
    assert torch.equal(a, b)
