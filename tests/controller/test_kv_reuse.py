"""KV block reuse: features never look ahead, labels resolve as time passes, and a learned model finds a
reuse pattern that counting cannot see."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.controller.kv_traces import planted_trace_rows, write_trace
from tierplan.controller.eval.kv_reuse import DEFAULT_SCORERS, EvalError, evaluate_kv_reuse
from tierplan.controller.predictors.kv_features import BlockFeaturizer, Raw, model_matrix, next_gap_s
from tierplan.controller.predictors.kv_reuse import (
    KVReusePredictor,
    LogisticScorer,
    NotFittedError,
    RefitOutcome,
    make_scorer,
)
from tierplan.controller.protocol import Forecast
from tierplan.controller.requests_jsonl import load_request_trace

SAMPLE = Path(__file__).parents[2] / "data" / "requests" / "mooncake_conversation_sample.jsonl"


def test_features_are_what_was_known_just_before_the_request() -> None:
    f = BlockFeaturizer()
    first = f.observe(0.0, [7, 8], 1000)
    assert list(first[:, Raw.COUNT]) == [0, 0] and np.isinf(first[:, Raw.RECENCY_S]).all()
    assert list(first[:, Raw.HIT_BLOCKS]) == [0, 0]
    second = f.observe(4.0, [7, 8, 9], 1500)
    assert list(second[:, Raw.COUNT]) == [1, 1, 0]
    assert list(second[:2, Raw.RECENCY_S]) == [4.0, 4.0] and np.isinf(second[2, Raw.RECENCY_S])
    assert list(second[:, Raw.HIT_BLOCKS]) == [2, 2, 2] and second[0, Raw.DEEP_RECENCY_S] == 4.0
    assert list(second[:, Raw.POSITION]) == [0, 1, 2] and second[0, Raw.INTERARRIVAL_S] == 4.0
    assert np.isfinite(model_matrix(np.concatenate([first, second]))).all()
    with pytest.raises(ValueError, match="before the previous request"):
        f.observe(3.0, [7], 600)


def test_next_gap_is_the_time_to_the_same_blocks_next_access() -> None:
    blocks = np.array([5, 6, 5, 7, 5])
    times = np.array([0.0, 1.0, 3.0, 3.0, 10.0])
    assert list(next_gap_s(blocks, times)) == [3.0, np.inf, 7.0, np.inf, np.inf]


def test_online_labels_resolve_on_reuse_or_when_the_horizon_passes() -> None:
    p = KVReusePredictor(horizon_s=10.0, min_fit_events=2, refit_every_events=1)
    assert p.observe(0.0, [1, 2], 900) is None  # nothing is known yet
    p.observe(5.0, [1], 400)  # block 1 reused 5 s later: its first event resolves as reused
    assert (p.num_resolved_events, p.num_resolved_reused) == (1, 1)
    p.observe(12.0, [3], 400)  # block 2's horizon (0 + 10 s) has passed unreused
    assert (p.num_resolved_events, p.num_resolved_reused) == (2, 1)
    assert p.is_fitted and p.num_fits >= 1
    probs = p.observe(13.0, [1, 4], 900)
    assert probs is not None and probs.shape == (2,) and ((probs >= 0) & (probs <= 1)).all()
    with pytest.raises(ValueError, match="time went back"):
        p.observe(1.0, [1], 400)


def test_reuse_scores_fill_a_forecast_and_leave_idle_blocks_out() -> None:
    p = KVReusePredictor(horizon_s=60.0, min_fit_events=200)
    rows = planted_trace_rows(seed=1, duration_s=600.0)
    for row in rows:
        p.observe(row["timestamp"] / 1000.0, row["hash_ids"], row["input_length"])
    now_s = rows[-1]["timestamp"] / 1000.0
    scores = p.reuse_scores(now_s)
    assert scores and all(0.0 <= v <= 1.0 for v in scores.values())
    recent = {str(h) for r in rows if now_s - r["timestamp"] / 1000.0 <= 60.0 for h in r["hash_ids"]}
    assert set(scores) == recent  # every block seen within the horizon, and no other
    forecast = Forecast(model="m", num_layers=1, num_experts=1, horizon_steps=1, created_s=now_s, layers=(),
                        kv_reuse_scores=scores)
    assert forecast.kv_reuse_scores == scores
    top = p.reuse_scores(now_s, max_items=3)
    assert len(top) == 3 and min(top.values()) >= max(v for k, v in scores.items() if k not in top)
    assert p.reuse_scores(now_s + 61.0) == {}  # everything is idle past the horizon now


def test_an_unfitted_learned_scorer_refuses_to_score() -> None:
    with pytest.raises(NotFittedError):
        make_scorer("logistic").score(np.zeros((1, len(Raw))))
    with pytest.raises(ValueError, match="both reused and not-reused"):
        make_scorer("lightgbm").fit(np.zeros((3, len(Raw))), np.ones(3, dtype=bool))


def test_the_learned_models_find_the_planted_pattern_counting_cannot_see(tmp_path: Path) -> None:
    trace = load_request_trace(write_trace(tmp_path / "planted.jsonl", planted_trace_rows(seed=0)))
    report = evaluate_kv_reuse(trace, horizon_s=60.0)
    assert set(report.auc) == set(DEFAULT_SCORERS)
    assert report.auc["logistic"] > report.auc["count"] + 0.2
    assert report.auc["lightgbm"] > report.auc["count"] + 0.2
    assert report.auc["logistic_online"] > report.auc["count"] + 0.2


def test_the_split_accounts_for_every_event_and_drops_horizons_past_the_end() -> None:
    trace = load_request_trace(SAMPLE)
    report = evaluate_kv_reuse(trace, horizon_s=30.0, scorers=("count", "recency", "logistic"))
    assert set(report.auc) == {"count", "recency", "logistic"}
    assert all(0.0 <= v <= 1.0 for v in report.auc.values())
    arrival_s = (trace.arrival_ms - trace.arrival_ms[0]) / 1000.0
    depth = np.array([len(h) for h in trace.hash_ids])
    assert report.num_excluded_end == int(depth[arrival_s + 30.0 > arrival_s[-1]].sum())
    assert (report.num_train + report.num_test + report.num_excluded_end + report.num_excluded_crossing
            == report.num_events == trace.num_blocks)
    assert 0.0 < report.kvbm_freq2_precision <= 1.0 and 0.0 < report.kvbm_freq2_recall <= 1.0


@pytest.mark.parametrize(("horizon_s", "scorers", "expected"), [
    (6000.0, ("count",), "training .* events are 0 with 0 reused"),
    (0.0, ("count",), "horizon must be a positive number"),
    (float("nan"), ("count",), "horizon must be a positive number"),
    (30.0, ("oracle",), r"unknown scorer\(s\) \['oracle'\]"),
])
def test_an_evaluation_that_cannot_be_run_says_why(horizon_s: float, scorers: tuple[str, ...],
                                                  expected: str) -> None:
    with pytest.raises(EvalError, match=expected):
        evaluate_kv_reuse(load_request_trace(SAMPLE), horizon_s, scorers)


class _SignedScorer(LogisticScorer):
    """A real logistic model (good on the planted trace), or the same one ranking backwards (bad)."""

    def __init__(self, sign: float) -> None:
        super().__init__()
        self.sign = sign

    def score(self, raw: np.ndarray) -> np.ndarray:
        probs = super().score(raw)
        return probs if self.sign > 0 else 1.0 - probs


@pytest.mark.parametrize(("signs", "expected_kept"), [((1.0, -1.0), True), ((-1.0, 1.0), False)])
def test_a_refit_replaces_the_model_only_when_it_ranks_the_newest_events_better(
        monkeypatch: pytest.MonkeyPatch, signs: tuple[float, float], expected_kept: bool) -> None:
    made: list[_SignedScorer] = []

    def make(kind: str) -> _SignedScorer:
        made.append(_SignedScorer(signs[0] if not made else signs[1]))
        return made[-1]

    monkeypatch.setattr("tierplan.controller.predictors.kv_reuse.make_scorer", make)
    p = KVReusePredictor(horizon_s=60.0, min_fit_events=500, refit_every_events=2_000)
    for row in planted_trace_rows(seed=3, duration_s=900.0):
        p.observe(row["timestamp"] / 1000.0, row["hash_ids"], row["input_length"])
    outcomes = p.refit_outcomes
    assert outcomes[RefitOutcome.FIRST] == 1 and p.num_fits == len(made) >= 3
    if expected_kept:  # the good first model is never replaced by the bad candidates
        assert outcomes[RefitOutcome.KEPT] == p.num_fits - 1 and p._scorer is made[0]
    else:  # the bad first model is replaced by the first good candidate, then good ones replace each other
        assert outcomes[RefitOutcome.PROMOTED] == p.num_fits - 1 and p._scorer is made[-1]
