"""A learned demand predictor: a logistic (scikit-learn) or LightGBM blend of the co-activation signals.

Runs in the controller. Online, in chunks of `chunk_steps` steps (cooccurrence.py): every observed position
adds one row per expert (its features, label = demanded) to a bounded buffer of the last `max_rows` rows; at a
chunk boundary the model is refit on that buffer once the rows since the last fit reach max(`min_rows`,
`refit_growth` x the rows at the last fit), so the number of fits grows only logarithmically with the stream.
Positions of a chunk are scored by the model and tables as they stood at its start; before the first fit the
context signal answers alone. `version` grows at each fit.

`score_stream` gives, for a whole recorded stream, exactly the scores the online form would (vectorized per
chunk; tests check they agree): offline evaluation uses it so the replay stays fast. Never imports torch,
runtime or agent.

Shape letters: S steps, L layers, E experts per layer, F features, N buffered rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import numpy as np

from tierplan.controller.predictors.cooccurrence import FEATURE_NAMES, CoactivationFeatures, feature_stream

_CONTEXT = FEATURE_NAMES.index("context")


class Backend(StrEnum):
    LOGISTIC = "logistic"
    LIGHTGBM = "lightgbm"


class _Model:
    """The fitted blend; refit on the buffer it is given."""

    def __init__(self, backend: Backend, seed: int) -> None:
        self.backend, self.seed = backend, seed
        self.coef: np.ndarray | None = None  # [F]
        self.intercept = 0.0
        self.booster = None

    @property
    def fitted(self) -> bool:
        return self.coef is not None or self.booster is not None

    def fit(self, x: np.ndarray, y: np.ndarray) -> bool:
        if y.min() == y.max():
            return False
        if self.backend is Backend.LOGISTIC:
            from sklearn.linear_model import LogisticRegression

            model = LogisticRegression(C=1.0, solver="newton-cholesky", max_iter=50)
            model.fit(x, y)
            self.coef, self.intercept = model.coef_[0].copy(), float(model.intercept_[0])
        else:
            import lightgbm as lgb

            params = {"objective": "binary", "learning_rate": 0.1, "num_leaves": 15, "min_data_in_leaf": 50,
                      "verbose": -1, "seed": self.seed, "num_threads": 1, "deterministic": True}
            self.booster = lgb.train(params, lgb.Dataset(x, y, feature_name=list(FEATURE_NAMES)), 40)
        return True

    def predict(self, x: np.ndarray) -> np.ndarray:
        """x [..., F] -> [...] probabilities; the context signal before any fit."""
        if self.coef is not None:
            return 1.0 / (1.0 + np.exp(-(x @ self.coef + self.intercept)))
        if self.booster is not None:
            flat = x.reshape(-1, x.shape[-1])
            return np.asarray(self.booster.predict(flat), np.float64).reshape(x.shape[:-1])
        return 1.0 / (1.0 + np.exp(-x[..., _CONTEXT]))


class LearnedDemandPredictor:
    """DemandPredictor: `observe` the stream, `scores(step, layer)` for the next position (see module doc)."""

    def __init__(self, backend: Backend | str = Backend.LOGISTIC, chunk_steps: int = 16, min_rows: int = 4000,
                 refit_growth: float = 0.5, max_rows: int = 60_000, seed: int = 0) -> None:
        self.backend = Backend(backend)
        self.name = f"learned-{self.backend.value}"
        self.chunk_steps, self.min_rows, self.refit_growth = chunk_steps, min_rows, refit_growth
        self.max_rows, self.seed = max_rows, seed
        self.version = 1

    def reset(self, num_layers: int, num_experts: int) -> None:
        self.num_experts = num_experts
        self.signals = CoactivationFeatures(self.chunk_steps)
        self.signals.reset(num_layers, num_experts)
        self.model = _Model(self.backend, self.seed)
        self._x: list[np.ndarray] = []  # [E, F] per observed position
        self._y: list[np.ndarray] = []  # [E]
        self._rows = self._rows_at_fit = 0
        self._chunk = 0
        self.num_fits = 0

    def _maybe_refit(self) -> None:
        """At a chunk boundary: refit on the buffer when enough rows arrived since the last fit."""
        if self._rows - self._rows_at_fit < max(self.min_rows, self.refit_growth * self._rows_at_fit):
            return
        keep = max(1, self.max_rows // self.num_experts)
        del self._x[:-keep], self._y[:-keep]
        self._rows_at_fit = self._rows
        if self.model.fit(np.concatenate(self._x), np.concatenate(self._y)):
            self.num_fits += 1
            self.version += 1

    def _enter(self, step: int) -> None:
        chunk = step // self.chunk_steps
        if chunk != self._chunk:
            self._chunk = chunk
            self._maybe_refit()

    def observe(self, step: int, layer: int, expert_ids: np.ndarray) -> None:
        self._enter(step)
        ids = np.asarray(expert_ids, np.int64)
        x = self.signals.features(step, layer)
        y = np.zeros(self.num_experts)
        y[ids[ids >= 0]] = 1.0
        self._x.append(x)
        self._y.append(y)
        self._rows += self.num_experts
        self.signals.observe(step, layer, ids)

    def scores(self, step: int, layer: int) -> np.ndarray:
        self._enter(step)
        return self.model.predict(self.signals.features(step, layer))

    def score_stream(self, unions: Sequence[Sequence[np.ndarray]], num_layers: int, num_experts: int,
                     features: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """[S, L, E] the online scores of every position of a recorded stream (resets this predictor).
        `features`: feature_stream's output for the same unions and chunk_steps, when already computed."""
        self.reset(num_layers, num_experts)
        if features is None:
            features = feature_stream(unions, num_layers, num_experts, self.chunk_steps)
        feats, labels = features  # [S, L, E, F], [S, L, E]
        out = np.empty(labels.shape)
        for a in range(0, labels.shape[0], self.chunk_steps):
            b = min(a + self.chunk_steps, labels.shape[0])
            if a:
                self._maybe_refit()
            out[a:b] = self.model.predict(feats[a:b])
            for s in range(a, b):
                self._x.extend(feats[s])
                self._y.extend(labels[s])
            self._rows += (b - a) * num_layers * num_experts
        return out


class RecordedScores:
    """A DemandPredictor that plays back a causal score stream ([S, L, E], e.g. from `score_stream`)."""

    def __init__(self, name: str, stream: np.ndarray) -> None:
        self.name, self.version = name, 1
        self._stream = stream

    def reset(self, num_layers: int, num_experts: int) -> None:
        if self._stream.shape[1:] != (num_layers, num_experts):
            raise ValueError(f"{self.name}: recorded for {self._stream.shape[1:]}, replay is "
                             f"{(num_layers, num_experts)}")

    def observe(self, step: int, layer: int, expert_ids: np.ndarray) -> None:
        pass

    def scores(self, step: int, layer: int) -> np.ndarray:
        return self._stream[step, layer]
