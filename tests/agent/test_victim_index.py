"""The plan's ranks served from the residency's index choose exactly the victims the full ranking chooses.

Two twins over the same pool shape take the same random steps (plans with caps, orders and pins; steps' lists,
scans among them; layer-ahead prefetches; the policy's prefetch room; evictions, pins and loads around them).
One residency has the policy's ranks plugged (`set_victim_order(order, ranks)`, served from the recency books'
heaps), the other only its `victim_order` (every candidate listed and ranked). After every step both must hold
the same experts in the same recency order and have counted the same fallbacks.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import pytest

from tests.runtime.conftest import MIXED
from tierplan.agent.local_policy import LocalPolicy, ScanRule
from tierplan.runtime.device import Device
from tierplan.runtime.engine.experts import OnDemandExperts
from tierplan.runtime.errors import CapacityError
from tierplan.runtime.memory.host import HostBackend
from tierplan.runtime.memory.slots import ExpertSlotPool
from tierplan.runtime.transfer import TransferEngine
from tierplan.runtime.weights.loader import ExpertLoadHandler
from tierplan.runtime.weights.sources import SyntheticExpertSource
from tierplan.runtime.weights.stores import PinnedExpertStore

LAYERS, EXPERTS, SLOTS = 4, 16, 24


@dataclass
class Twin:
    pool: ExpertSlotPool
    experts: OnDemandExperts
    policy: LocalPolicy

    def view(self) -> tuple[list[list[int]], list[tuple[int, int]], dict[str, int]]:
        return ([self.pool.resident_experts(layer) for layer in range(LAYERS)], self.experts.residents_lru(),
                dict(self.policy.fallbacks))


@pytest.fixture(params=[ScanRule.LRU, ScanRule.MRU])
def twins(request: pytest.FixtureRequest) -> Iterator[tuple[Twin, Twin]]:
    dev = Device("cpu")
    with ExitStack() as stack:
        made = []
        for indexed in (True, False):
            store = PinnedExpertStore(dev, SyntheticExpertSource(MIXED, LAYERS, EXPERTS, seed=5))
            stack.callback(store.close)
            pool = ExpertSlotPool(HostBackend(), dev, LAYERS, EXPERTS, MIXED.num_bytes, SLOTS)
            stack.callback(pool.close)
            link = TransferEngine(dev)
            stack.callback(link.close)
            experts = OnDemandExperts(pool, ExpertLoadHandler(pool, link, pinned=store, map_in="before_copy"))
            policy = LocalPolicy(pool, experts, request.param)
            if request.param is ScanRule.MRU:
                experts.set_chunk_order(policy.chunk_order)
            experts.set_victim_order(policy.victim_order, policy if indexed else None)
            made.append(Twin(pool, experts, policy))
        yield made[0], made[1]


def install(t: Twin, caps: dict[int, int], eviction: dict[int, list[int]], pinned: set[tuple[int, int]]) -> None:
    """As the enforcer applies a plan's rules: the policy's, the pool's limits, then what a lower cap leaves over."""
    t.experts.drain()
    pins = {k for k in pinned if t.pool.is_resident(*k)}
    t.policy.install(caps, eviction, pins, ())
    t.pool.limits.set(caps)
    for layer in caps:
        for key in t.policy.over_cap_victims(layer):
            t.experts.evict(*key)
    t.experts.set_victim_order(t.policy.victim_order, t.experts.victim_ranks)


