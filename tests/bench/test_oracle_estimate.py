"""The oracle's search priced before it is measured (bench/oracle_estimate.py): Belady's counts on a stream by
hand and on random streams (never more misses with more slots), the price ranking splits by their misses, which
candidates are picked, and the phase runner measuring only the best priced of a wider pool."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest

from tierplan.bench.baselines.base import ExpertFuture, Split
from tierplan.bench.oracle_estimate import DryStep, belady_counts, estimate_tok_s, measure_order
from tierplan.bench.phase_predictor import Predictor
from tierplan.controller.model_shape import ModelShape


def _future(*layers: list[set[int]]) -> ExpertFuture:
    """A stream from each MoE layer's sets, step by step (`layers[m][t]`)."""
    return ExpertFuture(tuple(tuple(frozenset(layer[t]) for layer in layers) for t in range(len(layers[0]))), 1)


def test_belady_keeps_the_experts_used_soonest() -> None:
    # Two slots: step 1 loads expert 2 and must drop one of 0, 1 and 2; 0 and 1 come back before 2 does, so Belady
    # keeps them (LRU would have dropped 0 or 1 and missed again).
    counts = belady_counts(_future([{0, 1}, {2}, {0}, {1}, {2}]), (2,))
    assert [(c.hits, c.misses) for c in counts] == [(0, 2), (0, 1), (1, 0), (1, 0), (0, 1)]
    assert not any(c.over_slots for c in counts)
    # A step needing more experts than the layer's slots is over them (the engine runs it chunked); two layers add up.
    counts = belady_counts(_future([{0, 1, 2}, {0}], [{5}, {5}]), (2, 1))
    assert [(c.hits, c.misses, c.over_slots, c.extra_chunks) for c in counts] == [(0, 4, True, 1), (2, 0, False, 0)]
    # Seven experts in groups of two: four groups, three past the first.
    assert belady_counts(_future([set(range(7))]), (2,))[0].extra_chunks == 3
    with pytest.raises(ValueError, match=r"step 0 has 1 MoE layers, the split 2"):
        belady_counts(_future([{0}]), (1, 1))


def test_belady_never_misses_more_with_more_slots() -> None:
    rng = random.Random(7)
    for _ in range(40):
        steps = [set(rng.sample(range(12), rng.randint(1, 5))) for _ in range(rng.randint(5, 40))]
        future = _future(steps)
        misses = [sum(c.misses for c in belady_counts(future, (s,))) for s in range(1, 13)]
        assert misses == sorted(misses, reverse=True), misses
        assert misses[-1] == len(set().union(*steps))  # every expert resident: cold misses only


def _predictor() -> Predictor:
    shape = ModelShape(name="t", num_layers=2, moe_layers=(0, 1), num_experts=16, top_k=2, expert_bytes=1 << 20,
                       dense_bytes=0, kv_bytes_per_token=64, block_tokens=16)
    return Predictor.for_shape(shape, 1024, 2e9, memory_bytes_per_s=1e11)  # each active expert read: 0.01 ms


def test_the_price_ranks_splits_by_the_loads_they_make() -> None:
    rng = random.Random(3)
    layers = [[set(rng.sample(range(16), 4)) for _ in range(60)] for _ in range(2)]
    future = _future(*layers)
    steps = [DryStep(0, 2, 2, 64 + t, 0) for t in range(60)]
    tok_s = [estimate_tok_s(_predictor(), Split((s, s), 8), future, steps, 4) for s in (4, 8, 12, 16)]
    assert tok_s == sorted(tok_s) and tok_s[0] < tok_s[-1], tok_s  # fewer misses, then none chunked: faster
    # KV blocks moved by swaps cost time too; a replay shorter than its warm-up is priced at its last step, as a row
    # measures it.
    swapping = [dataclasses.replace(s, kv_moved_blocks=40) for s in steps]
    assert estimate_tok_s(_predictor(), Split((16, 16), 8), future, swapping, 4) < tok_s[-1]
    last = estimate_tok_s(_predictor(), Split((16, 16), 8), future, steps, 59)
    assert last > 0 and estimate_tok_s(_predictor(), Split((16, 16), 8), future, steps, 60) == last


