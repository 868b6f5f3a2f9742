"""Loads-per-step curves against the engine's expert residency (bench/phase_residency.py's replay, itself held to
the runtime's `OnDemandExperts`), at every cache size."""

from __future__ import annotations

import numpy as np
import pytest

from tests.controller.test_predictors_caches import brute_force_lru_hits
from tierplan.bench.phase_residency import ResidencyReplay
from tierplan.controller.predictors.miss_ratio import MissRatioCurves


def _tokens(seed: int, num_tokens: int, num_experts: int, top_k: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(num_experts, 0.5))
    return np.stack([rng.choice(num_experts, top_k, replace=False, p=p) for _ in range(num_tokens)])  # [T, K]


def _engine_loads(unions: list[np.ndarray], num_experts: int, slots: int) -> np.ndarray:
    """Loads of each step at `slots` slots of one layer, by the engine's rule."""
    replay = ResidencyReplay.of_layers(1, num_experts)
    return np.array([replay.step_needed([slots], [np.sort(u)]).misses[0] for u in unions], float)


def _steps(seed: int, num_steps: int, num_experts: int, top_k: int, batch: int) -> list[np.ndarray]:
    """Steps of 1..batch tokens (a continuous batch swings), a prefill of 8x the batch in every 20th."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(num_experts, 0.5))
    out = []
    for s in range(num_steps):
        n = 8 * batch if s % 20 == 19 else int(rng.integers(max(1, batch // 2), batch + 1))
        out.append(np.unique(np.concatenate([rng.choice(num_experts, top_k, replace=False, p=p) for _ in range(n)])))
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("num_experts", "top_k", "batch"), [(8, 2, 1), (8, 2, 4), (32, 4, 2), (32, 4, 16),
                                                             (64, 8, 8), (64, 8, 64)])
def test_the_curve_prices_the_engines_loads_at_every_size(seed: int, num_experts: int, top_k: int,
                                                          batch: int) -> None:
    """Within 8 % (or 0.2 loads a step) of the engine's rule replayed over the same steps at every slot count,
    unions past the slots included; a per-access LRU (Mattson's distances) is not, where unions near the slots."""
    unions = _steps(seed, 400, num_experts, top_k, batch)
    curves = MissRatioCurves(1, num_experts)
    for u in unions:
        curves.observe_step(0, u)
    got = curves.expected_misses_per_step(0)
    assert got.shape == (num_experts + 1,) and got[0] == pytest.approx(np.mean([u.size for u in unions]))
    assert np.all(np.diff(got) <= 1e-9)  # more slots never load more
    for slots in range(1, num_experts + 1):
        engine = _engine_loads(unions, num_experts, slots).mean()
        assert got[slots] == pytest.approx(engine, rel=0.08, abs=0.2), slots
    distinct = len(np.unique(np.concatenate(unions)))
    assert got[num_experts] * curves.num_steps(0) == pytest.approx(distinct)  # cold misses only
    assert MissRatioCurves(2, num_experts).hit_rate_curve(1).sum() == 0.0  # a layer never observed


def _per_access_lru_loads(unions: list[np.ndarray], slots: int) -> float:
    """Loads a step of a per-access LRU cache (Mattson's) over the steps' experts in order."""
    stream = np.concatenate(unions)
    return (stream.size - brute_force_lru_hits(stream, slots)) / len(unions)


def test_a_step_never_evicts_what_it_still_needs() -> None:
    """Six experts a step at 6 slots, the next step one new expert and five of the six: the engine loads one and
    keeps the five (it evicts outside the step's union); a per-access LRU evicts each next one (6 loads)."""
    unions = [np.arange(6), np.array([6, 0, 1, 2, 3, 4])] * 40
    curves = MissRatioCurves(1, 8)
    for u in unions:
        curves.observe_step(0, u)
    engine = _engine_loads(unions, 8, 6)
    assert np.all(engine[2:] == engine[2])
    assert curves.expected_misses_per_step(0)[6] == pytest.approx(engine.mean(), rel=0.05)
    assert _per_access_lru_loads(unions, 6) > 2.5 * engine.mean()


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
    prices the decode steps in the one cache every step shares (the prefill evicts the decode working set), not
    over the decode steps alone, which would read a hit where the shared cache misses."""
    rng = np.random.default_rng(0)
    num_experts = 12
    steps = [(16, rng.permutation(num_experts)) if s % 4 == 3 else (2, rng.choice(3, 2, replace=False))
             for s in range(80)]
    curves = MissRatioCurves(1, num_experts, batch_sizes=(2, 16))
    for batch, union in steps:
        curves.observe_step(0, union, batch)
    decode = np.array([batch == 2 for batch, _ in steps])
    for slots in (2, 3, 6):
        engine = _engine_loads([u for _, u in steps], num_experts, slots)[decode].mean()
        assert curves.expected_misses_per_step(0, 2)[slots] == pytest.approx(engine, rel=0.06, abs=0.05)
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
