"""Demand models: transition table, co-activation features, the learned blend, shadow promotion, router signal."""

from __future__ import annotations

import numpy as np
import pytest

from tests.controller.test_predictors_caches import random_trace
from tierplan.controller.eval.expert_cache import replay, step_unions
from tierplan.controller.predictors.base import DemandPredictor
from tierplan.controller.predictors.caches import LRUPolicy
from tierplan.controller.predictors.cooccurrence import CoactivationFeatures, feature_stream
from tierplan.controller.predictors.cost_aware import CostAwarePolicy
from tierplan.controller.predictors.learned import Backend, LearnedDemandPredictor, RecordedScores
from tierplan.controller.predictors.router_signal import RouterLookaheadPredictor
from tierplan.controller.predictors.shadow import ShadowEvaluator
from tierplan.controller.predictors.transition import CompactTransition, TransitionTable, compact_score_stream
from tierplan.controller.routing_npz import synthetic_routing


def mapped_trace(num_tokens: int = 400, num_experts: int = 8, seed: int = 0):
    """Layer 1 routes to (layer-0 expert + 1) % E with probability 0.9: a strong cross-layer signal."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, num_experts, num_tokens)
    second = np.where(rng.random(num_tokens) < 0.9, (first + 1) % num_experts, rng.integers(0, num_experts,
                                                                                           num_tokens))
    ids = np.stack([first, second], axis=1)[:, :, None]  # [T, 2, 1]
    return synthetic_routing(ids, num_experts)


def _online_scores(predictor: DemandPredictor, unions, num_layers: int, num_experts: int) -> np.ndarray:
    predictor.reset(num_layers, num_experts)
    out = np.zeros((len(unions), num_layers, num_experts))
    for s, per_layer in enumerate(unions):
        for layer, ids in enumerate(per_layer):
            out[s, layer] = predictor.scores(s, layer)
            predictor.observe(s, layer, ids)
    return out


def test_transition_table_learns_the_mapping_and_ships_top_m_rows() -> None:
    trace = mapped_trace()
    table = TransitionTable(2, 8, top_m=3)
    for t in range(trace.num_tokens):
        for layer in range(2):
            table.observe(t, layer, trace.row(t, layer))
    for i in range(8):
        assert int(table.predict(0, np.array([i])).argmax()) == (i + 1) % 8
    rows = table.to_rows()
    assert all(isinstance(r, tuple) and len(r) == 4 for r in rows)
    assert len(rows) <= 8 * 3 and {r[0] for r in rows} == {0}
    for i in range(8):
        probs = [p for layer, src, dst, p in rows if src == i]
        assert probs == sorted(probs, reverse=True) and probs[0] > 0.8
    v1 = table.snapshot().version
    assert table.snapshot().version == v1  # no new observations: same version
    table.observe(999, 0, np.array([0]))
    assert table.snapshot().version == v1 + 1


def test_compact_table_with_every_row_predicts_like_the_table() -> None:
    trace = random_trace(4, num_layers=3)
    table = TransitionTable(3, 8, top_m=8)
    for t in range(trace.num_tokens):
        for layer in range(3):
            table.observe(t, layer, trace.row(t, layer))
    agent = CompactTransition(table.snapshot())
    for layer in range(2):
        src = trace.row(5, layer)
        assert np.allclose(agent.predict(layer, src), table.predict(layer, src))


def test_compact_table_refuses_bad_rows() -> None:
    snap = TransitionTable(2, 4).snapshot()
    bad = type(snap)(snap.version, 2, 4, ((0, 1, 9, 0.5),), snap.marginals)
    with pytest.raises(ValueError, match="outside"):
        CompactTransition(bad)


@pytest.mark.parametrize("batch", [1, 3])
def test_online_features_equal_the_vectorized_stream(batch: int) -> None:
    trace = random_trace(3, num_tokens=150, num_layers=3, skew=0.5)
    unions = step_unions(trace, batch)
    batch_feats, labels = feature_stream(unions, 3, 8, chunk_steps=5)
    online = CoactivationFeatures(chunk_steps=5)
    online.reset(3, 8)
    for s, per_layer in enumerate(unions):
        for layer, ids in enumerate(per_layer):
            assert np.array_equal(online.features(s, layer), batch_feats[s, layer])
            online.observe(s, layer, ids)
    assert labels.sum() == sum(u.size for per_layer in unions for u in per_layer)


@pytest.mark.parametrize("backend", [Backend.LOGISTIC, Backend.LIGHTGBM])
def test_learned_online_scores_equal_score_stream(backend: Backend) -> None:
    trace = random_trace(5, num_tokens=200, num_layers=3, skew=0.5)
    unions = step_unions(trace, 1)
    model = LearnedDemandPredictor(backend, chunk_steps=8, min_rows=300)
    stream = model.score_stream(unions, 3, 8)
    assert model.num_fits >= 2
    online = _online_scores(LearnedDemandPredictor(backend, chunk_steps=8, min_rows=300), unions, 3, 8)
    assert np.allclose(stream, online, atol=1e-12)
    assert ((stream >= 0) & (stream <= 1)).all()


def test_score_stream_is_causal() -> None:
    trace = random_trace(6, num_tokens=200, num_layers=2)
    unions = step_unions(trace, 1)
    changed = [list(u) for u in unions]
    for s in range(120, 200):
        changed[s] = [np.array([0, 1]), np.array([2, 3])]
    a = LearnedDemandPredictor(min_rows=200).score_stream(unions, 2, 8)
    b = LearnedDemandPredictor(min_rows=200).score_stream(changed, 2, 8)
    assert np.array_equal(a[:120], b[:120])  # the first 120 steps cannot see what follows
    assert not np.array_equal(a[121:], b[121:])


def test_learned_predictor_finds_the_cross_layer_mapping() -> None:
    trace = mapped_trace(num_tokens=600)
    unions = step_unions(trace, 1)
    stream = LearnedDemandPredictor(min_rows=400).score_stream(unions, 2, 8)
    top = stream[300:, 1].argmax(axis=1)
    truth = np.array([u[1][0] for u in unions[300:]])
    assert (top == truth).mean() > 0.8


class _Constant:
    def __init__(self, name: str, value: float) -> None:
        self.name, self.version, self.value = name, 1, value

    def reset(self, num_layers: int, num_experts: int) -> None:
        self.num_experts = num_experts

    def observe(self, step: int, layer: int, expert_ids: np.ndarray) -> None:
        pass

    def scores(self, step: int, layer: int) -> np.ndarray:
        return np.full(self.num_experts, self.value)


def _feed(predictor: DemandPredictor, trace) -> None:
    predictor.reset(trace.num_layers, trace.num_experts)
    for t in range(trace.num_tokens):
        for layer in range(trace.num_layers):
            predictor.scores(t, layer)
            predictor.observe(t, layer, trace.row(t, layer))


def test_shadow_promotes_a_better_candidate_only_after_enough_windows() -> None:
    trace = mapped_trace(num_tokens=640)
    shadow = ShadowEvaluator(_Constant("uniform", 0.5), LearnedDemandPredictor(min_rows=200), window_steps=64,
                             windows_required=3)
    _feed(shadow, trace)
    assert [p.promoted for p in shadow.promotions] == ["learned-logistic"]
    assert shadow.promotions[0].window >= 2  # windows 0, 1, 2 all won first
    assert shadow.active.name == "learned-logistic"
    assert all(w.shadow_loss < w.active_loss for w in shadow.history[:3])


def test_shadow_keeps_the_active_predictor_when_the_candidate_is_worse() -> None:
    trace = mapped_trace(num_tokens=640)
    shadow = ShadowEvaluator(LearnedDemandPredictor(min_rows=200), _Constant("uniform", 0.5), window_steps=64)
    _feed(shadow, trace)
    assert shadow.promotions == [] and shadow.active.name == "learned-logistic"


def test_router_signal_is_served_and_fallbacks_are_counted() -> None:
    p = RouterLookaheadPredictor(_Constant("base", 0.1), top_k=2)
    p.reset(2, 4)
    p.provide(0, 1, np.array([0.7, 0.2, 0.05, 0.05]))
    s = p.scores(0, 1)
    assert s.argmax() == 0 and s[0] == 1.0 and s.max() <= 1.0
    p.observe(0, 1, np.array([0, 1]))
    assert np.allclose(p.scores(1, 1), 0.1) and p.num_fallbacks == 1
    with pytest.raises(ValueError, match="4 finite probabilities"):
        p.provide(1, 1, np.array([1.0, 0.0]))


def test_load_budget_bounds_a_noisy_prefetcher() -> None:
    trace = random_trace(8, num_tokens=600, num_layers=3, skew=1.0)
    unions = step_unions(trace, 1)
    noisy = np.random.default_rng(0).uniform(0.3, 0.9, size=(len(unions), 3, 8))  # confident and useless
    lru = replay(trace, LRUPolicy(), 0.5, 1, unions)
    free = replay(trace, CostAwarePolicy("free", RecordedScores("n", noisy)), 0.5, 1, unions)
    capped = replay(trace, CostAwarePolicy("capped", RecordedScores("n", noisy), load_ratio=1.1), 0.5, 1, unions)
    assert free.loads_per_demand > 1.3 * lru.loads_per_demand
    assert capped.loads_per_demand <= 1.2 * lru.loads_per_demand
    assert capped.prefetch_loads < free.prefetch_loads


def test_compact_score_stream_predicts_the_mapping() -> None:
    trace = mapped_trace(num_tokens=400)
    stream = compact_score_stream(step_unions(trace, 1), 2, 8, chunk_steps=16, top_m=2)
    truth = np.array([trace.row(t, 1)[0] for t in range(200, 400)])
    assert (stream[200:, 1].argmax(axis=1) == truth).mean() > 0.8


def test_compact_score_stream_equals_the_agent_evaluator_position_by_position() -> None:
    trace = random_trace(9, num_tokens=90, num_layers=3, skew=0.5)
    unions = step_unions(trace, 1)
    stream = compact_score_stream(unions, 3, 8, chunk_steps=10, top_m=3)
    table = TransitionTable(3, 8, top_m=3)
    for a in range(0, 90, 10):
        agent = CompactTransition(table.snapshot())
        for s in range(a, a + 10):
            assert np.allclose(stream[s, 0], agent.marginal(0))
            for layer in range(1, 3):
                assert np.allclose(stream[s, layer], agent.predict(layer - 1, unions[s][layer - 1]))
        for s in range(a, a + 10):
            for layer in range(3):
                table.observe(s, layer, unions[s][layer])
