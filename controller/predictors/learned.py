"""A learned demand predictor: a logistic (scikit-learn) or LightGBM blend of the co-activation signals.

Runs in the controller. Online: every observed (step, layer) adds one row per expert (the features known one
position earlier, see cooccurrence.py; label = demanded) to a bounded buffer; the model is refit on that buffer
in chunks, each time the rows since the last fit reach max(`min_rows`, `refit_growth` x rows so far), so the
number of fits grows only logarithmically with the stream. Until the first fit it answers with the context
signal alone. `version` grows at each fit. Logistic scores are evaluated with numpy (one dot per layer); the
LightGBM backend calls the booster. Never imports torch, runtime or agent.

Shape letters: E experts per layer, F features, N buffered rows.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np

from controller.predictors.cooccurrence import FEATURE_NAMES, CoactivationFeatures


class Backend(StrEnum):
    LOGISTIC = "logistic"
    LIGHTGBM = "lightgbm"


class LearnedDemandPredictor:
    """DemandPredictor: `observe` the stream, `scores(step, layer)` for the next position (see module doc)."""

    def __init__(self, backend: Backend | str = Backend.LOGISTIC, min_rows: int = 4000, refit_growth: float = 0.3,
                 max_rows: int = 120_000, seed: int = 0) -> None:
        self.backend = Backend(backend)
        self.name = f"learned-{self.backend.value}"
        self.min_rows, self.refit_growth, self.max_rows, self.seed = min_rows, refit_growth, max_rows, seed
        self.version = 1

    def reset(self, num_layers: int, num_experts: int) -> None:
        self.num_experts = num_experts
        self.signals = CoactivationFeatures()
        self.signals.reset(num_layers, num_experts)
        self._x: list[np.ndarray] = []  # [E, F] per observed position
        self._y: list[np.ndarray] = []  # [E]
        self._rows = 0
        self._rows_at_fit = 0
        self._pending: tuple[int, int, np.ndarray] | None = None
        self._coef: np.ndarray | None = None  # [F] logistic weights
        self._intercept = 0.0
        self._booster = None
        self.num_fits = 0

    def observe(self, step: int, layer: int, expert_ids: np.ndarray) -> None:
        ids = np.asarray(expert_ids, np.int64)
        ids = ids[ids >= 0]
        if self._pending is not None and self._pending[:2] == (step, layer):
            x = self._pending[2]
        else:
            x = self.signals.features(step, layer)
        y = np.zeros(self.num_experts)
        y[ids] = 1.0
        self._x.append(x)
        self._y.append(y)
        self._rows += self.num_experts
        self.signals.observe(step, layer, ids)
        if self._rows - self._rows_at_fit >= max(self.min_rows, self.refit_growth * self._rows_at_fit):
            self._fit()

    def _fit(self) -> None:
        keep = max(1, self.max_rows // self.num_experts)
        del self._x[:-keep], self._y[:-keep]
        x = np.concatenate(self._x)  # [N, F]
        y = np.concatenate(self._y)  # [N]
        self._rows_at_fit = self._rows
        if y.min() == y.max():
            return
        if self.backend is Backend.LOGISTIC:
            from sklearn.linear_model import LogisticRegression

            model = LogisticRegression(C=1.0, solver="newton-cholesky", max_iter=50)
            model.fit(x, y)
            self._coef, self._intercept = model.coef_[0].copy(), float(model.intercept_[0])
        else:
            import lightgbm as lgb

            params = {"objective": "binary", "learning_rate": 0.1, "num_leaves": 15, "min_data_in_leaf": 50,
                      "verbose": -1, "seed": self.seed, "num_threads": 1, "deterministic": True}
            self._booster = lgb.train(params, lgb.Dataset(x, y, feature_name=list(FEATURE_NAMES)), 40)
        self.num_fits += 1
        self.version += 1

    def scores(self, step: int, layer: int) -> np.ndarray:
        x = self.signals.features(step, layer)  # [E, F]
        self._pending = (step, layer, x)
        if self._coef is not None:
            return 1.0 / (1.0 + np.exp(-(x @ self._coef + self._intercept)))
        if self._booster is not None:
            return np.asarray(self._booster.predict(x), np.float64)
        return self.signals.probabilities(step, layer)["context"]
