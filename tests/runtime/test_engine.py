"""The reference engine on the CPU twin: exactness under tier moves, and refusals of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierplan.runtime.engine.moe as moe
from tierplan.agent.taps import AttentionMassTap
from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.kv import Tier
from tierplan.runtime.selfcheck.exact import auto_block_tokens, run_exact_check


@pytest.fixture(scope="module")
def tiny():
    return preset("tiny")


@pytest.mark.parametrize(("map_in", "poison", "publish"), [("beside_copy", False, "issued"),
                                                            ("before_copy", False, "issued"),
                                                            ("beside_copy", True, "issued"),
                                                            ("beside_copy", False, "done")])
def test_exact_with_a_quarter_of_experts_and_kv_spilled_every_step(tiny, tmp_path: Path, map_in: str,
                                                                    poison: bool, publish: str) -> None:
    """With the default (copies through the slot window, ranges mapped beside them by the link worker, absent
    experts unmapped, loads published once issued), with every range mapped before its copy, with absent experts
    poisoned, and with loads published once done."""
    r = run_exact_check(tiny, 0.25, workdir=tmp_path, expert_map_in=map_in, expert_poison=poison,
                        expert_publish=publish)  # type: ignore[arg-type]
    assert r.line() == "exact: max_abs_diff=0.0 tokens_equal=True ok"
    assert r.expert_misses_tight > r.expert_misses_full  # experts really moved
    assert r.kv_fetches > 0 and r.kv_spills > 0  # KV really left the GPU and came back


def test_exact_check_notices_a_corrupted_block(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check bites: flip bytes of a block parked on the CPU tier (not checksummed by default)."""
    from tierplan.runtime.engine.kv_cache import PagedKVCache

    real_spill = PagedKVCache.spill

    def spill_and_corrupt(self, block_ids, tier):
        block_ids = list(block_ids)
        real_spill(self, block_ids, tier)
        if tier is Tier.CPU and block_ids:
            mem = self.stores.memory(self.manager.location(block_ids[0]))
            mem[:64] ^= 0x55

    monkeypatch.setattr(PagedKVCache, "spill", spill_and_corrupt)
    r = run_exact_check(tiny, 0.5, workdir=tmp_path, new_tokens=4)
    assert r.max_abs_diff > 0.0 and not r.ok


def test_grouped_gemm_and_the_fallback_loop_agree(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    cfg = EngineConfig(block_tokens=auto_block_tokens(tiny), workdir=tmp_path / "a")
    eng = ReferenceEngine(tiny, Device("cpu"), cfg)
    a = eng.generate(prompts, 3)
    assert eng.experts.fast_path_layers > 0  # once all experts were loaded, no per-layer host sync
    eng.close()
    monkeypatch.setattr(moe, "HAS_GROUPED_MM", False)
    eng = ReferenceEngine(tiny, Device("cpu"), EngineConfig(block_tokens=cfg.block_tokens, workdir=tmp_path / "b"))
    b = eng.generate(prompts, 3)
    eng.close()
    assert torch.equal(a.logits, b.logits) and a.tokens == b.tokens


def test_bad_input_is_refused_with_the_field_named(tiny, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="resident_frac"):
        EngineConfig(resident_frac=0.0)
    with pytest.raises(ConfigError, match="spill_kv_every_step"):
        EngineConfig(spill_kv_every_step=True)
    with pytest.raises(ConfigError, match=r"expert_map_in must be one of 'beside_copy', 'before_copy' or 'on_read', "
                                          r"got 'gpu'"):
        EngineConfig(expert_map_in="gpu")  # type: ignore[arg-type]
    for old, new in (("link", "beside_copy"), ("worker", "before_copy")):  # renamed, refused: never an alias
        with pytest.raises(ConfigError, match=rf"expert_map_in '{old}' is an old name, no longer accepted: "
                           rf"use '{new}'"):
            EngineConfig(expert_map_in=old)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="multiple of 4096"):
        ReferenceEngine(tiny, Device("cpu"), EngineConfig(block_tokens=3, workdir=tmp_path / "x"))
    eng = ReferenceEngine(tiny, Device("cpu"), EngineConfig(block_tokens=auto_block_tokens(tiny),
                                                            workdir=tmp_path / "y"))
    try:
        with pytest.raises(ConfigError, match="vocabulary"):
            eng.generate([[tiny.vocab_size]], 2)
        with pytest.raises(ConfigError, match="prompt"):
            eng.generate([[]], 2)
        with pytest.raises(ConfigError, match="max_new_tokens"):
            eng.generate([[1]], 0)
        assert eng.generate([[1, 2]], 1).tokens  # still usable after the refusals
    finally:
        eng.close()


