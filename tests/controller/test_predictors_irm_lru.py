"""controller/predictors/irm_lru.py: the engine's expert cache's loads per step from the activation frequencies alone,
against the engine's rule walked over independent draws, and against the frequency cache it must never undercut."""

from __future__ import annotations

import numpy as np
import pytest

from tierplan.bench.phase_residency import ResidencyReplay
from tierplan.controller.demand import frequency_curve
from tierplan.controller.predictors.irm_lru import lru_curve


def _walk(probs: np.ndarray, top_k: int, batch: int, steps: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Loads per step of the engine's cache (bench/phase_residency.py's replay of `OnDemandExperts`) at every size,
    over `steps` steps of `batch` independent tokens after as many to warm it; and each expert's share of tokens
    in the walk (what the agent's activation counts report)."""
    rng = np.random.default_rng(seed)
    e = probs.size
    unions, counts = [], np.zeros(e)
    for _ in range(2 * steps):
        tokens = np.concatenate([rng.choice(e, size=top_k, replace=False, p=probs / top_k) for _ in range(batch)])
        counts += np.bincount(tokens, minlength=e)
        unions.append(np.unique(tokens))
    loads = np.zeros(e + 1)
    for slots in range(1, e + 1):
        replay = ResidencyReplay.of_layers(1, e)
        loads[slots] = np.mean([replay.step_needed([slots], [u]).misses[0] for u in unions][steps:])
    loads[0] = np.mean([u.size for u in unions])
    return loads, counts / (2 * steps * batch)


@pytest.mark.parametrize(("experts", "top_k", "batch"), [(8, 2, 2), (8, 2, 6), (32, 4, 1), (32, 4, 8), (64, 8, 16)])
def test_it_matches_an_lru_walk_over_independent_tokens(experts: int, top_k: int, batch: int) -> None:
    """Within 10% (or 0.15 loads) at every slot count, where a cache of the most frequent experts is off by up to
    half: the mean-field count (its expectation for the count) was off by 85% at 6 of 8 slots."""
    rng = np.random.default_rng(experts + batch)
    walk, per_token = _walk(top_k * rng.dirichlet(np.full(experts, 0.6)), top_k, batch, 1500, seed=batch)
    got, union = lru_curve(per_token, batch)
    assert got.shape == (experts + 1,) and got[0] == pytest.approx(union)
    assert np.all(np.diff(got) <= 1e-9)  # more slots never load more
    np.testing.assert_allclose(got[1:], walk[1:], rtol=0.10, atol=0.15)


def test_it_never_prices_fewer_loads_than_a_cache_of_the_most_frequent() -> None:
    """Given the slots' contents at a step's start, the step loads at least its needed experts not among them,
    at least the frequency curve's tail: no policy beats it, LRU least of all."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        e = int(rng.integers(4, 65))
        probs = np.minimum(2 * rng.dirichlet(np.full(e, 0.5)), 0.95)
        batch = float(rng.choice([1, 3, 8, 40]))
        lru, freq = lru_curve(probs, batch)[0], frequency_curve(probs, batch)[0]
        assert np.all(lru >= freq - 1e-6 * max(1.0, float(freq[0])))


def test_no_routed_expert_loads_nothing() -> None:
    got, union = lru_curve(np.zeros(8), 4)
    assert union == 0.0 and np.array_equal(got, np.zeros(9))


def test_the_demand_model_reuses_a_layers_curve_while_its_frequencies_hold() -> None:
    """A curve costs ~40 ms a layer; the forecast computes one again only once some expert's chance to be needed
    in a step moved past the tolerance, and a reused one is the very curve a fresh computation gives."""
    from tests.controller.loop_fixtures import Windows, make_controller
    from tierplan.controller.demand import CurveSource

    ctl, win = make_controller(), Windows()
    ctl.sync_from(win.next(batch=2, kv_live=10))
    dm = ctl.demand
    first = dm.forecast(CurveSource.FREQUENCY)
    computed = dm.lru_curves_computed
    assert computed >= len(dm.moe_layers)
    again = dm.forecast(CurveSource.FREQUENCY)  # nothing observed since: every curve reused
    assert dm.lru_curves_computed == computed and again.misses_per_step == first.misses_per_step
    fresh = [lru_curve(dm._token_probs(m), first.batch_tokens)[0] for m in range(len(dm.moe_layers))]
    assert [tuple(float(x) for x in c) for c in fresh] == list(first.misses_per_step)
    ctl.sync_from(win.next(batch=2, kv_live=12))  # a few tokens move a tiny model's frequencies past it
    dm.forecast(CurveSource.FREQUENCY)
    assert dm.lru_curves_computed > computed


def _full_grid(probs: np.ndarray, batch: float) -> np.ndarray:
    """lru_curve's model over every (gap, expert) cell in float64, each its own CDF, the sums over j written out."""
    from scipy.special import ndtr

    from tierplan.controller.predictors.irm_lru import MAX_GAP, rank_cdf

    q = 1.0 - (1.0 - probs) ** max(1.0, batch)
    q = q[q > 0]
    n = q.size
    absent = (1.0 - q)[None, :] ** np.arange(MAX_GAP)[:, None]  # [G, n]
    later = np.arange(n)[None, :] > np.arange(n)[:, None]  # [i, j] j served after i
    untouched = absent[:, None, :] * np.where(later, 1.0 - q[None, :], 1.0)[None, :, :]  # [G, i, j]
    touched = np.where(np.eye(n, dtype=bool)[None], 0.0, 1.0 - untouched)  # i itself not counted
    v = touched * (1.0 - touched)
    mean, var, m3 = touched.sum(-1), v.sum(-1), (v * (1.0 - 2.0 * touched)).sum(-1)  # [G, n]
    sd = np.maximum(np.sqrt(np.maximum(var, 0.0)), 1e-6)
    x = (np.arange(1, probs.size + 1)[None, None, :] - 0.5 - mean[..., None]) / sd[..., None]  # [G, n, E]
    below = ndtr(x) + (m3 / sd**3)[..., None] * (1.0 - x**2) * np.exp(-0.5 * x**2) / (6.0 * np.sqrt(2 * np.pi))
    below = np.maximum.accumulate(np.clip(below, 0.0, 1.0), axis=2)
    found = np.einsum("gn,gne->ne", q * q[None, :] * absent, below)  # [n, E]
    hits = (found * rank_cdf(q, probs.size)[:, 1:]).sum(axis=0)
    return np.maximum(q.sum() - np.concatenate([[0.0], hits]), 0.0)


@pytest.mark.parametrize(("experts", "top_k", "batch"), [(8, 2, 1), (8, 2, 5), (24, 4, 3)])
def test_the_pooled_float32_form_is_the_full_grid(experts: int, top_k: int, batch: int) -> None:
    """lru_curve sums over j as running sums, pools each expert's cells of like count and evaluates the CDFs in
    float32: within pooling's error of every cell priced on its own in float64."""
    rng = np.random.default_rng(experts * batch)
    probs = np.minimum(top_k * rng.dirichlet(np.full(experts, 0.5)), 0.95)
    got, union = lru_curve(probs, batch)
    np.testing.assert_allclose(got, _full_grid(probs, batch), rtol=0.02, atol=0.01 * union)
