"""The named expert-cache policies `tierplan eval predictors` replays, in report order (offline evaluation).

Each entry builds a fresh policy from the per-layer access streams; only `belady` reads them (it is the
clairvoyant bound), every other policy is online. Never imports torch, runtime or agent.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from controller.predictors.base import ExpertCachePolicy
from controller.predictors.belady import BeladyPolicy
from controller.predictors.caches import EWMALFUPolicy, LFRUPolicy, LFUPolicy, LRUPolicy
from controller.predictors.cost_aware import CostAwarePolicy
from controller.predictors.learned import LearnedDemandPredictor
from controller.predictors.transition import TransitionTable

PolicyFactory = Callable[[list[np.ndarray]], ExpertCachePolicy]


def policy_factories() -> dict[str, PolicyFactory]:
    """name -> factory; baselines first, then belady, then the tierplan policies."""
    return {
        "lru": lambda streams: LRUPolicy(),
        "lfu": lambda streams: LFUPolicy(),
        "lfu-ewma": lambda streams: EWMALFUPolicy(),
        "lfru": lambda streams: LFRUPolicy(),
        "belady": BeladyPolicy,
        "tierplan-freq": lambda streams: CostAwarePolicy("tierplan-freq", None),
        "tierplan-xlayer": lambda streams: CostAwarePolicy("tierplan-xlayer", TransitionTable(1, 1)),
        "tierplan-learned": lambda streams: CostAwarePolicy("tierplan-learned", LearnedDemandPredictor()),
        "tierplan-lgbm": lambda streams: CostAwarePolicy("tierplan-lgbm", LearnedDemandPredictor("lightgbm")),
    }