def test_the_layers_below_the_engine_default_to_its_config() -> None:
    """A pool, loader or transfer engine built by hand behaves as the engine's own: one default per knob."""
    import inspect

    from tierplan.runtime.memory.slots import ExpertSlotPool
    from tierplan.runtime.transfer import TransferEngine
    from tierplan.runtime.transfer_worker import LinkWorker
    from tierplan.runtime.weights.loader import ExpertLoadHandler

    def default(cls: type, name: str) -> object:
        return inspect.signature(cls.__init__).parameters[name].default

    cfg = EngineConfig()
    assert default(ExpertSlotPool, "poison_unmapped") is cfg.expert_poison
    # A hand-built loader reads through the ranges, as the engine does wherever its steps read the ranges; its
    # piecewise graphs through the slot table (the default on a GPU) map no range at load.
    assert default(ExpertLoadHandler, "map_in") == "beside_copy"
    assert cfg.expert_map_in is None and cfg.map_in_for(graphs=True) == "on_read"
    for ranges in (EngineConfig(expert_reads="range"), EngineConfig(offload_exec="eager"), cfg):
        assert ranges.map_in_for(graphs=ranges is not cfg) == "beside_copy"  # cfg: no graphs (the CPU default)
    assert EngineConfig(expert_map_in="beside_copy").map_in_for(graphs=True) == "beside_copy"
    assert default(ExpertLoadHandler, "publish") == cfg.expert_publish
    assert default(TransferEngine, "retire_thread") is default(LinkWorker, "retire_thread") \
        is cfg.transfer_retire_thread


def test_experts_generated_on_the_device_need_no_store_and_never_load(tiny, tmp_path: Path) -> None:
    cfg = EngineConfig(block_tokens=auto_block_tokens(tiny), experts_on_device=True, workdir=tmp_path)
    eng = ReferenceEngine(tiny, Device("cpu"), cfg)
    try:
        r = eng.generate([[1, 2, 3], [4, 5]], 3)
        assert eng.loader is None and eng.pinned is None and eng.nvme is None
        assert r.expert_misses == 0 and eng.experts.fast_path_layers > 0 and len(r.tokens[0]) == 3
    finally:
        eng.close()
    with pytest.raises(ConfigError, match="experts_on_device"):
        EngineConfig(experts_on_device=True, resident_frac=0.5)


def test_a_block_table_never_points_into_another_tier(tiny, tmp_path: Path) -> None:
    """Regression: the per-step block table read each block's index whatever its tier."""
    from tierplan.runtime.engine.attention import Segment, build_block_table

    cfg = EngineConfig(block_tokens=auto_block_tokens(tiny), kv_cpu_blocks=4, workdir=tmp_path)
    eng = ReferenceEngine(tiny, Device("cpu"), cfg)
    try:
        eng.cache.grow(0, 40)
        seg = Segment(0, 0, 40, 0)
        assert build_block_table([seg], eng.cache).shape == (1, eng.cache.num_blocks_for(40))
        eng.cache.spill(eng.cache.blocks_of(0)[:1], Tier.CPU)
        with pytest.raises(ConfigError, match="ensure_on_gpu"):
            build_block_table([seg], eng.cache)
    finally:
        eng.close()


