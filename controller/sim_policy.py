"""Expert-cache policies the simulator replays: given one step's per-layer unions of routed experts, which
ones had to be loaded on demand (misses) and which were streamed ahead (prefetches).

Runs in `tierplan sim`. Pure Python + numpy. A policy is anything with `name` and
`on_step(unions) -> CacheOutcome` (`ExpertCachePolicy`), so the predictors' policies and the loop's plans can
be replayed by wrapping them (`CallablePolicy`); a controller `Plan` replays through `PlanPolicy`. Built in:
`lru` (one slot pool shared by all layers, least recently used first, never an expert the layer is using:
the reference engine's OnDemandExperts), `lru-layer` and `lfu-layer` (a fixed number of slots per layer).
Policies never see the future.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tierplan.controller.protocol import Plan


@dataclass(frozen=True)
class CacheOutcome:
    hits: tuple[int, ...]  # per MoE layer
    misses: tuple[int, ...]  # per MoE layer: loaded on demand when the layer found them absent
    prefetches: tuple[int, ...] = ()  # per MoE layer: loaded ahead of the layer (used or not)
    # Some layer's union outran the slots it may hold at once (at least one, as the engine's `capacity_of`): the
    # engine runs that step chunked, off its graphs (the cost model's `chunked_step_ms` for a decode step); False
    # where a policy cannot say (`CallablePolicy`). A decode step over the graphs' batch leaves them too, for
    # another reason (`batch_too_large`), which this does not price.
    chunked: bool = False


class ExpertCachePolicy(Protocol):
    name: str

    def on_step(self, unions: Sequence[np.ndarray]) -> CacheOutcome: ...


class GlobalLRU:
    """One pool of `num_slots` for all layers; a layer needing more experts than slots runs them in chunks
    of `num_slots`, as the engine does."""

    name = "lru"

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"GlobalLRU: num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._lru: OrderedDict[tuple[int, int], None] = OrderedDict()

    def on_step(self, unions: Sequence[np.ndarray]) -> CacheOutcome:
        hits, misses = [], []
        for layer, union in enumerate(unions):
            h = m = 0
            experts = union.tolist()
            for lo in range(0, len(experts), self.num_slots):
                chunk = experts[lo:lo + self.num_slots]
                want = {(layer, e) for e in chunk}
                # As the engine's ensure: hits are touched first, then the misses load as one list (victims
                # ranked once, never one the chunk wants) and become the most recent, in list order.
                missing = []
                for key in ((layer, e) for e in chunk):
                    if key in self._lru:
                        h += 1
                        self._lru.move_to_end(key)
                    else:
                        missing.append(key)
                m += len(missing)
                excess = len(self._lru) + len(missing) - self.num_slots
                if excess > 0:
                    for victim in [k for k in self._lru if k not in want][:excess]:
                        del self._lru[victim]
                for key in missing:
                    self._lru[key] = None
            hits.append(h)
            misses.append(m)
        return CacheOutcome(tuple(hits), tuple(misses), chunked=any(len(u) > self.num_slots for u in unions))


class LayerCache:
    """`slots_per_layer` slots in each layer, evicting least recently (`lru-layer`) or least frequently
    (`lfu-layer`, ties by recency) used."""

    def __init__(self, slots_per_layer: int, num_layers: int, frequency: bool = False) -> None:
        if slots_per_layer < 0:
            raise ValueError(f"LayerCache: slots_per_layer must be >= 0, got {slots_per_layer}")
        self.slots, self.frequency = slots_per_layer, frequency
        self.name = "lfu-layer" if frequency else "lru-layer"
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_layers)]
        self._count: list[dict[int, int]] = [{} for _ in range(num_layers)]

    def on_step(self, unions: Sequence[np.ndarray]) -> CacheOutcome:
        hits, misses = [], []
        for layer, union in enumerate(unions):
            lru, count = self._lru[layer], self._count[layer]
            experts = union.tolist()
            for e in experts:
                count[e] = count.get(e, 0) + 1
            resident = [e for e in experts if e in lru]
            absent = [e for e in experts if e not in lru]
            hits.append(len(resident))
            misses.append(len(absent))
            want = set(experts)
            # Victims in eviction order, ranked once per layer and step: the step's own experts are never
            # candidates, so loading one never changes the ranking of the rest.
            cands = [k for k in lru if k not in want]
            if self.frequency:
                cands.sort(key=count.__getitem__)  # stable: ties stay least recently used first
            victims = iter(cands)
            for e in absent:  # loaded for this step; kept only if a slot can be had without evicting the step's own
                if len(lru) >= self.slots:
                    victim = next(victims, None)
                    if victim is None:
                        continue
                    del lru[victim]
                if self.slots:
                    lru[e] = None
            for e in experts:
                if e in lru:
                    lru.move_to_end(e)
        return CacheOutcome(tuple(hits), tuple(misses), chunked=any(len(u) > max(1, self.slots) for u in unions))


class CallablePolicy:
    """Wrap `fn(unions) -> (misses, prefetches)` (per-layer sequences) as a policy."""

    def __init__(self, name: str, fn: Callable[[Sequence[np.ndarray]], tuple[Sequence[int], Sequence[int]]]) -> None:
        self.name, self._fn = name, fn

    def on_step(self, unions: Sequence[np.ndarray]) -> CacheOutcome:
        misses, prefetches = self._fn(unions)
        hits = tuple(max(0, len(u) - int(m)) for u, m in zip(unions, misses, strict=True))
        return CacheOutcome(hits, tuple(int(m) for m in misses), tuple(int(p) for p in prefetches))


class PlanPolicy:
    """Replays a controller `Plan` as the agent would hold it between plans: each MoE layer keeps
    `expert_bytes_per_layer / expert_bytes` slots, its pinned experts always resident (they take slots of
    that layer), the other slots least recently used. A layer's bytes must be whole slots and hold its pins
    (ValueError otherwise): a plan is replayed whole or not at all."""

    name = "plan"

    def __init__(self, plan: Plan, moe_layers: Sequence[int], expert_bytes: int) -> None:
        caps = plan.expert_bytes_per_layer
        if len(caps) < max(moe_layers) + 1:
            raise ValueError(f"PlanPolicy: plan {plan.plan_id!r} covers {len(caps)} layers, the model's MoE layers "
                             f"go up to {max(moe_layers)}")
        index = {layer: j for j, layer in enumerate(moe_layers)}
        self._pinned: list[set[int]] = [set() for _ in moe_layers]
        for key in plan.pinned_experts:
            if key.layer not in index:
                raise ValueError(f"PlanPolicy: plan {plan.plan_id!r} pins expert {key.expert} of layer {key.layer}, "
                                 "which is not a MoE layer")
            self._pinned[index[key.layer]].add(key.expert)
        for j, layer in enumerate(moe_layers):
            # A plan replayed in part would be a different plan: refuse what the agent would not hold either.
            if caps[layer] % expert_bytes:
                raise ValueError(f"PlanPolicy: plan {plan.plan_id!r} gives layer {layer} {caps[layer]} expert "
                                 f"bytes, not a whole number of {expert_bytes}-byte expert slots")
            if len(self._pinned[j]) > caps[layer] // expert_bytes:
                raise ValueError(f"PlanPolicy: plan {plan.plan_id!r} pins {len(self._pinned[j])} experts of layer "
                                 f"{layer}, more than its {caps[layer] // expert_bytes} slots")
        self._free = [LayerCache(caps[layer] // expert_bytes - len(self._pinned[j]), 1)
                      for j, layer in enumerate(moe_layers)]

    def on_step(self, unions: Sequence[np.ndarray]) -> CacheOutcome:
        hits, misses, chunked = [], [], False
        for j, union in enumerate(unions):
            pinned = [e for e in union.tolist() if e in self._pinned[j]]
            rest = np.array([e for e in union.tolist() if e not in self._pinned[j]], dtype=np.int64)
            out = self._free[j].on_step([rest])
            hits.append(len(pinned) + out.hits[0])
            misses.append(out.misses[0])
            chunked = chunked or out.chunked  # the unpinned experts outran the layer's other slots
        return CacheOutcome(tuple(hits), tuple(misses), chunked=chunked)


POLICY_NAMES = ("lru", "lru-layer", "lfu-layer")


def make_policy(name: str, num_slots: int, num_moe_layers: int) -> ExpertCachePolicy:
    """A built-in policy over `num_slots` expert slots in all (per-layer policies split them evenly)."""
    if name == "lru":
        return GlobalLRU(num_slots)
    if name in ("lru-layer", "lfu-layer"):
        return LayerCache(math.floor(num_slots / num_moe_layers), num_moe_layers, frequency=name == "lfu-layer")
    raise ValueError(f"unknown policy {name!r}; expected one of {list(POLICY_NAMES)}")
