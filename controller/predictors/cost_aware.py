"""The tierplan expert-cache policy: evict by predicted reuse, prefetch one layer ahead under a load budget.

Runs in the controller's evaluation, and is the rule the agent applies with the predictor a Plan carries.
- Keep values (eviction): a resident's keep value estimates its use at the layer's next access: once the
  previous layer of the current step has routed, the demand predictor's probability p for this very step plus
  `future_weight` x its EWMA demand rate (half-life `half_life_steps` steps: use beyond this step); while a step's
  union is served its members are untouchable and the others are worth only their future use. The victim is the
  lowest keep value (recency breaks ties); when a union outgrows the cache (large batches), members already
  used in the step go first, the least useful of them.
- Prefetch (timing: after (s, l) has routed, for the next execution position): candidates in decreasing p, each
  admitted only if p >= the confidence threshold and p >= the keep value of the victim it displaces +
  `margin` (cost-aware admission: a load is spent only where it should win more than it risks), at most the
  harness's budget.
- Confidence and load budget: the threshold starts at `min_prob`, its floor. With `load_ratio` set, it rises
  (once per step, by `threshold_step` relative) while the policy's recent loads per demand (demand misses +
  prefetches, half-life `budget_half_life_steps`) exceed `load_ratio` x what LRU would load on the same
  stream at this capacity, estimated online from stack distances (miss_ratio.py), and falls back otherwise:
  prefetches are bounded by confidence, and loads by a budget the plan can set.
Never imports torch, runtime or agent.

Shape letters: L layers, E experts per layer.
"""

from __future__ import annotations

import numpy as np

from tierplan.controller.predictors.base import DemandPredictor
from tierplan.controller.predictors.miss_ratio import MissRatioCurves

_SERVING = 1e9  # keep value offset of an expert demanded in the step being served (x2 until it has been used)
_THRESHOLD_CEIL = 0.98


class CostAwarePolicy:
    """Predictive eviction + cost-aware prefetch; `predictor` None means eviction only."""

    def __init__(self, name: str, predictor: DemandPredictor | None, min_prob: float = 0.2, margin: float = 0.0,
                 half_life_steps: float = 64.0, future_weight: float = 0.5, load_ratio: float | None = None,
                 budget_half_life_steps: float = 64.0, threshold_step: float = 0.05) -> None:
        if load_ratio is not None and load_ratio <= 0:
            raise ValueError(f"{name}: load_ratio must be > 0, got {load_ratio}")
        self.name = name
        self.predictor = predictor
        self.min_prob, self.margin, self.future_weight = min_prob, margin, future_weight
        self.load_ratio, self.threshold_step = load_ratio, threshold_step
        self._decay = 1.0 - 0.5 ** (1.0 / half_life_steps)
        self._budget_decay = 1.0 - 0.5 ** (1.0 / budget_half_life_steps)

    def reset(self, num_layers: int, num_experts: int, capacity: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.capacity = capacity
        self.threshold = self.min_prob
        self._freq = np.zeros((num_layers, num_experts))  # [L, E] EWMA demand indicator per step
        self._keep = np.zeros((num_layers, num_experts))  # [L, E] keep values used by victim()
        self._clock = 0.0
        self._last_used = np.zeros((num_layers, num_experts))  # [L, E] tiebreak
        self._loads = self._demands = 0.0  # decayed, for the load budget
        self._curves = (MissRatioCurves(num_layers, num_experts, decay=self._budget_decay / num_layers)
                        if self.load_ratio is not None else None)
        if self.predictor is not None:
            self.predictor.reset(num_layers, num_experts)

    def _future(self, layer: int) -> np.ndarray:
        """[E] value of keeping an expert past the current step: its EWMA demand rate, recency as a tiebreak."""
        return self.future_weight * self._freq[layer] + 1e-6 * self._last_used[layer] / (self._clock + 1.0)

    def begin_layer(self, step: int, layer: int, union: np.ndarray) -> None:
        demanded = np.zeros(self.num_experts)
        demanded[union] = 1.0
        self._freq[layer] += self._decay * (demanded - self._freq[layer])
        keep = self._future(layer)
        keep[union] += 2.0 * _SERVING
        self._keep[layer] = keep
        if self._curves is not None:
            # One of this policy's steps, whatever its batch.
            self._curves.observe_step(layer, union, batch=1, distinct=True)
            self._loads *= 1.0 - self._budget_decay
            self._demands *= 1.0 - self._budget_decay
            self._demands += union.size
        if self.predictor is not None:
            self.predictor.observe(step, layer, union)

    def touch(self, layer: int, expert: int, hit: bool) -> None:
        self._clock += 1.0
        self._last_used[layer, expert] = self._clock
        if self._keep[layer, expert] >= 2.0 * _SERVING:
            # Used for this step: it may now make room for a member still to come, the least useful first.
            self._keep[layer, expert] -= _SERVING
        if not hit:
            self._loads += 1.0

    def victim(self, layer: int, evictable: np.ndarray) -> int:
        return int(np.where(evictable, self._keep[layer], np.inf).argmin())

    def lru_loads_per_demand(self) -> float:
        """LRU's loads per demand at this capacity on the recent stream (stack distances), all layers."""
        assert self._curves is not None
        misses = accesses = 0.0
        for layer in range(self.num_layers):
            per_step = self._curves.mean_union_size(layer) * self._curves.num_steps(layer)
            misses += per_step * (1.0 - self._curves.hit_rate_curve(layer)[self.capacity])
            accesses += per_step
        return misses / accesses if accesses else 1.0

    def _adapt_threshold(self) -> None:
        if self._curves is None or self._demands <= 0:
            return
        over = self._loads / self._demands > self.load_ratio * self.lru_loads_per_demand()
        self.threshold *= (1.0 + self.threshold_step) if over else (1.0 - self.threshold_step)
        self.threshold = min(max(self.threshold, self.min_prob), _THRESHOLD_CEIL)

    def prefetch(self, step: int, layer: int, resident: np.ndarray, budget: int) -> list[int]:
        future = self._future(layer)
        if self.predictor is None:
            self._keep[layer] = future
            return []
        if layer == 0:
            self._adapt_threshold()
        p = self.predictor.scores(step, layer)  # [E]
        keep = p + future
        self._keep[layer] = keep
        chosen: list[int] = []
        victim_keep = np.where(resident, keep, np.inf)  # the harness's victim order after each admitted load
        size = int(resident.sum())
        for j in np.argsort(-p, kind="stable").tolist():
            if len(chosen) >= budget or p[j] < self.threshold:
                break
            if resident[j]:
                continue
            if size < self.capacity:
                size += 1
            else:
                v = int(victim_keep.argmin())
                if p[j] < keep[v] + self.margin:
                    break  # p only falls and the next victim's keep only rises
                victim_keep[v] = np.inf
            chosen.append(j)
        self._loads += len(chosen)
        return chosen