def test_a_layer_run_in_groups_pays_each_group_past_its_first(monkeypatch: pytest.MonkeyPatch) -> None:
    import tierplan.bench.oracle_estimate as oe

    future = _future([set(range(6))] * 10, [set(range(6))] * 10)
    steps = [DryStep(0, 6, 6, 64, 0)] * 10  # 6 tokens out a step

    def step_ms(slots: int) -> float:  # the priced ms a step, past the 2 warm-up steps
        return 6 / estimate_tok_s(_predictor(), Split((slots, slots), 8), future, steps, 2) * 1e3

    charge, charged, whole = oe.CHUNK_MS, step_ms(1), step_ms(6)
    monkeypatch.setattr(oe, "CHUNK_MS", 0.0)
    # One slot a layer: 6 groups, 5 past the first, in each of 2 layers; 6 slots: one group, nothing charged.
    assert charge > 0 and charged == pytest.approx(step_ms(1) + 10 * charge)
    assert whole == pytest.approx(step_ms(6))


def test_the_saved_are_tried_first_then_the_best_priced() -> None:
    labels = ["a", "b", "c", "d"]
    est = {"a": 10.0, "b": 30.0, "c": 20.0}  # d: its dry replay refused the split
    assert measure_order(labels, est, set()) == ["b", "c", "a"]  # never the unpriced one
    assert measure_order(labels, est, {"c"}) == ["c", "b", "a"]  # a saved one first: it counts among those measured
    assert measure_order(labels, est, {"d", "a"}) == ["a", "d", "b", "c"]  # saved ones in pool order, priced or not


def test_the_phase_runner_measures_only_the_best_priced_splits(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import tierplan.bench.phase as phase
    from tierplan.bench.phase_grid import QUICK

    sizes = dataclasses.replace(QUICK, oracle_max_splits=1, oracle_priced_splits=3)
    monkeypatch.setattr(phase, "QUICK", sizes)
    real_measure, real_price, ran, priced = phase.measure, phase.estimate_tok_s, [], []

    def measure(h: Any, ctx: Any, policy: Any, *a: Any, **kw: Any) -> Any:
        if policy.name == "oracle":
            ran.append(ctx.split)
        return real_measure(h, ctx, policy, *a, **kw)

    def price(predictor: Any, split: Split, *a: Any) -> float:
        real_price(predictor, split, *a)  # the real pricing runs; the test then ranks the middle split first
        priced.append(split)
        return 100.0 if len(priced) % 3 == 2 else 1.0

    monkeypatch.setattr(phase, "measure", measure)
    monkeypatch.setattr(phase, "estimate_tok_s", price)
    quiet = type("Quiet", (), {"print": staticmethod(lambda *_a, **_k: None)})()
    path = phase.run_phase_bench(tmp_path / "a", quick=True, point_spec="b4c32f0.4", policies=("oracle",),
                                 console=quiet)
    rows = phase.load_rows(path["tiny"])
    assert len(priced) == 3 and ran == [priced[1]]  # three priced, the best priced alone run
    cands = [r for r in rows if r["status"] == "candidate"]
    oracle = next(r for r in rows if r["policy"] == "oracle" and r["status"] != "candidate")
    assert len(cands) == 1 and oracle["oracle_split"] == cands[0]["oracle_split"]
    assert oracle["notes"].count("tok/s priced") == 2 and sorted(oracle["oracle_priced"].values()) == [1.0, 1.0, 100.0]

    # A best priced split the run refuses makes way for the next in the order.
    refuse = {"left": 1}

    def refusing(h: Any, ctx: Any, policy: Any, *a: Any, **kw: Any) -> Any:
        if policy.name == "oracle" and refuse["left"]:
            refuse["left"] -= 1
            ran.append(ctx.split)
            raise phase.RunRefused("the point cannot run under this plan: a test's refusal")
        return measure(h, ctx, policy, *a, **kw)

    monkeypatch.setattr(phase, "measure", refusing)
    priced.clear()
    ran.clear()
    path = phase.run_phase_bench(tmp_path / "b", quick=True, point_spec="b4c32f0.4", policies=("oracle",),
                                 console=quiet)
    oracle = next(r for r in phase.load_rows(path["tiny"]) if r["policy"] == "oracle" and r["status"] != "candidate")
    assert len(ran) == 2 and ran[0] == priced[1] and ran[1] != priced[1]
    assert "a test's refusal" in oracle["notes"] and oracle["oracle_split"] != _label(priced[1])


def _label(split: Split) -> str:
    return f"{split.expert_slots} slots {list(split.expert_slots_per_layer)}/{split.kv_gpu_blocks} KV"