def test_a_spill_moves_its_blocks_as_one_request(tiny, tmp_path: Path) -> None:
    """A plan's or a preemption's spill goes as one segmented request (one at a time paid a whole round trip
    per block): each block lands where it was sent, its bytes unchanged, and blocks already there are neither
    moved nor counted."""
    cfg = EngineConfig(block_tokens=auto_block_tokens(tiny), kv_cpu_blocks=8, workdir=tmp_path)
    eng = ReferenceEngine(tiny, Device("cpu"), cfg)
    cache, requests = eng.cache, []
    real_submit = cache.handler.engine.submit

    def submit(req):
        requests.append(req)
        return real_submit(req)

    try:
        cache.grow(0, 4 * cfg.block_tokens)
        blocks = cache.blocks_of(0)
        for i, b in enumerate(blocks):
            cache.stores.memory(cache.manager.location(b)).fill_(i + 1)
        cache.spill(blocks[:1], Tier.CPU)
        spills = cache.spills
        cache.handler.engine.submit = submit  # type: ignore[method-assign]
        cache.spill(blocks, Tier.CPU)
        assert [len(r.segments or ()) for r in requests] == [3]
        assert cache.spills == spills + 3
        for i, b in enumerate(blocks):
            loc = cache.manager.location(b)
            assert loc.tier is Tier.CPU and bool((cache.stores.memory(loc) == i + 1).all())
    finally:
        eng.close()


def test_freeze_gc_freezes_load_time_objects_until_close(tiny, tmp_path: Path) -> None:
    """freeze_gc=True: after construction the load-time objects sit in the permanent generation (a full
    collection skips them); close() gives them back to the collector. Generated tokens are unchanged."""
    import gc

    gc.unfreeze()
    cfg = EngineConfig(block_tokens=auto_block_tokens(tiny), freeze_gc=True, workdir=tmp_path)
    eng = ReferenceEngine(tiny, Device("cpu"), cfg)
    try:
        assert eng.gc_frozen and gc.get_freeze_count() > 1000
        out = eng.generate([[1, 2, 3]], 3).tokens
    finally:
        eng.close()
    assert not eng.gc_frozen and gc.get_freeze_count() == 0
    plain = ReferenceEngine(tiny, Device("cpu"), EngineConfig(block_tokens=cfg.block_tokens,
                                                              workdir=tmp_path / "plain"))
    try:
        assert not plain.gc_frozen and gc.get_freeze_count() == 0  # off by default on a CPU
        assert plain.generate([[1, 2, 3]], 3).tokens == out
    finally:
        plain.close()


def test_borrowed_dense_weights_give_the_engines_own_bits_and_are_checked(tiny, tmp_path: Path) -> None:
    """A bench draws the synthetic dense weights once and lends them to every engine: the logits are the bits an
    engine drawing its own gets; weights of another model (or beside a checkpoint) are refused, naming a tensor."""
    import dataclasses

    from tierplan.runtime.engine.weights import dense_weights_for, synthetic_dense_weights

    cfg = EngineConfig(block_tokens=auto_block_tokens(tiny), workdir=tmp_path)
    lent = synthetic_dense_weights(tiny, torch.device("cpu"), seed=cfg.seed)
    runs = []
    for dense in (None, lent):
        eng = ReferenceEngine(tiny, Device("cpu"), cfg, dense_weights=dense)
        try:
            assert (eng.model.w is lent) is (dense is not None)
            runs.append(eng.generate([[1, 2, 3], [4, 5]], 3))
        finally:
            eng.close()
    assert runs[0].tokens == runs[1].tokens and torch.equal(runs[0].logits, runs[1].logits)
    wider = dataclasses.replace(tiny, hidden_size=tiny.hidden_size * 2)
    with pytest.raises(ConfigError, match=r"dense_weights: embed is \(\d+, \d+\)"):
        dense_weights_for(tiny, torch.device("cpu"), cfg.seed, synthetic_dense_weights(wider, torch.device("meta")))
    with pytest.raises(ConfigError, match="checkpoint brings its own"):
        dense_weights_for(tiny, torch.device("cpu"), cfg.seed, lent, checkpoint=lent)


