"""`static_lfru`: a fixed-size expert cache per layer with frequency-weighted LRU eviction (vLLM PR #37190).

Bench driver code. The PR keeps the hottest N experts of each layer on the GPU and evicts by LFRU, so that
early layers cannot take the whole cache as they do under plain LRU in sequential MoE execution. Here: the
same fixed cache as `static_lru` (75% of the budget, an even cap per layer, so each layer's cache size is
fixed), and a victim order that ranks a layer's residents by score = uses / (1 + steps since the last use),
lowest first (ties: least recently used first). Uses are counted when a step's routes are known, before its
layers run (`observe_routes`). It must never move bytes itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierplan.bench.baselines.base import PointContext, PolicyRun, StepExperts, make_plan, observe_routes
from tierplan.bench.baselines.static import DEVICE_MEMORY_RATIO, fixed_split

if TYPE_CHECKING:
    from tierplan.runtime.engine.engine import ReferenceEngine
    from tierplan.runtime.engine.victims import Key


class LFRUOrder:
    """The victim order (module docstring). `observe(step_experts)` counts one step's uses; `score(key)`."""

    def __init__(self) -> None:
        self.step = 0
        self.uses: dict[Key, int] = {}
        self.last: dict[Key, int] = {}
        self.rankings = 0

    def observe(self, used: StepExperts) -> None:
        self.step += 1
        for m, experts in enumerate(used):
            for e in experts:
                self.uses[(m, e)] = self.uses.get((m, e), 0) + 1
                self.last[(m, e)] = self.step

    def score(self, key: Key) -> float:
        if key not in self.uses:
            return 0.0
        return self.uses[key] / (1 + self.step - self.last[key])

    def __call__(self, candidates: list[Key]) -> list[Key]:
        """Lowest score first; candidates arrive least recently used first, and sorting is stable."""
        self.rankings += 1
        return sorted(candidates, key=self.score)


class StaticLFRU:
    name = "static_lfru"
    needs_future = False

    def __init__(self, device_memory_ratio: float = DEVICE_MEMORY_RATIO) -> None:
        self.ratio = device_memory_ratio

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        return {}

    def start(self, engine: ReferenceEngine, ctx: PointContext) -> PolicyRun:
        split = fixed_split(ctx, engine, int(self.ratio * ctx.hbm_budget_bytes))
        order = LFRUOrder()
        observe_routes(engine, order.observe)
        why = (f"fixed cache of {split.expert_slots_per_layer} experts per layer, frequency-weighted LRU eviction "
               f"(uses / (1 + steps since last use)); KV {split.kv_gpu_blocks} GPU blocks")
        return PolicyRun(make_plan(ctx, split, self.name, why), victim_order=order, split=split,
                         notes="LFRU score uses/(1+age in steps); cache size as static_lru")
