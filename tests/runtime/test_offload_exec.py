"""Executors for offloaded decode through the CPU twin: forced routes inside graphs, piecewise steps whose
layer misses load as one list (and the layer-ahead window), the scan rule, and KV fetches as one list."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.executor import Executor, Reason
from tierplan.runtime.engine.experts import OnDemandExperts
from tierplan.runtime.engine.hooks import ModelHooks
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.engine.routing_trace import RoutingTrace
from tierplan.runtime.engine.runner import ForcedRouter
from tierplan.runtime.engine.victims import ScanVictimOrder
from tierplan.runtime.selfcheck.exact import auto_block_tokens, run_exact_check

TRACE = Path(__file__).resolve().parents[2] / "data/routing/flame_moe_290m_sample.npz"
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [5] * 20, [11, 12]]


@pytest.fixture(scope="module")
def tiny():
    return preset("tiny")


def _router(spec, device: str = "cpu") -> ForcedRouter:
    return ForcedRouter(RoutingTrace.load(TRACE), spec=spec, device=torch.device(device), horizon_tokens=512)


def _engine(spec, tmp_path: Path, name: str, device: str = "cpu", hooks: ModelHooks | None = None,
            **kw) -> ReferenceEngine:
    kw.setdefault("decode_kernel", True)
    cfg = EngineConfig(block_tokens=auto_block_tokens(spec), workdir=tmp_path / name, **kw)
    return ReferenceEngine(spec, Device(device), cfg, hooks=hooks)


def forced_graph_vs_eager(spec, device: str, tmp_path: Path) -> None:
    """Forced routes: every decode step replays the whole graph (none falls back) with the bits of eager."""
    out = {}
    for graphs in (False, True):
        eng = _engine(spec, tmp_path, f"f{graphs}", device, hooks=ModelHooks(forced_routes=_router(spec, device)),
                      decode_graphs=graphs, experts_on_device=True)
        out[graphs] = eng.generate(PROMPTS, 5)
        if graphs:
            assert eng.executors.reasons == {Reason.PREFILL: 1, Reason.ALL_RESIDENT: 4}
        eng.close()
    assert out[False].tokens == out[True].tokens
    assert torch.equal(out[False].logits, out[True].logits)


def test_forced_routes_replay_the_graph_with_eager_bits(tiny, tmp_path: Path) -> None:
    forced_graph_vs_eager(tiny, "cpu", tmp_path)


def test_forced_routes_are_the_ones_used_and_tapped(tiny, tmp_path: Path) -> None:
    """The graph's tap buffers hold the trace's routes, not the router's."""
    router = _router(tiny)
    eng = _engine(tiny, tmp_path, "t", hooks=ModelHooks(forced_routes=router), decode_graphs=True,
                  experts_on_device=True)
    eng.generate(PROMPTS[:2], 2)
    g = eng.graphs
    assert g is not None
    rows = router.trace_rows([0, 1], [len(PROMPTS[0]), len(PROMPTS[1])], [1, 1])
    for m in range(len(tiny.moe_layers)):
        assert torch.equal(g.route_ids[m, :2], router.ids[rows, m])
    eng.close()


@pytest.mark.parametrize("mode", ["piecewise", "lookahead", "range", "eager", "on_read"])
@pytest.mark.parametrize("store", ["nvme", "pinned"])
def test_each_execution_mode_keeps_the_bits_and_really_runs(tiny, tmp_path: Path, mode: str, store: str) -> None:
    """From the pinned store a step's misses are issued on the engine thread (`submit_now`), from NVMe queued."""
    from tierplan.runtime.weights.loader import StoreKind

    r = run_exact_check(tiny, 0.5, workdir=tmp_path, num_prompts=2, new_tokens=4, decode_kernel=True,
                        decode_graphs=True, mode=mode, expert_store=StoreKind(store))
    assert r.line() == "exact: max_abs_diff=0.0 tokens_equal=True ok"
    assert r.mode_steps == 3 and r.ok and r.expert_misses_tight > r.expert_misses_full


def test_exact_check_fails_when_its_mode_never_ran(tiny, tmp_path: Path) -> None:
    """3 prompts x top-2 can need 6 experts of a layer; 4 slots cannot hold them: no step runs piecewise."""
    r = run_exact_check(tiny, 0.25, workdir=tmp_path, num_prompts=3, new_tokens=2, decode_kernel=True,
                        decode_graphs=True, mode="piecewise")
    assert r.max_abs_diff == 0.0 and r.mode_steps == 0 and not r.ok


def test_a_layers_misses_load_as_one_list_and_the_window_prefetches(tiny, tmp_path: Path) -> None:
    for lookahead in (0, 1):
        eng = _engine(tiny, tmp_path, f"l{lookahead}", hooks=ModelHooks(forced_routes=_router(tiny)),
                      decode_graphs=True, resident_frac=0.5, expert_lookahead_layers=lookahead)
        assert eng.loader is not None
        calls: list[tuple[str, int, int]] = []
        real_many, real_one = eng.loader.load_many, eng.loader.load

        def many(layer, experts, *a, _r=real_many, _c=calls, **k):
            _c.append(("many", layer, len(experts)))
            return _r(layer, experts, *a, **k)

        def one(layer, expert, *a, _r=real_one, _c=calls, **k):
            _c.append(("one", layer, 1))
            return _r(layer, expert, *a, **k)

        eng.loader.load_many, eng.loader.load = many, one  # type: ignore[method-assign]
        eng.generate(PROMPTS[:2], 4)
        assert eng.executors.steps[Executor.PIECEWISE] == 3
        assert calls and all(kind == "many" for kind, _, _ in calls)
        if lookahead:
            assert eng.experts.prefetched > 0 and eng.experts.prefetch_hits > 0
        else:
            assert eng.experts.prefetched == 0
        eng.close()