def test_long_prompts_attend_in_query_chunks_of_bounded_scores(tiny, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill segment whose scores [Hq, n, C] exceed the bound goes to SDPA in query chunks (a 42K-token prompt
    asked the H200 for 107 GiB in one call): every call stays under the bound, and the tokens and logits match
    the one-call path."""
    import tierplan.runtime.engine.attention as attn

    prompts = [list(range(1, 40)), [9, 8, 7]]
    cfg = EngineConfig(block_tokens=auto_block_tokens(tiny), workdir=tmp_path / "a")
    eng = ReferenceEngine(tiny, Device("cpu"), cfg)
    whole = eng.generate(prompts, 3)
    eng.close()
    bound = 4 * tiny.num_heads * 40  # four query rows a call at a 40-token context
    monkeypatch.setattr(attn, "MAX_SCORES_PER_CALL", bound)
    calls: list[int] = []
    real = attn._causal_sdpa

    def counted(q, k, v, first_pos, window):
        calls.append(q.shape[0] * q.shape[1] * k.shape[1])  # [Hq, n', D] x [Hq, C, D]: scores, at most
        return real(q, k, v, first_pos, window)

    monkeypatch.setattr(attn, "_causal_sdpa", counted)
    eng = ReferenceEngine(tiny, Device("cpu"), EngineConfig(block_tokens=cfg.block_tokens, workdir=tmp_path / "b"))
    chunked = eng.generate(prompts, 3)
    eng.close()
    assert calls and max(calls) <= bound and len(calls) > 2 * tiny.num_layers  # the 39-token prompt was split
    assert chunked.tokens == whole.tokens
    # A chunk after the first sees more keys than queries: lower-right causal, which the CPU runs on its math path
    # (float32) where the one call runs its flash kernel (bf16 accumulation): close, not equal.
    torch.testing.assert_close(chunked.logits, whole.logits, rtol=0, atol=1e-2)
    assert attn.query_chunks(10, 2, 3) == [(0, 10)] and attn.query_chunks(3, 10 ** 9, 10 ** 9) == [(0, 1), (1, 2),
                                                                                                 (2, 3)]


@pytest.mark.parametrize("first_pos", [0, 5])
@pytest.mark.parametrize("window", [0, 4])
def test_prefill_attention_masks_each_query_at_its_own_position(first_pos: int, window: int) -> None:
    """The prefill path's causal mask, a lower-right bias where no window is set: each of n queries at positions
    first_pos.. sees exactly the keys up to its position (within the window), as an explicit softmax does; the
    keys past the last query take no part."""
    import tierplan.runtime.engine.attention as attn

    g = torch.Generator().manual_seed(first_pos * 10 + window)
    n, h, d, extra = 4, 2, 8, 3
    ctx = first_pos + n
    q = torch.randn(h, n, d, generator=g)
    k, v = (torch.randn(h, ctx + extra, d, generator=g) for _ in range(2))
    k[:, ctx:], v[:, ctx:] = 1e4, 1e4  # keys past the context: a query that saw one would be ruined
    pos = torch.arange(first_pos, ctx)[:, None]
    cols = torch.arange(ctx + extra)[None, :]
    seen = (cols <= pos) & ((cols > pos - window) if window else True)
    scores = torch.einsum("hnd,hcd->hnc", q, k).div(d ** 0.5).masked_fill(~seen, float("-inf"))
    want = torch.einsum("hnc,hcd->hnd", scores.softmax(-1), v).transpose(0, 1)
    torch.testing.assert_close(attn._causal_sdpa(q, k, v, first_pos, window), want, rtol=1e-4, atol=1e-4)


def mixed_step_gaps(spec, device: str, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[float, torch.Tensor]:
    """Two sequences decode while a third prefills in one step, with the paged kernel and without (the same
    tokens both ways): the largest logit gap of a decode-only step between the two, the mixed step's gap per row
    [3]; asserts that only the kernel engines called the kernel, once a layer, with the two decode rows, and that
    a third kernel engine with a quarter of the experts resident (the rest streamed in) gives the same bits."""
    import tierplan.runtime.engine.kernels.paged_attention as paged

    calls: list[tuple[int, int | None]] = []
    real = paged.paged_decode_attention

    def counted(q, *args, **kwargs):
        calls.append((q.shape[0], kwargs.get("real_rows")))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(paged, "paged_decode_attention", counted)
    out, sampled = {}, {}
    # (kernel, share of experts holding a slot): the last run offloads three quarters of them
    for kernel, resident in ((False, 1.0), (True, 1.0), (True, 0.25)):
        eng = ReferenceEngine(spec, Device(device), EngineConfig(block_tokens=auto_block_tokens(spec),
                                                                 decode_kernel=kernel, decode_graphs=False,
                                                                 resident_frac=resident,
                                                                 workdir=workdir / f"{kernel}{resident}"))
        # contexts of several KV blocks each (a mass sample per block tells the sequences apart)
        eng.step([0, 1], [[3, 1, 4, 1, 5] * 9, [9, 2, 6] * 7], [0, 0])
        decode = eng.step([0, 1], [[7], [11]], [45, 21]).float().cpu()
        calls.clear()
        mass = AttentionMassTap(layers=tuple(range(spec.num_layers)), every_steps=1)
        mass.begin_step(0)
        eng.set_hooks(mass_observer=mass)
        # the prefill listed first: the mass tap samples it in every layer, as on the reference path
        mixed = eng.step([2, 0, 1], [[2, 7, 1, 8, 2, 8], [13], [17]], [0, 46, 22]).float().cpu()
        first = mass.drain()
        mass.begin_step(1)  # a decode listed first: sampled through the decode half's own block table
        eng.step([1, 0, 3], [[19], [23], [5, 5, 5, 5]], [23, 47, 0])
        sampled[kernel, resident] = first + mass.drain()
        misses = eng.experts.misses
        eng.close()
        # the decode rows, one batch a layer and step, its splits sized by the rows that hold a sequence
        assert calls == ([(2, 2)] * spec.num_layers * 2 if kernel else [])
        out[kernel, resident] = decode, mixed[[1, 2, 0]], misses  # rows as seq 0, 1, 2
    ref, got = sampled[False, 1.0], sampled[True, 1.0]
    assert [(m.block, m.samples) for m in got] == [(m.block, m.samples) for m in ref] and got
    assert all(abs(a.mass - b.mass) < 1e-3 for a, b in zip(got, ref, strict=True))
    # Moving experts changes no bit of the mixed path's output (the quarter-resident run loaded more: a real offload).
    assert torch.equal(out[True, 0.25][0], out[True, 1.0][0]) and torch.equal(out[True, 0.25][1], out[True, 1.0][1])
    assert out[True, 0.25][2] > out[True, 1.0][2]
    (kd, km, _), (rd, rm, _) = out[True, 1.0], out[False, 1.0]
    return (kd - rd).abs().max().item(), (km - rm).abs().amax(-1)


def test_a_step_that_mixes_prefill_and_decode_sends_its_decodes_to_the_paged_kernel(tiny, tmp_path: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch
                                                                                    ) -> None:
    """Two sequences decode while a third prefills in the same step: with the paged kernel on, the two decode rows
    go to it as one batch in every layer (through the reference path each decode segment cost its own gathers and
    SDPA call per layer: the H200's mixed steps took 340-430 ms against 45 ms for a prefill alone), the prefill
    rows to the reference path. Every row's logits are as close to the reference path's as a decode-only step's
    through the kernel are (its arithmetic differs in the last bits), the prefill row's too (its rows a subset)."""
    decode_gap, mixed_gap = mixed_step_gaps(tiny, "cpu", tmp_path, monkeypatch)
    assert 0 < decode_gap < 0.05 and mixed_gap.max().item() <= 2 * decode_gap
