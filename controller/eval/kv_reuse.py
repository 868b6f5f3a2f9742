"""Evaluate KV prefix-block reuse scorers on a request trace: AUC per scorer (run by `tierplan eval kv-reuse`).

Protocol. Every prefix block of every request is an event at the request's arrival time t. Its label is
"reused": the same block is accessed again by a later request within (t, t + horizon]. The trace's time span
[t_first, t_last] is cut at its middle, t_mid:
- training events: t + horizon <= t_mid (their labels are known from the first half alone; events of the
  first half whose horizon crosses t_mid are left out, so nothing of the second half leaks into training);
- test events: t >= t_mid and t + horizon <= t_last. Events whose horizon runs past the end of the trace are
  excluded: their label cannot be known (counted in `num_excluded_end`).
Features are computed online in time order (kv_features.py), so no event sees its own future. `count` and
`recency` need no training; `logistic` and `lightgbm` are fitted once on the training events;
`logistic_online` is `KVReusePredictor` replayed over the whole trace, learning only from labels resolved by
then (it keeps learning in the second half, as it would in service). AUC is scikit-learn's roc_auc_score.
For reference, Dynamo KVBM's freq>=2 rule (offload a block once seen twice) as precision/recall.

Runs in the user's shell (CLI) or a test; pure numpy/scikit-learn/LightGBM. Never imports torch or runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tierplan.controller.predictors.kv_features import Raw, block_events, next_gap_s
from tierplan.controller.predictors.kv_reuse import KVReusePredictor, ScorerKind, make_scorer
from tierplan.controller.requests_jsonl import RequestTrace

ONLINE = "logistic_online"
DEFAULT_SCORERS = (*(k.value for k in ScorerKind), ONLINE)


class EvalError(ValueError):
    """The evaluation cannot be run on this input; the message says what is missing."""


@dataclass(frozen=True)
class KVReuseReport:
    horizon_s: float
    num_events: int
    num_train: int
    num_train_reused: int
    num_test: int
    num_test_reused: int
    num_excluded_end: int  # events whose horizon runs past the trace's last arrival
    num_excluded_crossing: int  # first-half events whose horizon crosses the middle (in neither set)
    auc: dict[str, float]  # scorer -> AUC on the test events
    kvbm_freq2_precision: float
    kvbm_freq2_recall: float
    notes: tuple[str, ...] = field(default=())  # scorers left out, and why


def _online_scores(trace: RequestTrace, horizon_s: float, test_requests: np.ndarray,
                   progress: Callable[[int], None] | None) -> tuple[np.ndarray | None, KVReusePredictor]:
    """Probabilities the online predictor gave each block of the test requests when they arrived."""
    predictor = KVReusePredictor(horizon_s)
    arrival_s = (trace.arrival_ms - trace.arrival_ms[0]) / 1000.0
    is_test = np.zeros(trace.num_requests, dtype=bool)
    is_test[test_requests] = True
    scores: list[np.ndarray] = []
    for r, ids in enumerate(trace.hash_ids):
        probs = predictor.observe(float(arrival_s[r]), ids, int(trace.input_length[r]))
        if is_test[r] and ids:
            if probs is None:
                return None, predictor
            scores.append(probs)
        if progress is not None and (r + 1) % 1000 == 0:
            progress(1000)
    if progress is not None:
        progress(trace.num_requests % 1000)
    return (np.concatenate(scores) if scores else np.empty(0)), predictor


def evaluate_kv_reuse(trace: RequestTrace, horizon_s: float, scorers: Sequence[str] = DEFAULT_SCORERS,
                      progress: Callable[[int], None] | None = None) -> KVReuseReport:
    """AUC of each scorer on the second half of `trace` (see the module docstring for the protocol).

    `progress` is called with work units done; the total is `progress_total(trace, scorers)`.
    """
    from sklearn.metrics import roc_auc_score

    if not (np.isfinite(horizon_s) and horizon_s > 0):
        raise EvalError(f"horizon must be a positive number of seconds, got {horizon_s!r}")
    unknown = [s for s in scorers if s not in DEFAULT_SCORERS]
    if unknown or not scorers:
        raise EvalError(f"unknown scorer(s) {unknown}; expected some of {', '.join(DEFAULT_SCORERS)}")
    ev = block_events(trace, progress)
    t_last = float(ev.times_s[-1]) if len(ev.times_s) else 0.0
    t_mid = t_last / 2.0
    reused = next_gap_s(ev.blocks, ev.times_s) <= horizon_s  # [E]
    train = ev.times_s + horizon_s <= t_mid
    in_time = ev.times_s + horizon_s <= t_last
    test = (ev.times_s >= t_mid) & in_time
    span = f"the trace spans {t_last:.0f} s, so with a {horizon_s:.0f} s horizon"
    for name, mask in (("training (first half)", train), ("test (second half)", test)):
        num, num_pos = int(mask.sum()), int(reused[mask].sum())
        if num_pos == 0 or num_pos == num:
            raise EvalError(f"{span} the {name} events are {num} with {num_pos} reused; both reused and "
                            "not-reused events are needed (use a longer trace or a shorter horizon)")
    auc: dict[str, float] = {}
    notes: list[str] = []
    y_test = reused[test]
    for name in scorers:
        if name == ONLINE:
            test_requests = np.unique(ev.request[test])
            probs, predictor = _online_scores(trace, horizon_s, test_requests, progress)
            if probs is None:
                notes.append(f"{ONLINE}: left out, its model was not fitted before the test half began")
                continue
            # The predictor scored every block of the test requests; keep the test events among them.
            in_test_requests = np.isin(ev.request, test_requests)
            auc[name] = float(roc_auc_score(y_test, probs[test[in_test_requests]]))
            outcomes = ", ".join(f"{k.value} {v}" for k, v in predictor.refit_outcomes.items())
            notes.append(f"{ONLINE}: {predictor.num_fits} fits in time order ({outcomes})")
            continue
        scorer = make_scorer(name)
        scorer.fit(ev.raw[train], reused[train])
        auc[name] = float(roc_auc_score(y_test, scorer.score(ev.raw[test])))
        if progress is not None:
            progress(1)
    rule = ev.raw[test, Raw.COUNT] >= 1  # seen at least twice counting this access
    num_hit = int((rule & y_test).sum())
    return KVReuseReport(
        horizon_s=float(horizon_s), num_events=len(ev.blocks), num_train=int(train.sum()),
        num_train_reused=int(reused[train].sum()), num_test=int(test.sum()), num_test_reused=int(y_test.sum()),
        num_excluded_end=int((~in_time).sum()),
        num_excluded_crossing=int(((ev.times_s < t_mid) & ~train & in_time).sum()),
        auc=auc, kvbm_freq2_precision=num_hit / max(1, int(rule.sum())),
        kvbm_freq2_recall=num_hit / max(1, int(y_test.sum())), notes=tuple(notes))


def progress_total(trace: RequestTrace, scorers: Sequence[str]) -> int:
    """Work units `evaluate_kv_reuse` reports through `progress`."""
    num_offline = sum(1 for s in scorers if s != ONLINE)
    return trace.num_requests * (1 + (ONLINE in scorers)) + num_offline