def test_a_steps_misses_go_to_the_link_at_once_and_a_prefetch_does_not(tiny, tmp_path: Path) -> None:
    """The list a layer waits for is issued whole on the engine's thread (`TransferEngine.submit_now`: none of it
    waits behind the link's in-flight bound or for the worker); the window's prefetch is queued for the worker,
    bounded, so more urgent traffic still passes it."""
    for lookahead in (0, 1):
        eng = _engine(tiny, tmp_path, f"a{lookahead}", hooks=ModelHooks(forced_routes=_router(tiny)),
                      decode_graphs=True, resident_frac=0.5, expert_lookahead_layers=lookahead)
        assert eng.loader is not None
        calls: list[str] = []
        real_submit, real_now = eng.transfer.submit, eng.transfer.submit_now

        def submit(req, _r=real_submit, _c=calls):
            _c.append("queued")
            return _r(req)

        def submit_now(req, _r=real_now, _c=calls):
            _c.append("now")
            return _r(req)

        eng.transfer.submit, eng.transfer.submit_now = submit, submit_now  # type: ignore[method-assign]
        eng.generate(PROMPTS[:2], 4)
        assert eng.experts.misses > 0 and "now" in calls
        if lookahead:
            assert eng.experts.prefetched > 0 and "queued" in calls
        else:
            assert "queued" not in calls
        eng.close()


def test_scan_rule_keeps_a_subset_where_lru_hits_nothing(tiny, tmp_path: Path) -> None:
    """Mixtral's B=16, F=0.5 geometry scaled down: four groups of 2 experts, each needed whole, in a cycle through
    4 slots (half the union). LRU evicts every expert just before its next use; the scan rule keeps a subset."""
    rates = {}
    for rule in ("lru", "scan"):
        eng = _engine(tiny, tmp_path, rule, resident_frac=0.25, decode_graphs=False)
        ex: OnDemandExperts = eng.experts
        if rule == "scan":
            ex.set_victim_order(ScanVictimOrder(ex))
        for _ in range(8):
            ex.begin_step()
            for layer, group in ((0, [0, 1]), (0, [2, 3]), (1, [0, 1]), (1, [2, 3])):
                ex.ensure(layer, group)
                ex.done_reading(layer, group)
        rates[rule] = ex.hit_rate
        eng.close()
    assert rates["lru"] == 0.0 and rates["scan"] > 0.15, rates


def test_kv_fetches_a_steps_blocks_as_one_list_by_the_plugged_order(tiny, tmp_path: Path) -> None:
    eng = _engine(tiny, tmp_path, "kv", decode_graphs=False, kv_gpu_blocks=4, kv_cpu_blocks=8)
    c = eng.cache
    for s in range(2):
        c.grow(s, 2 * c.block_tokens)
    c.spill(c.blocks_of(0) + c.blocks_of(1), eng.cache.manager.location(0).tier.__class__("cpu"))
    ranked: list[list[int]] = []
    c.set_victim_order(lambda bs: ranked.append(list(bs)) or bs[::-1])
    events: list[str] = []
    real = c.handler.move_list

    def move_list(bs, dst, *a, **k):
        events.append(f"issue {len(bs)}")
        futs = real(bs, dst, *a, **k)
        for fut in futs:
            wait = fut.wait
            fut.wait = lambda *x, _w=wait, **y: (events.append("wait"), _w(*x, **y))[1]  # type: ignore[method-assign]
        return futs

    c.handler.move_list = move_list  # type: ignore[method-assign]
    c.ensure_on_gpu(c.blocks_of(0) + c.blocks_of(1))
    # One list issued, then waited (the last first: those done by then need no wait of their own), all landed.
    assert events[0] == "issue 4" and events[1:] and set(events[1:]) == {"wait"}
    assert all(c.manager.location(b).tier.value == "gpu" for b in c.blocks_of(0) + c.blocks_of(1))
    c.grow(2, c.block_tokens, protect=set(c.blocks_of(0)))  # the GPU is full: the plugged order picks the victim
    assert ranked and c.manager.location(c.blocks_of(1)[-1]).tier.value == "cpu"
    eng.close()


def test_a_load_started_ahead_counts_as_a_prefetch_hit_at_its_first_use_even_after_it_landed(
        tiny, tmp_path: Path) -> None:
    """A later load_async drops landed loads from the in-flight set; their layer's first ask still counts a
    prefetch hit (the phase rows price the share of loads issued ahead from it), a second ask a plain hit, and an
    expert evicted before its use is a miss."""
    eng = _engine(tiny, tmp_path, "ahead", resident_frac=0.5)
    try:
        ex = eng.experts
        layer = eng.spec.moe_layers[0]
        absent = [e for e in range(eng.spec.num_experts) if not ex.pool.is_resident(layer, e)][:3]
        assert len(absent) == 3
        for e in absent:
            ex.load_async(layer, e).wait()
        assert (layer, absent[0]) not in ex._inflight  # dropped by the next load_async: it had landed
        hits, ahead = ex.hits, ex.prefetch_hits
        ex.evict(layer, absent[2])
        ex.ensure(layer, absent[:2])
        assert ex.prefetch_hits - ahead == 2 and ex.hits - hits == 2
        ex.ensure(layer, absent[:2])
        assert ex.prefetch_hits - ahead == 2 and ex.hits - hits == 4
        misses = ex.misses
        ex.ensure(layer, absent[2:])
        assert ex.prefetch_hits - ahead == 2 and ex.misses == misses + 1
    finally:
        eng.close()
