"""Replay harness: a per-layer expert cache driven by a policy over a routing trace, scored on its second half.

Runs offline (the `tierplan eval predictors` command, tests). Model of the engine:
- Capacity: each layer keeps `capacity = max(1, round(cache_frac * num_experts))` experts resident; it starts
  empty. One step is one token (batch 1) or B consecutive tokens of the trace (their union per layer).
- Order: step s runs layers 0..L-1, then step s+1. At (s, l) the router's union is known first
  (`begin_layer`), then each expert of the union is accessed in first-appearance order (token order, then
  router order). A resident expert is a hit; otherwise it is loaded on demand (a miss), evicting the policy's
  victim among the residents (any but the incoming one).
- Prefetch timing rule: right after (s, l)'s accesses, the policy may prefetch for the next layer in execution
  order, (s, l + 1), or (s + 1, 0) after the last layer, at most `top_k * B` loads (capped at the capacity).
  Those loads are issued before that layer's router runs, so an expert they bring in counts as a hit when it is
  demanded there (the copy is assumed to finish within one layer's compute; the cost model judges that).
  A prefetch may not evict another expert prefetched in the same round.
- Learning is online from the first step; the metrics count only steps s >= num_steps // 2.

Metrics: hit_rate = hits / demands (demands = accesses of the scored steps); loads_per_demand = (demand loads +
prefetch loads) / demands; prefetch_waste = prefetched experts evicted (or left at the end) unused / prefetch
loads. Never imports torch, runtime or agent; a policy that breaks its prefetch promise (over budget, an
expert already resident, out of range) is refused with ValueError.

Shape letters: T tokens, L layers, K experts per token, E experts per layer, S steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from tierplan.controller.predictors.base import ExpertCachePolicy
from tierplan.controller.routing_npz import RoutingNpz


@dataclass(frozen=True)
class CacheReplayResult:
    policy: str
    hit_rate: float
    loads_per_demand: float
    demands: int
    hits: int
    demand_loads: int
    prefetch_loads: int
    prefetch_hits: int
    prefetch_waste: float

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def cache_capacity(cache_frac: float, num_experts: int) -> int:
    if not 0.0 < cache_frac <= 1.0:
        raise ValueError(f"cache_frac must be in (0, 1], got {cache_frac}")
    return max(1, min(num_experts, round(cache_frac * num_experts)))


def step_unions(trace: RoutingNpz, batch: int) -> list[list[np.ndarray]]:
    """unions[s][l]: distinct experts of tokens [s*B, (s+1)*B) at layer l, in first-appearance order."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    ids = np.asarray(trace.expert_ids, np.int64)  # [T, L, K]
    num_steps = -(-trace.num_tokens // batch)
    unions: list[list[np.ndarray]] = []
    for s in range(num_steps):
        block = ids[s * batch:(s + 1) * batch]  # [B, L, K]
        per_layer = []
        for layer in range(trace.num_layers):
            flat = block[:, layer, :].ravel()
            flat = flat[flat >= 0]
            if batch > 1:
                _, first = np.unique(flat, return_index=True)
                flat = flat[np.sort(first)]
            per_layer.append(flat)
        unions.append(per_layer)
    return unions


def layer_streams(unions: Sequence[Sequence[np.ndarray]], num_layers: int) -> list[np.ndarray]:
    """Per layer, the concatenated access stream the harness makes (what Belady and miss-ratio curves see)."""
    return [np.concatenate([u[layer] for u in unions]) if unions else np.zeros(0, np.int64)
            for layer in range(num_layers)]


def replay(trace: RoutingNpz, policy: ExpertCachePolicy, cache_frac: float, batch: int = 1,
           unions: list[list[np.ndarray]] | None = None, first_scored: int | None = None) -> CacheReplayResult:
    """Run `policy` over `trace` (see module docstring); `unions` may be passed to share step_unions' work.
    `first_scored` (default num_steps // 2) is the first step counted in the metrics."""
    capacity = cache_capacity(cache_frac, trace.num_experts)
    if unions is None:
        unions = step_unions(trace, batch)
    num_layers, num_experts = trace.num_layers, trace.num_experts
    num_steps = len(unions)
    budget = min(capacity, trace.top_k * batch)
    first_scored = num_steps // 2 if first_scored is None else first_scored
    policy.reset(num_layers, num_experts, capacity, trace.top_k)
    resident = np.zeros((num_layers, num_experts), bool)  # [L, E]
    pending = np.zeros((num_layers, num_experts), bool)  # [L, E] prefetched, not yet demanded
    size = [0] * num_layers
    c = {"demands": 0, "hits": 0, "demand_loads": 0, "prefetch_loads": 0, "prefetch_hits": 0, "wasted": 0}

    def load(layer: int, expert: int, evictable: np.ndarray, scored: bool) -> None:
        if size[layer] >= capacity:
            v = policy.victim(layer, evictable)
            if not (0 <= v < num_experts and evictable[v]):
                raise ValueError(f"{policy.name}: victim {v} at layer {layer} is not an evictable resident")
            resident[layer, v] = False
            if pending[layer, v]:
                pending[layer, v] = False
                c["wasted"] += scored
        else:
            size[layer] += 1
        resident[layer, expert] = True

    for s in range(num_steps):
        scored = s >= first_scored
        for layer in range(num_layers):
            union = unions[s][layer]
            policy.begin_layer(s, layer, union)
            res = resident[layer]
            for e in union.tolist():
                hit = bool(res[e])
                if hit:
                    if pending[layer, e]:
                        pending[layer, e] = False
                        c["prefetch_hits"] += scored
                else:
                    evictable = res.copy()
                    load(layer, e, evictable, scored)
                    c["demand_loads"] += scored
                c["demands"] += scored
                c["hits"] += scored and hit
                policy.touch(layer, e, hit)
            ns, nl = (s, layer + 1) if layer + 1 < num_layers else (s + 1, 0)
            if ns >= num_steps:
                continue
            wanted = policy.prefetch(ns, nl, resident[nl].copy(), budget)
            if len(wanted) > budget:
                raise ValueError(f"{policy.name}: {len(wanted)} prefetches for layer {nl} over the budget {budget}")
            issued = np.zeros(num_experts, bool)
            for e in wanted:
                if not (0 <= e < num_experts) or resident[nl, e]:
                    raise ValueError(f"{policy.name}: prefetch of expert {e} at layer {nl}: out of range or resident")
                load(nl, e, resident[nl] & ~issued, scored)
                issued[e] = True
                pending[nl, e] = True
                c["prefetch_loads"] += scored
    c["wasted"] += int(pending.sum()) if num_steps > first_scored else 0
    demands = max(c["demands"], 1)
    return CacheReplayResult(
        policy=policy.name, hit_rate=c["hits"] / demands,
        loads_per_demand=(c["demand_loads"] + c["prefetch_loads"]) / demands, demands=c["demands"],
        hits=c["hits"], demand_loads=c["demand_loads"], prefetch_loads=c["prefetch_loads"],
        prefetch_hits=c["prefetch_hits"], prefetch_waste=c["wasted"] / max(c["prefetch_loads"], 1))


def replay_all(trace: RoutingNpz, policies: Sequence[Callable[[list[np.ndarray]], ExpertCachePolicy]],
               cache_frac: float, batch: int = 1) -> list[CacheReplayResult]:
    """Replay each policy factory (given the per-layer streams, which only Belady may use) on one trace."""
    unions = step_unions(trace, batch)
    streams = layer_streams(unions, trace.num_layers)
    return [replay(trace, make(streams), cache_frac, batch, unions) for make in policies]
