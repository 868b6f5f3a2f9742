"""The CUDA-graph decode path through its CPU twin (same static buffers, padding and taps; no capture)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierplan.agent.taps import AttentionMassTap, RouterTap
from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.executor import Executor, Reason
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.selfcheck.exact import auto_block_tokens

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
    # every decode step after the prefill replays
    assert graphed.executors.reasons == {Reason.PREFILL: 1, Reason.ALL_RESIDENT: 5}
    assert graphed.graphs is not None and graphed.graphs.take_gpu_ms() is None  # nothing captured: no GPU time
    # padding rows wrote only the scratch block: no real sequence's KV changed
    assert a.tokens == b.tokens
    if batch == 4:
        assert torch.equal(a.logits, b.logits)
    else:
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
    graphed.close()


def test_graph_path_falls_back_and_counts_why(tiny, tmp_path: Path) -> None:
    eng = _engine(tiny, tmp_path, "a", decode_graphs=True, resident_frac=0.25)
    eng.generate(PROMPTS[:3], 3)  # 3 rows x top-2 may need 6 experts of a layer: more than the 4 slots
    assert eng.executors.reasons == {Reason.PREFILL: 1, Reason.LAYER_OVER_SLOTS: 2}
    eng.close()
    eng = _engine(tiny, tmp_path, "a2", decode_graphs=True, resident_frac=0.25)
    eng.generate(PROMPTS[:2], 3)  # 2 rows x top-2 fit: piecewise
    assert eng.executors.reasons == {Reason.PREFILL: 1, Reason.EXPERTS_MISSING: 2}
    assert eng.executors.steps[Executor.PIECEWISE] == 2
    eng.close()
    eng = _engine(tiny, tmp_path, "a3", decode_graphs=True, resident_frac=0.25, offload_exec="eager")
    eng.generate(PROMPTS[:2], 3)
    assert eng.executors.reasons == {Reason.PREFILL: 1, Reason.OFFLOAD_EAGER: 2}
    eng.close()
    eng = _engine(tiny, tmp_path, "b", decode_graphs=True, graph_max_batch=2)
    eng.generate(PROMPTS[:3], 3)
    assert eng.executors.reasons[Reason.BATCH_TOO_LARGE] == 2
    eng.close()
    eng = _engine(tiny, tmp_path, "c", decode_graphs=True, decode_kernel=False)
    eng.generate(PROMPTS[:1], 2)
    assert eng.executors.reasons[Reason.NO_PAGED_DECODE_KERNEL] == 1
    eng.close()
    with pytest.raises(ConfigError, match="offload_exec"):
        EngineConfig(offload_exec="zero-copy")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expert_lookahead_layers"):
        EngineConfig(expert_lookahead_layers=-1)
    with pytest.raises(ConfigError, match="graph_max_batch"):
        EngineConfig(graph_max_batch=0)


def test_taps_see_the_same_routes_and_mass_on_both_paths(tiny, tmp_path: Path) -> None:
    got = {}
    for graphs in (False, True):
        eng = _engine(tiny, tmp_path, f"g{graphs}", decode_graphs=graphs)
        tap = RouterTap(tiny.moe_layers, tiny.num_experts, torch.device("cpu"))
        mass = AttentionMassTap(layers=(0, 1), every_steps=1)
        mass.begin_step(0)
        eng.set_hooks(route_tap=tap, mass_observer=mass)
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
    """All experts resident (steps replay) vs a quarter resident (steps run eagerly over the padded rows: the
    live routes of 3 or 5 rows may need more experts than the slots, so the piecewise mode is not exercised and
    only the bits are compared here; test_offload_exec.py checks each mode)."""
    from tierplan.runtime.selfcheck.exact import run_exact_check

    r = run_exact_check(tiny, 0.25, workdir=tmp_path, num_prompts=prompts, new_tokens=5, decode_kernel=True,
                        decode_graphs=True)
    assert r.max_abs_diff == 0.0 and r.tokens_equal and r.expert_misses_tight > r.expert_misses_full, r.line()


def test_a_padded_eager_step_fetches_experts_only_for_real_rows(tiny, tmp_path: Path) -> None:
    eng = _engine(tiny, tmp_path, "p", decode_graphs=True, resident_frac=0.25, offload_exec="eager")
    seen: list[int] = []
    real = eng.experts.ensure
    eng.experts.ensure = lambda layer, experts, **kw: seen.append(len(experts)) or real(layer, experts, **kw)  # type: ignore[method-assign]
    tap = RouterTap(tiny.moe_layers, tiny.num_experts, torch.device("cpu"))
    eng.set_hooks(route_tap=tap)
    eng.generate(PROMPTS[:3], 3)
    assert eng.executors.reasons[Reason.OFFLOAD_EAGER] == 2 and eng.executors.steps[Executor.GRAPH] == 0 and seen
    # the tap saw 3 real rows per decode step (plus the prefill rows), never the padding row
    assert [s.num_tokens for s in tap.drain()] == [sum(len(p) for p in PROMPTS[:3]) + 2 * 3] * len(tiny.moe_layers)
    eng.close()


def test_steps_that_do_not_fit_the_buffers_never_take_the_padded_path(tiny, tmp_path: Path) -> None:
    """Shape reasons win over placement reasons: a missing expert with a too-long context, or forced routes
    with a too-large batch, decode plainly (no crash, and the path does not depend on placement)."""
    eng = _engine(tiny, tmp_path, "long", decode_graphs=True, resident_frac=0.25, graph_max_blocks=1)
    eng.generate(PROMPTS[:3], 3)  # prompt 3 has 20 tokens: more than one block
    assert eng.executors.reasons[Reason.CONTEXT_TOO_LONG] == 2
    eng.close()
    eng = _engine(tiny, tmp_path, "wide", decode_graphs=True, graph_max_batch=2)
    eng.set_hooks(forced_routes=_trace_router(tiny))
    eng.generate(PROMPTS[:3], 3)
    assert eng.executors.reasons == {Reason.PREFILL: 1, Reason.BATCH_TOO_LARGE: 2}
    eng.close()


def _trace_router(spec):
    from tierplan.runtime.engine.routing_trace import RoutingTrace
    from tierplan.runtime.engine.runner import ForcedRouter

    trace = RoutingTrace.load(Path(__file__).resolve().parents[2] / "data/routing/flame_moe_290m_sample.npz")
    return ForcedRouter(trace, spec=spec, device=torch.device("cpu"), horizon_tokens=256)


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
        g = eng.graphs
        assert g is not None and eng._pick(toks, rows, None) == (Executor.GRAPH, Reason.ALL_RESIDENT)
        bb = g.stage(seqs, toks, starts, rows, None)
        a = g.replay(seqs, starts, bb)
        assert a is not None
        a = a.cpu()
        b = g.run_padded_eager(seqs, starts, g.stage(seqs, toks, starts, rows, None)).cpu()
        return a, b
    finally:
        eng.close()


@pytest.mark.parametrize("batch", [3, 5])
def test_replayed_and_padded_eager_steps_are_bit_identical(tiny, tmp_path: Path, batch: int) -> None:
    a, b = replay_vs_padded_eager(tiny, "cpu", tmp_path, batch)
    assert torch.equal(a, b)
