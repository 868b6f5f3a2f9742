"""Miss-ratio curves from stack distances against brute-force LRU simulations, at every cache size."""

from __future__ import annotations

import numpy as np
import pytest

from tests.controller.test_predictors_caches import brute_force_lru_hits
from tierplan.controller.predictors.miss_ratio import MissRatioCurves


def _tokens(seed: int, num_tokens: int, num_experts: int, top_k: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(num_experts, 0.5))
    return np.stack([rng.choice(num_experts, top_k, replace=False, p=p) for _ in range(num_tokens)])  # [T, K]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_curve_equals_brute_force_lru_at_every_size(seed: int, batch: int) -> None:
    num_experts, top_k = 12, 3
    tokens = _tokens(seed, 240, num_experts, top_k)
    curves = MissRatioCurves(2, num_experts, batch_sizes=(1, 3, 8))
    for row in tokens:
        curves.observe_token(1, row)
    stream = []
    for s in range(len(tokens) // batch):
        flat = tokens[s * batch:(s + 1) * batch].ravel()
        _, first = np.unique(flat, return_index=True)
        stream.append(flat[np.sort(first)])
    stream = np.concatenate(stream)
    curve = curves.hit_rate_curve(1, batch)
    assert curve.shape == (num_experts + 1,) and curve[0] == 0.0
    for slots in range(1, num_experts + 1):
        assert curve[slots] == pytest.approx(brute_force_lru_hits(stream, slots) / stream.size, abs=1e-12)
    assert np.all(np.diff(curve) >= 0)
    per_step = curves.expected_misses_per_step(1, batch)
    assert curves.num_steps(1, batch) == len(tokens) // batch
    distinct = np.unique(stream).size
    assert per_step[num_experts] * curves.num_steps(1, batch) == pytest.approx(distinct)  # cold misses only
    assert curves.hit_rate_curve(0, batch).sum() == 0.0  # a layer never observed


def test_observe_step_matches_observe_token_unions() -> None:
    tokens = _tokens(3, 64, 8, 2)
    a = MissRatioCurves(1, 8, batch_sizes=(4,))
    b = MissRatioCurves(1, 8, batch_sizes=(4,))
    for row in tokens:
        a.observe_token(0, row)
    for s in range(16):
        b.observe_step(0, tokens[4 * s:4 * s + 4].ravel(), batch=4)
    assert np.array_equal(a.hit_rate_curve(0, 4), b.hit_rate_curve(0, 4))
    assert a.mean_union_size(0, 4) == pytest.approx(b.mean_union_size(0, 4))


def test_decay_follows_a_workload_change() -> None:
    curves = MissRatioCurves(1, 8, decay=0.05)
    for _ in range(200):
        curves.observe_token(0, np.array([0, 1]))  # a hot pair: hits with 2 slots
    assert curves.hit_rate_curve(0)[2] > 0.95
    for t in range(400):
        curves.observe_token(0, np.array([t % 8]))  # a cyclic scan over 8: LRU misses below 8 slots
    assert curves.hit_rate_curve(0)[7] < 0.05
    assert curves.hit_rate_curve(0)[8] > 0.9


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_sizes": (0,)}, "batch_sizes"), ({"decay": 1.0}, "decay"), ({"num_layers": 0}, "num_layers")])
def test_bad_arguments_are_refused(kwargs: dict, message: str) -> None:
    args = {"num_layers": 2, "num_experts": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        MissRatioCurves(**args)


def test_bad_observations_are_refused() -> None:
    curves = MissRatioCurves(2, 4)
    with pytest.raises(ValueError, match="layer 2"):
        curves.observe_token(2, np.array([0]))
    with pytest.raises(ValueError, match="expert 4"):
        curves.observe_token(0, np.array([4]))
    with pytest.raises(ValueError, match="batch 8 not tracked"):
        curves.hit_rate_curve(0, 8)


def test_tracked_batch_rounds_down_to_a_tracked_size() -> None:
    curves = MissRatioCurves(1, 4, batch_sizes=(1, 8, 32))
    assert [curves.tracked_batch(b) for b in (1, 7, 8, 31, 200)] == [1, 1, 8, 8, 32]


def test_real_steps_of_every_size_share_one_cache() -> None:
    """Decode steps of 2 tokens on a few experts, a prefill over every expert each 4th step: the decode curve
    is LRU over the whole interleaved stream (the prefill evicts the decode working set), not over the decode
    steps alone, which would read a hit where the shared cache misses."""
    from collections import OrderedDict

    rng = np.random.default_rng(0)
    num_experts = 12
    steps = [(16, rng.permutation(num_experts)) if s % 4 == 3 else (2, rng.choice(3, 2, replace=False))
             for s in range(80)]
    curves = MissRatioCurves(1, num_experts, batch_sizes=(2, 16))
    for batch, union in steps:
        curves.observe_step(0, union, batch)
    for slots in (2, 3, 6):
        cache: OrderedDict[int, None] = OrderedDict()
        hits = total = 0
        for batch, union in steps:
            for e in union.tolist():
                hit = e in cache
                if batch == 2:
                    hits, total = hits + hit, total + 1
                if hit:
                    cache.move_to_end(e)
                else:
                    cache[e] = None
                    if len(cache) > slots:
                        cache.popitem(last=False)
        assert curves.hit_rate_curve(0, 2)[slots] == pytest.approx(hits / total, abs=1e-12)
    alone = MissRatioCurves(1, num_experts, batch_sizes=(2,))
    for batch, union in steps:
        if batch == 2:
            alone.observe_step(0, union, 2)
    assert curves.hit_rate_curve(0, 2)[3] < alone.hit_rate_curve(0, 2)[3]  # the prefills' evictions count


def test_one_object_is_fed_one_way_and_a_size_that_stops_arriving_fades() -> None:
    curves = MissRatioCurves(1, 4, batch_sizes=(1, 4), decay=0.5)
    curves.observe_step(0, np.array([0]), 1)
    with pytest.raises(ValueError, match="fed by steps already"):
        curves.observe_token(0, np.array([1]))
    for _ in range(6):
        curves.observe_step(0, np.array([0, 1, 2, 3]), 4)
    assert curves.num_steps(0, 1) == pytest.approx(0.5 ** 6)  # decayed by every real step, not only its own
