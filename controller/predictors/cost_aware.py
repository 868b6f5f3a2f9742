"""The tierplan expert-cache policy: evict by predicted reuse, prefetch one layer ahead with cost-aware admission.

Runs in the controller's evaluation (and, through the compact transition table a Plan carries, in the agent).
Eviction: each resident's keep value is its estimated probability of being demanded at the layer's next access:
a blend of an EWMA demand frequency (per step, half-life `half_life_steps`), the same-layer temporal signal
(the previous step's experts at this layer predict this step's), and, once the previous layer of the current
step has routed, the demand predictor's cross-layer score for this very step. Experts of the union being served
are never evicted for one another.
Prefetch (timing: after (s, l) routed, for (s, l + 1)): candidates in decreasing predicted probability p; each
is admitted only if p >= `min_prob` and p beats the keep value of the victim it would displace by `margin`
(a load is spent only where it is expected to win a hit), at most the harness's budget.
Never imports torch, runtime or agent.

Shape letters: L layers, E experts per layer.
"""

from __future__ import annotations

import numpy as np

from controller.predictors.base import DemandPredictor

_SERVING = 1e9  # keep value of an expert demanded in the step being served


class CostAwarePolicy:
    """Predictive eviction + cost-aware prefetch; `predictor` None means eviction only."""

    def __init__(self, name: str, predictor: DemandPredictor | None, min_prob: float = 0.3,
                 margin: float = 0.1, half_life_steps: float = 64.0, temporal_weight: float = 0.5) -> None:
        self.name = name
        self.predictor = predictor
        self.min_prob, self.margin = min_prob, margin
        self._decay = 1.0 - 0.5 ** (1.0 / half_life_steps)
        self.temporal_weight = temporal_weight

    def reset(self, num_layers: int, num_experts: int, capacity: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.capacity = capacity
        self._freq = np.zeros((num_layers, num_experts))  # [L, E] EWMA demand indicator per step
        self._prev = np.zeros((num_layers, num_experts))  # [L, E] demanded in the previous step
        self._keep = np.zeros((num_layers, num_experts))  # [L, E] keep values used by victim()
        self._clock = 0.0
        self._last_used = np.zeros((num_layers, num_experts))  # [L, E] tiebreak
        if self.predictor is not None:
            self.predictor.reset(num_layers, num_experts)

    def _base_keep(self, layer: int) -> np.ndarray:
        w = self.temporal_weight
        return (1.0 - w) * self._freq[layer] + w * self._prev[layer] + 1e-6 * self._last_used[layer] / (
            self._clock + 1.0)

    def begin_layer(self, step: int, layer: int, union: np.ndarray) -> None:
        keep = self._keep[layer]
        keep[union] = _SERVING
        demanded = np.zeros(self.num_experts)
        demanded[union] = 1.0
        self._freq[layer] += self._decay * (demanded - self._freq[layer])
        self._prev[layer] = demanded
        if self.predictor is not None:
            self.predictor.observe(step, layer, union)

    def touch(self, layer: int, expert: int, hit: bool) -> None:
        self._clock += 1.0
        self._last_used[layer, expert] = self._clock

    def victim(self, layer: int, evictable: np.ndarray) -> int:
        return int(np.where(evictable, self._keep[layer], np.inf).argmin())

    def prefetch(self, step: int, layer: int, resident: np.ndarray, budget: int) -> list[int]:
        base = self._base_keep(layer)
        if self.predictor is None:
            self._keep[layer] = base
            return []
        p = self.predictor.scores(step, layer)  # [E]
        keep = np.maximum(base, p)
        self._keep[layer] = keep
        chosen: list[int] = []
        sim = resident.copy()  # residents as the harness will see them after each admitted load
        size = int(sim.sum())
        for j in np.argsort(-p, kind="stable").tolist():
            if len(chosen) >= budget or p[j] < self.min_prob:
                break
            if sim[j]:
                continue
            if size < self.capacity:
                size += 1
            else:
                # The victim the harness will ask for: lowest keep among residents not prefetched this round.
                v = int(np.where(sim & ~np.isin(np.arange(self.num_experts), chosen), keep, np.inf).argmin())
                if p[j] < keep[v] + self.margin:
                    break  # p only falls and the next victim's keep only rises
                sim[v] = False
            sim[j] = True
            chosen.append(j)
        return chosen
