"""KV prefix-block reuse predictors: will this block be used again within the horizon? (controller process)

Scorers rank block events (see kv_features.py) by how likely the block is reused within `horizon_s`:
- `count`: accesses so far (Dynamo KVBM's freq>=2 rule thresholds it); `recency`: 1 / (1 + time since last
  seen) (LRU's view); both need no training.
- `logistic` (scikit-learn, standardised) and `lightgbm`: learned on `MODEL_FEATURES`, probabilities.
`KVReusePredictor` runs one learned scorer online, in time order: each access is an event whose label becomes
known only later (reused when the block is seen again within the horizon, not when the horizon passes first),
and the model is refitted in chunks on the most recent resolved events. `reuse_scores(now_s)` gives the
`Forecast.kv_reuse_scores` map (prefix hash as text -> probability).

Interface: controller/predictors/base.py's `DemandPredictor` is per-layer expert demand (observe step, layer,
experts); KV reuse sees requests' prefix blocks instead, so `ReuseScorer` below is the small interface these
scorers share (name / fit / score), and `KVReusePredictor` is named and versioned as base.py asks.
Pure numpy + scikit-learn + LightGBM: must never import torch, runtime or agent, nor touch disk or network.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from enum import StrEnum
from typing import Protocol

import numpy as np

from tierplan.controller.predictors.kv_features import NUM_RAW, BlockFeaturizer, Raw, model_matrix
from tierplan.controller.validation import MAX_ITEMS

SCHEMA_VERSION = 1
_HOLDOUT_FRAC = 0.2  # of the window: the newest resolved events a refit candidate is judged on
_SWEEP_EVERY_REQUESTS = 10_000  # how often blocks idle past forget_after_s are dropped (bounded memory)


class RefitOutcome(StrEnum):
    FIRST = "first"  # no model yet: the first fit is used as is
    PROMOTED = "promoted"  # the candidate ranked the newest events at least as well as the incumbent
    KEPT = "kept"  # the incumbent ranked them better; the candidate is dropped
    UNJUDGED = "unjudged"  # the newest events all had one label, so no comparison: the incumbent stays


class ScorerKind(StrEnum):
    COUNT = "count"
    RECENCY = "recency"
    LOGISTIC = "logistic"
    LIGHTGBM = "lightgbm"


LEARNED = (ScorerKind.LOGISTIC, ScorerKind.LIGHTGBM)


class ReuseScorer(Protocol):
    """Ranks block events: a higher score means more likely reused within the horizon."""

    name: str

    def fit(self, raw: np.ndarray, reused: np.ndarray) -> None: ...

    def score(self, raw: np.ndarray) -> np.ndarray: ...


class CountScorer:
    """Accesses so far; needs no training."""

    name = ScorerKind.COUNT.value

    def fit(self, raw: np.ndarray, reused: np.ndarray) -> None:
        return None

    def score(self, raw: np.ndarray) -> np.ndarray:
        return raw[:, Raw.COUNT].astype(np.float64)


class RecencyScorer:
    """1 / (1 + seconds since last access); 0 for never seen. Needs no training."""

    name = ScorerKind.RECENCY.value

    def fit(self, raw: np.ndarray, reused: np.ndarray) -> None:
        return None

    def score(self, raw: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + raw[:, Raw.RECENCY_S])


class NotFittedError(RuntimeError):
    """A learned scorer was asked to score before it was fitted."""


def _check_labels(raw: np.ndarray, reused: np.ndarray) -> None:
    if raw.ndim != 2 or raw.shape[1] != NUM_RAW or reused.shape != (raw.shape[0],):
        raise ValueError(f"expected raw [E, {NUM_RAW}] and reused [E], got {raw.shape} and {reused.shape}")
    num_pos = int(np.count_nonzero(reused))
    if num_pos == 0 or num_pos == len(reused):
        raise ValueError(f"training needs both reused and not-reused events, got {num_pos} of {len(reused)} reused")


class LogisticScorer:
    """Logistic regression on standardised model features (scikit-learn, lbfgs). Once fitted, it scores with
    its folded weights in numpy (`weights`, `bias`: the scaler folded in), which is also what a plan could
    carry to an agent."""

    name = ScorerKind.LOGISTIC.value

    def __init__(self, c: float = 1.0) -> None:
        self._c = c
        self.weights: np.ndarray | None = None  # [F] over MODEL_FEATURES, raw (unscaled) units
        self.bias = 0.0

    def fit(self, raw: np.ndarray, reused: np.ndarray) -> None:
        from sklearn.linear_model import LogisticRegression
        from sklearn.preprocessing import StandardScaler

        _check_labels(raw, reused)
        x = model_matrix(raw)  # [E, F]
        scaler = StandardScaler().fit(x)
        model = LogisticRegression(C=self._c, max_iter=1000).fit(scaler.transform(x), reused.astype(bool))
        coef = model.coef_[0] / scaler.scale_  # [F]
        self.weights, self.bias = coef, float(model.intercept_[0] - coef @ scaler.mean_)

    def score(self, raw: np.ndarray) -> np.ndarray:
        if self.weights is None:
            raise NotFittedError("logistic scorer used before fit")
        z = model_matrix(raw) @ self.weights + self.bias  # [E]
        return 0.5 * (1.0 + np.tanh(0.5 * z))  # the logistic function, without overflow warnings


class LightGBMScorer:
    """Gradient-boosted trees (LightGBM), small and regularised: the reuse pattern drifts over a trace."""

    name = ScorerKind.LIGHTGBM.value

    def __init__(self, num_trees: int = 100, num_leaves: int = 15, seed: int = 0) -> None:
        self._params = dict(n_estimators=num_trees, num_leaves=num_leaves, learning_rate=0.05,
                            min_child_samples=200, random_state=seed, n_jobs=1, verbose=-1)
        self._model = None

    def fit(self, raw: np.ndarray, reused: np.ndarray) -> None:
        import lightgbm as lgb

        _check_labels(raw, reused)
        self._model = lgb.LGBMClassifier(**self._params).fit(model_matrix(raw), reused.astype(bool))

    def score(self, raw: np.ndarray) -> np.ndarray:
        if self._model is None:
            raise NotFittedError("lightgbm scorer used before fit")
        return self._model.predict_proba(model_matrix(raw))[:, 1]


def make_scorer(kind: ScorerKind | str) -> ReuseScorer:
    kind = ScorerKind(kind)
    return {ScorerKind.COUNT: CountScorer, ScorerKind.RECENCY: RecencyScorer, ScorerKind.LOGISTIC: LogisticScorer,
            ScorerKind.LIGHTGBM: LightGBMScorer}[kind]()


class KVReusePredictor:
    """A learned reuse scorer trained online, in time order, on labels as they become known.

    Call `observe(arrival_s, hash_ids, input_tokens)` for every request in arrival order; it returns the
    current model's reuse probabilities for that request's blocks (None until the first fit), then books the
    request's blocks as pending events. An event is labelled reused when its block is seen again within
    `horizon_s`, and not reused once `horizon_s` passes without that. Resolved events go into a window of the
    last `window_events`; a candidate is refitted every `refit_every_events` resolved events (the first fit as
    soon as `min_fit_events` have resolved with both labels present) and runs in shadow: it replaces the
    model in use only if its AUC on the newest resolved events, which it did not learn from, is at least the
    incumbent's (`refit_outcomes` counts each outcome).
    """

    version = SCHEMA_VERSION

    def __init__(self, horizon_s: float, kind: ScorerKind | str = ScorerKind.LOGISTIC, *,
                 refit_every_events: int = 50_000, window_events: int = 200_000, min_fit_events: int = 1_000,
                 forget_after_s: float = 86_400.0) -> None:
        kind = ScorerKind(kind)
        if kind not in LEARNED:
            raise ValueError(f"KVReusePredictor learns; kind must be one of {[k.value for k in LEARNED]}, got "
                             f"{kind.value!r}")
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be positive, got {horizon_s!r}")
        if not 1 <= min_fit_events <= window_events or refit_every_events < 1:
            raise ValueError("need 1 <= min_fit_events <= window_events and refit_every_events >= 1, got "
                             f"{min_fit_events}, {window_events}, {refit_every_events}")
        self.horizon_s = float(horizon_s)
        self.kind = kind
        self.name = f"kv_reuse_{kind.value}"
        self._refit_every = refit_every_events
        self._min_fit = min_fit_events
        self._forget_after_s = max(forget_after_s, self.horizon_s)
        self._featurizer = BlockFeaturizer(forget_after_s=self._forget_after_s)
        self._scorer: ReuseScorer | None = None
        # The last access of each block is its pending (or resolved) event: [time, raw row, resolved]. Blocks are
        # a trace's int hash ids, or a live agent's prefix hashes (text).
        self._last: dict[Hashable, tuple[float, np.ndarray, bool]] = {}
        self._deadlines: deque[tuple[float, Hashable]] = deque()  # (access time, block), in time order
        self._window_raw = np.empty((window_events, NUM_RAW))  # ring buffer [W, NUM_RAW]
        self._window_reused = np.zeros(window_events, dtype=bool)  # [W]
        self._num_resolved = 0
        self._num_resolved_reused = 0
        self._num_since_fit = 0
        self._now_s = -np.inf
        self._num_requests = 0
        self.num_fits = 0
        self.refit_outcomes: dict[RefitOutcome, int] = dict.fromkeys(RefitOutcome, 0)

    @property
    def is_fitted(self) -> bool:
        return self._scorer is not None

    @property
    def num_resolved_events(self) -> int:
        return self._num_resolved

    @property
    def num_resolved_reused(self) -> int:
        return self._num_resolved_reused

    def observe(self, arrival_s: float, hash_ids: Sequence[Hashable], input_tokens: int,
                score: bool = True) -> np.ndarray | None:
        """Probabilities [len(hash_ids)] that each block is reused within the horizon (None before a fit, or
        when `score` is False: a live feed that only learns skips the model's evaluation)."""
        self._advance(arrival_s)
        raw = self._featurizer.observe(arrival_s, hash_ids, input_tokens)  # [B, NUM_RAW]
        probs = self._scorer.score(raw) if score and self._scorer is not None and len(hash_ids) else None
        for j, h in enumerate(hash_ids):
            prev = self._last.get(h)
            if prev is not None and not prev[2]:
                self._resolve(prev[1], arrival_s - prev[0] <= self.horizon_s)
            self._last[h] = (arrival_s, raw[j], False)
            self._deadlines.append((arrival_s, h))
        self._maybe_fit()
        self._num_requests += 1
        if self._num_requests % _SWEEP_EVERY_REQUESTS == 0:
            stale = [h for h, (t, _, _) in self._last.items() if arrival_s - t > self._forget_after_s]
            for h in stale:
                del self._last[h]
        return probs

    def reuse_scores(self, now_s: float, max_items: int = MAX_ITEMS) -> dict[str, float]:
        """`Forecast.kv_reuse_scores`: prefix hash (as text) -> P(reused within the horizon of its last
        access), for blocks last seen within the horizon before `now_s`, the `max_items` most likely.

        Blocks idle longer than the horizon are left out: the model predicts nothing for them (the agent ranks
        unscored blocks below every scored one). Empty before the first fit.
        """
        ranked, fitted = self.rank(now_s, max_items)
        return dict(ranked) if fitted else {}

    def rank(self, now_s: float, max_items: int = MAX_ITEMS) -> tuple[list[tuple[str, float]], bool]:
        """The blocks last seen within the horizon before `now_s`, most likely reused first, at most `max_items`
        of them, with their scores; and whether the scores are the model's probabilities (True) or, before the
        first fit, accesses so far (the count rule, which needs no training). Ties go to the most recent."""
        self._advance(now_s)
        live = [(h, t, row) for h, (t, row, _) in self._last.items() if now_s - t <= self.horizon_s]
        if not live:
            return [], self._scorer is not None
        raw = np.stack([row for _, _, row in live])  # [N, NUM_RAW]
        # Before a fit: the row holds the last access's features, so accesses before it, plus that one.
        scores = (np.clip(self._scorer.score(raw), 0.0, 1.0) if self._scorer is not None
                  else raw[:, Raw.COUNT] + 1.0)  # [N]
        times = np.array([t for _, t, _ in live])  # [N]
        keep = np.lexsort((-times, -scores))[:max_items]
        return [(str(live[i][0]), float(scores[i])) for i in keep], self._scorer is not None

    def _advance(self, now_s: float) -> None:
        """Time moves to now_s: events whose horizon has passed unreused resolve as not reused."""
        if now_s < self._now_s:
            raise ValueError(f"time went back: {now_s} is before {self._now_s}")
        self._now_s = now_s
        while self._deadlines and self._deadlines[0][0] + self.horizon_s < now_s:
            t, h = self._deadlines.popleft()
            last = self._last.get(h)
            if last is not None and last[0] == t and not last[2]:
                self._resolve(last[1], False)
                self._last[h] = (t, last[1], True)

    def _resolve(self, raw_row: np.ndarray, reused: bool) -> None:
        slot = self._num_resolved % len(self._window_reused)
        self._window_raw[slot] = raw_row
        self._window_reused[slot] = reused
        self._num_resolved += 1
        self._num_resolved_reused += int(reused)
        self._num_since_fit += 1

    def _maybe_fit(self) -> None:
        num = min(self._num_resolved, len(self._window_reused))
        due = self._num_since_fit >= self._refit_every or (self._scorer is None and num >= self._min_fit)
        if not due:
            return
        order = np.arange(num) if self._num_resolved <= num else (np.arange(num) + self._num_resolved) % num
        if self._scorer is None:
            train, holdout = order, order[:0]
        else:
            # Shadow test: the candidate learns without the newest events (all resolved after the incumbent
            # was fitted), and replaces the incumbent only if it ranks those at least as well.
            num_holdout = max(1, min(int(_HOLDOUT_FRAC * num), self._num_since_fit))
            train, holdout = order[:-num_holdout], order[-num_holdout:]
        reused = self._window_reused[train]
        if reused.all() or not reused.any():
            return
        candidate = make_scorer(self.kind)
        candidate.fit(self._window_raw[train], reused)
        self._num_since_fit = 0
        self.num_fits += 1
        outcome = self._judge(candidate, holdout)
        self.refit_outcomes[outcome] += 1
        if outcome in (RefitOutcome.FIRST, RefitOutcome.PROMOTED):
            self._scorer = candidate

    def _judge(self, candidate: ReuseScorer, holdout: np.ndarray) -> RefitOutcome:
        from sklearn.metrics import roc_auc_score

        if self._scorer is None:
            return RefitOutcome.FIRST
        y = self._window_reused[holdout]
        if y.all() or not y.any():
            return RefitOutcome.UNJUDGED
        raw = self._window_raw[holdout]
        better = roc_auc_score(y, candidate.score(raw)) >= roc_auc_score(y, self._scorer.score(raw))
        return RefitOutcome.PROMOTED if better else RefitOutcome.KEPT