def step(t: Twin, rng: random.Random) -> str:
    """One random step on `t`, from a generator state both twins share: what it did (or what it raised)."""
    ex, pool = t.experts, t.pool
    op = rng.random()
    layer = rng.randrange(LAYERS)
    try:
        if op < 0.05:  # an expert loaded around the residency (as the engine's start fills slots)
            absent = [e for e in range(EXPERTS) if not pool.is_resident(layer, e) and pool.num_bound(layer) < (
                pool.limits.get(layer) if pool.limits.get(layer) is not None else EXPERTS)]
            if absent and pool.num_free_slots:
                e = rng.choice(absent)
                pool.prepare_load(layer, e)
                pool.complete_load(layer, e, True, pool.device.record_event())
        elif op < 0.55:
            ex.begin_step()
            ex.soon = frozenset((lyr, e) for lyr in range(LAYERS) for e in rng.sample(range(EXPERTS), 2))
            n = rng.randint(1, max(1, min(6, ex.capacity_of(layer))))
            need = sorted(rng.sample(range(EXPERTS), rng.randint(1, EXPERTS) if rng.random() < 0.2 else n))
            for group in ex.chunks(layer, need):  # more than a layer's slots: a scan (served MRU under that rule)
                ex.ensure(layer, group)
        elif op < 0.7:
            ex.prefetch(layer, rng.sample(range(EXPERTS), rng.randint(1, 5)))
            ex.drain()
        elif op < 0.82:
            absent = [e for e in range(EXPERTS) if not pool.is_resident(layer, e)]
            todo = rng.sample(absent, min(len(absent), rng.randint(1, 3)))
            ok = t.policy.make_rooms(layer, len(todo), frozenset((layer, e) for e in todo))
            for e in todo[:ok]:
                ex.load_async(layer, e).wait()
            return f"room {ok}"
        elif op < 0.9:
            resident = [(lyr, e) for lyr in range(LAYERS) for e in pool.resident_experts(lyr)]
            if resident:
                key = rng.choice(resident)
                (ex.unpin if pool.is_pinned(*key) else ex.evict if rng.random() < 0.5 else ex.pin)(*key)
        else:
            caps = {lyr: rng.randint(3, 8) for lyr in range(LAYERS) if rng.random() < 0.8}
            eviction = {lyr: rng.sample(range(EXPERTS), rng.randint(0, EXPERTS)) for lyr in range(LAYERS)
                        if rng.random() < 0.85}
            pinned = {(lyr, e) for lyr in range(LAYERS) for e in rng.sample(range(EXPERTS), 1)}
            for k in list(pinned):
                if pool.is_pinned(*k):
                    pinned.discard(k)
            install(t, caps, eviction, pinned)
        return "ok"
    except CapacityError as e:
        return f"refused: {e}"


@pytest.mark.parametrize("seed", range(6))
def test_indexed_ranks_choose_the_victims_the_full_ranking_chooses(twins: tuple[Twin, Twin], seed: int) -> None:
    fast, slow = twins
    for i in range(400):
        did_fast = step(fast, random.Random(seed * 1000 + i))
        did_slow = step(slow, random.Random(seed * 1000 + i))
        assert did_fast.split(":")[0] == did_slow.split(":")[0], (i, did_fast, did_slow)
        assert fast.view() == slow.view(), f"step {i}: {did_fast}"
        fast.pool.check_invariants()
    assert fast.policy.fallbacks == slow.policy.fallbacks
    assert fast.experts.misses == slow.experts.misses and fast.experts.misses > 0


def test_an_expert_landed_beside_a_failed_load_stays_a_victim(twins: tuple[Twin, Twin]) -> None:
    """A list whose other load failed still tracks the one that landed (else the index could never evict it)."""
    for t in twins:
        t.pool.limits.set({1: 2})
        t.policy.install({1: 2}, {}, (), ())
        real = t.pool.complete_load

        def flaky(layer: int, expert: int, ok: bool, *a: object, real=real, **k: object) -> None:
            if (layer, expert) == (1, 1) and ok:
                raise RuntimeError("injected copy failure")
            real(layer, expert, ok, *a, **k)

        t.pool.complete_load = flaky  # type: ignore[method-assign]
        with pytest.raises(Exception, match="injected"):
            t.experts.ensure(1, [0, 1])
        t.pool.complete_load = real  # type: ignore[method-assign]
    fast, slow = twins
    assert fast.pool.resident_experts(1) == [0] and fast.view() == slow.view()
    for t in twins:
        t.experts.ensure(1, [2, 3])  # layer 1's limit of 2 leaves one free slot: (1, 0) must make the other
    assert fast.pool.resident_experts(1) == [2, 3] and fast.view() == slow.view()
