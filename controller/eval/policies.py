"""The named expert-cache policies `tierplan eval predictors` replays, in report order (offline evaluation).

Each entry builds a fresh policy for one replay from a `ReplayInputs`: only `belady` reads the per-layer
streams (it is the clairvoyant bound). The tierplan policies get their demand scores as causal score streams
(each position scored only from what preceded it, exactly as the online predictor would, see learned.py), so a
predictor's work is done once per trace, vectorized. Never imports torch, runtime or agent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from controller.predictors.base import ExpertCachePolicy
from controller.predictors.belady import BeladyPolicy
from controller.predictors.caches import EWMALFUPolicy, LFRUPolicy, LFUPolicy, LRUPolicy
from controller.predictors.cost_aware import CostAwarePolicy
from controller.predictors.learned import Backend, LearnedDemandPredictor, RecordedScores
from controller.predictors.transition import compact_score_stream

CHUNK_TOKENS = 16  # the predictors' learning chunk (a plan window) in tokens


@dataclass(frozen=True)
class ReplayInputs:
    unions: list[list[np.ndarray]]  # [S][L] distinct demanded experts per step and layer
    streams: list[np.ndarray]  # [L] per-layer access streams (Belady only)
    num_layers: int
    num_experts: int
    batch: int

    @property
    def chunk_steps(self) -> int:
        return max(1, CHUNK_TOKENS // self.batch)


PolicyFactory = Callable[[ReplayInputs], ExpertCachePolicy]


LOAD_RATIO = 1.45  # the load budget guard: at most this many times LRU's loads (estimated online)


def _learned(name: str, backend: Backend, load_ratio: float = LOAD_RATIO) -> PolicyFactory:
    def make(r: ReplayInputs) -> ExpertCachePolicy:
        model = (LearnedDemandPredictor(backend, chunk_steps=r.chunk_steps) if backend is Backend.LOGISTIC else
                 LearnedDemandPredictor(backend, chunk_steps=r.chunk_steps, min_rows=8000, refit_growth=0.6,
                                        max_rows=40_000))
        stream = model.score_stream(r.unions, r.num_layers, r.num_experts)
        return CostAwarePolicy(name, RecordedScores(name, stream), load_ratio=load_ratio)
    return make


def _xlayer(r: ReplayInputs) -> ExpertCachePolicy:
    stream = compact_score_stream(r.unions, r.num_layers, r.num_experts, r.chunk_steps)
    return CostAwarePolicy("tierplan-xlayer", RecordedScores("tierplan-xlayer", stream), load_ratio=LOAD_RATIO)


def policy_factories() -> dict[str, PolicyFactory]:
    """name -> factory; baselines first, then belady, then the tierplan policies."""
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
        "tierplan-lgbm": _learned("tierplan-lgbm", Backend.LIGHTGBM),
    }
