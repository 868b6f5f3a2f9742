"""The named expert-cache policies `tierplan eval predictors` replays, in report order (offline evaluation).

Each entry builds a fresh policy for one replay from a `ReplayInputs`: only `belady` reads the per-layer
streams (it is the clairvoyant bound). The tierplan policies get their demand scores as causal score streams
(each position scored only from what preceded it, exactly as the online predictor would, see learned.py), so a
predictor's work is done once per trace, vectorized. Never imports torch, runtime or agent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tierplan.controller.predictors.base import ExpertCachePolicy
from tierplan.controller.predictors.belady import BeladyPolicy
from tierplan.controller.predictors.caches import EWMALFUPolicy, LFRUPolicy, LFUPolicy, LRUPolicy
from tierplan.controller.predictors.cooccurrence import feature_stream
from tierplan.controller.predictors.cost_aware import CostAwarePolicy
from tierplan.controller.predictors.learned import Backend, LearnedDemandPredictor, RecordedScores
from tierplan.controller.predictors.transition import compact_score_stream

CHUNK_TOKENS = 16  # the predictors' learning chunk (a plan window) in tokens


@dataclass
class ReplayInputs:
    """One trace at one batch size, and the causal score streams computed from it (each at most once)."""

    unions: list[list[np.ndarray]]  # [S][L] distinct demanded experts per step and layer
    streams: list[np.ndarray]  # [L] per-layer access streams (Belady only)
    num_layers: int
    num_experts: int
    batch: int
    _cache: dict[str, object] = field(default_factory=dict)

    @property
    def chunk_steps(self) -> int:
        return max(1, CHUNK_TOKENS // self.batch)

    def features(self) -> tuple[np.ndarray, np.ndarray]:
        if "features" not in self._cache:
            self._cache["features"] = feature_stream(self.unions, self.num_layers, self.num_experts,
                                                     self.chunk_steps)
        return self._cache["features"]  # type: ignore[return-value]

    def learned_scores(self, backend: Backend) -> np.ndarray:
        key = f"learned-{backend.value}"
        if key not in self._cache:
            model = (LearnedDemandPredictor(backend, chunk_steps=self.chunk_steps) if backend is Backend.LOGISTIC
                     else LearnedDemandPredictor(backend, chunk_steps=self.chunk_steps, min_rows=8000,
                                                 refit_growth=0.6, max_rows=40_000))
            self._cache[key] = model.score_stream(self.unions, self.num_layers, self.num_experts, self.features())
        return self._cache[key]  # type: ignore[return-value]


PolicyFactory = Callable[[ReplayInputs], ExpertCachePolicy]


LOAD_RATIO = 1.45  # the load budget guard: at most this many times LRU's loads (estimated online)


def _learned(name: str, backend: Backend, load_ratio: float = LOAD_RATIO) -> PolicyFactory:
    def make(r: ReplayInputs) -> ExpertCachePolicy:
        return CostAwarePolicy(name, RecordedScores(name, r.learned_scores(backend)), load_ratio=load_ratio)
    return make


def _xlayer(r: ReplayInputs) -> ExpertCachePolicy:
    stream = compact_score_stream(r.unions, r.num_layers, r.num_experts, r.chunk_steps)
    # Row means of a top-m table are not calibrated like the learned blend: a lower confidence floor, the same
    # load guard.
    return CostAwarePolicy("tierplan-xlayer", RecordedScores("tierplan-xlayer", stream), min_prob=0.1,
                           load_ratio=LOAD_RATIO)


def policy_factories(with_lgbm: bool = False) -> dict[str, PolicyFactory]:
    """name -> factory; baselines first, then belady, then the tierplan policies (LightGBM on request: on the
    bundled traces it matches the logistic blend at several times the cost)."""
    lgbm = {"tierplan-lgbm": _learned("tierplan-lgbm", Backend.LIGHTGBM)} if with_lgbm else {}
    return {
        "lru": lambda r: LRUPolicy(),
        "lfu": lambda r: LFUPolicy(),
        "lfu-ewma": lambda r: EWMALFUPolicy(),
        "lfru": lambda r: LFRUPolicy(),
        "belady": lambda r: BeladyPolicy(r.streams),
        "tierplan-freq": lambda r: CostAwarePolicy("tierplan-freq", None),
        "tierplan-xlayer": _xlayer,
        "tierplan-learned": _learned("tierplan-learned", Backend.LOGISTIC),
        "tierplan-learned-eq": _learned("tierplan-learned-eq", Backend.LOGISTIC, load_ratio=1.0),
        **lgbm,
    }
