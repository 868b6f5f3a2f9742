"""Eviction baselines, Belady and the replay harness on small synthetic traces made here."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from tierplan.controller.eval.expert_cache import cache_capacity, layer_streams, replay, step_unions
from tierplan.controller.predictors.belady import BeladyPolicy, next_use_times
from tierplan.controller.predictors.caches import EWMALFUPolicy, LFRUPolicy, LFUPolicy, LRUPolicy
from tierplan.controller.predictors.cost_aware import CostAwarePolicy
from tierplan.controller.routing_npz import synthetic_routing


def random_trace(seed: int, num_tokens: int = 160, num_layers: int = 2, num_experts: int = 8, top_k: int = 2,
                 skew: float = 1.0):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(num_experts, skew), size=num_layers)  # [L, E]
    ids = np.stack([[rng.choice(num_experts, top_k, replace=False, p=p[layer]) for layer in range(num_layers)]
                    for _ in range(num_tokens)])  # [T, L, K]
    return synthetic_routing(ids, num_experts)


def brute_force_lru_hits(stream: np.ndarray, capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for e in stream.tolist():
        if e in cache:
            hits += 1
            cache.move_to_end(e)
        else:
            cache[e] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def _online_no_prefetch():
    return [LRUPolicy(), LFUPolicy(), EWMALFUPolicy(), LFRUPolicy(), CostAwarePolicy("tierplan-freq", None)]


@pytest.mark.parametrize("seed", range(12))
def test_belady_bounds_every_online_eviction_policy(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    num_experts = int(rng.choice([4, 8, 16]))
    top_k = int(rng.integers(1, 4))
    trace = random_trace(seed, num_experts=num_experts, top_k=top_k, skew=float(rng.choice([0.3, 1.0, 5.0])))
    frac = float(rng.choice([0.25, 0.5, 0.75]))
    batch = int(rng.choice([1, 3]))
    unions = step_unions(trace, batch)
    # MIN minimises misses over the whole stream (not over any suffix of it): score from the first step.
    belady = replay(trace, BeladyPolicy(layer_streams(unions, trace.num_layers)), frac, batch, unions, 0)
    for policy in _online_no_prefetch():
        r = replay(trace, policy, frac, batch, unions, 0)
        assert r.prefetch_loads == 0
        assert r.hit_rate <= belady.hit_rate + 1e-12, (policy.name, r.hit_rate, belady.hit_rate)
        assert r.loads_per_demand == pytest.approx(1.0 - r.hit_rate)


@pytest.mark.parametrize("batch", [1, 4])
def test_harness_lru_equals_a_brute_force_lru_on_the_second_half(batch: int) -> None:
    trace = random_trace(7, num_tokens=101, num_layers=3)
    unions = step_unions(trace, batch)
    first = len(unions) // 2
    capacity = cache_capacity(0.5, trace.num_experts)
    hits = demands = 0
    for layer in range(trace.num_layers):
        head = np.concatenate([u[layer] for u in unions[:first]])
        whole = np.concatenate([u[layer] for u in unions])
        hits += brute_force_lru_hits(whole, capacity) - brute_force_lru_hits(head, capacity)
        demands += whole.size - head.size
    r = replay(trace, LRUPolicy(), 0.5, batch, unions)
    assert (r.hits, r.demands) == (hits, demands)


def test_step_unions_are_distinct_in_first_appearance_order() -> None:
    ids = np.array([[[3, 1]], [[1, 2]], [[0, 3]]])  # [T=3, L=1, K=2]
    unions = step_unions(synthetic_routing(ids, 4), 2)
    assert [u[0].tolist() for u in unions] == [[3, 1, 2], [0, 3]]


def test_next_use_times() -> None:
    assert next_use_times(np.array([1, 2, 1, 3, 2])).tolist()[:3] == [2, 4, np.iinfo(np.int64).max]


class _GreedyPrefetcher(LRUPolicy):
    name = "greedy"

    def prefetch(self, step: int, layer: int, resident: np.ndarray, budget: int) -> list[int]:
        return np.flatnonzero(~resident).tolist()[: budget + 1]


class _ResidentPrefetcher(LRUPolicy):
    name = "resident"

    def prefetch(self, step: int, layer: int, resident: np.ndarray, budget: int) -> list[int]:
        return np.flatnonzero(resident).tolist()[:1]


@pytest.mark.parametrize("policy, message", [(_GreedyPrefetcher(), "over the budget"),
                                              (_ResidentPrefetcher(), "out of range or resident")])
def test_a_policy_breaking_its_prefetch_promise_is_refused(policy, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replay(random_trace(1), policy, 0.5)


def test_prefetched_expert_demanded_next_layer_is_a_hit() -> None:
    # Layer 1 always routes to expert (layer-0 expert + 4): a perfect one-layer-ahead prefetcher hits every time.
    class Oracle(LRUPolicy):
        name = "oracle"

        def begin_layer(self, step: int, layer: int, union: np.ndarray) -> None:
            self._src = union

        def prefetch(self, step: int, layer: int, resident: np.ndarray, budget: int) -> list[int]:
            if layer != 1:
                return []
            want = [int(e) + 4 for e in self._src if not resident[int(e) + 4]]
            return want[:budget]

    rng = np.random.default_rng(0)
    first = rng.integers(0, 4, size=200)
    ids = np.stack([first, first + 4], axis=1)[:, :, None]  # [T, 2, 1]
    trace = synthetic_routing(ids, 8)
    r = replay(trace, Oracle(), 0.25)
    layer0 = first[100:]
    layer0_lru_hits = brute_force_lru_hits(first, 2) - brute_force_lru_hits(first[:100], 2)
    assert r.hits == layer0_lru_hits + layer0.size  # every layer-1 demand hits
    assert r.prefetch_hits == r.prefetch_loads > 0
    assert r.prefetch_waste == 0.0


def test_cache_frac_and_batch_are_checked() -> None:
    trace = random_trace(0)
    with pytest.raises(ValueError, match="cache_frac"):
        replay(trace, LRUPolicy(), 0.0)
    with pytest.raises(ValueError, match="batch"):
        replay(trace, LRUPolicy(), 0.5, batch=0)


def test_cost_aware_eviction_order_within_a_step() -> None:
    policy = CostAwarePolicy("tierplan-freq", None)
    policy.reset(1, 6, 3, 2)
    for step in range(20):  # expert 5 is popular, 4 rare
        policy.begin_layer(step, 0, np.array([5] if step % 4 else [4]))
        policy.touch(0, 5 if step % 4 else 4, True)
        policy.prefetch(step + 1, 0, np.zeros(6, bool), 2)
    policy.begin_layer(20, 0, np.array([1, 0, 2]))
    policy.touch(0, 1, True)
    resident = np.zeros(6, bool)
    resident[[0, 1, 4, 5]] = True
    assert policy.victim(0, resident) == 4  # outside the union, rarely used
    resident[[4, 5]] = False
    assert policy.victim(0, resident) == 1  # already used this step, before 0 which is still to come
