"""The local policy between plans: eviction by the plan's order, caps, prefetch, and every fallback counted."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent import PROMPTS, Agent, build_agent
from tests.conftest import wait_until
from tierplan.agent.local_policy import Fallback, LocalPolicy, PrefetchJob
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.transfer import Priority
from tierplan.runtime.weights.loader import StoreKind


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = build_agent(tmp_path)
    yield a
    a.close()


def fill(agent: Agent, layers: dict[int, list[int]]) -> None:
    """The engine uses these experts, in this order (so the first is least recently used)."""
    for layer, experts in layers.items():
        for e in experts:
            agent.engine.experts.ensure(layer, [e])


def test_plan_ranked_victims_go_first_then_lru_and_never_a_pinned_one(agent: Agent) -> None:
    eng, policy = agent.engine, agent.policy
    fill(agent, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]})
    policy.install(caps={0: 4, 1: 4}, eviction={1: (2, 0)}, pinned={(0, 1)}, prefetch=())

    assert policy.victim_order(eng.experts.residents_lru()) == [
        (1, 2), (1, 0),  # the plan's first-to-evict
        (0, 0), (0, 2), (0, 3), (1, 1), (1, 3),  # then least recently used; (0, 1) is pinned
    ]
    eng.experts.set_victim_order(policy.victim_order)
    eng.experts.ensure(0, [4])  # a miss with every slot taken: the engine asks the policy
    assert eng.pool.resident_experts(1) == [0, 1, 3]
    assert policy.fallbacks[Fallback.LRU_NO_PLAN_ORDER] == 0


def test_lru_is_the_fallback_when_the_plan_ranks_none_and_it_is_counted(agent: Agent) -> None:
    eng, policy = agent.engine, agent.policy
    fill(agent, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]})
    policy.install(caps={}, eviction={1: (7,)}, pinned=(), prefetch=())  # ranks only an absent expert
    eng.experts.set_victim_order(policy.victim_order)

    eng.experts.ensure(1, [5])

    assert eng.pool.resident_experts(0) == [1, 2, 3]  # (0, 0) was least recently used
    assert policy.stats()[Fallback.LRU_NO_PLAN_ORDER] == 1
    eng.experts.set_victim_order(None)  # unplugged: plain LRU again, nothing counted
    eng.experts.ensure(1, [6])
    assert eng.pool.resident_experts(0) == [2, 3] and policy.fallbacks[Fallback.LRU_NO_PLAN_ORDER] == 1


def test_a_layer_over_its_cap_gives_its_victims_first(agent: Agent) -> None:
    eng, policy = agent.engine, agent.policy
    fill(agent, {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]})
    policy.install(caps={0: 2, 1: 6}, eviction={0: (3,), 1: (1,)}, pinned=(), prefetch=())

    assert policy.over_cap_victims(0) == [(0, 3), (0, 0)]
    assert policy.over_cap_victims(1) == []
    assert policy.victim_order(eng.experts.residents_lru())[:4] == [(0, 3), (0, 0), (0, 1), (0, 2)]
    assert policy.fallbacks[Fallback.LRU_NO_PLAN_ORDER] == 0


def test_prefetch_runs_most_urgent_first_and_counts_what_finds_no_slot(agent: Agent) -> None:
    eng, policy = agent.engine, agent.policy
    fill(agent, {0: [0, 1, 2, 3], 1: [0, 1, 2]})  # 7 of 8 slots
    busy = eng.experts.residents_lru()
    for key in busy:
        eng.experts.pin(*key)
    policy.install(caps={}, eviction={}, pinned=busy, prefetch=[
        PrefetchJob((1, 5), Priority.LOW, 1.0),
        PrefetchJob((1, 6), Priority.URGENT, 5.0),
        PrefetchJob((1, 7), Priority.URGENT, 2.0),  # most urgent, earliest deadline: gets the one free slot
        PrefetchJob((0, 0), Priority.URGENT, 0.5),  # already resident
    ])

    assert policy.run_prefetch(now_s=0.0) == 1

    wait_until(lambda: eng.pool.is_resident(1, 7), what="the urgent prefetch landed")
    assert not eng.pool.is_resident(1, 5) and not eng.pool.is_resident(1, 6)
    stats = policy.stats()
    assert (stats[Fallback.PREFETCH_NO_SLOT], stats["prefetch_skipped_resident"], stats["prefetch_queued"]) == (2, 1, 0)
    assert eng.experts.capacity == 1  # seven pins leave one slot for everything else


def test_a_prefetch_into_a_layer_at_its_cap_replaces_one_the_plan_ranks_first(agent: Agent) -> None:
    eng, policy = agent.engine, agent.policy
    fill(agent, {0: [0, 1]})  # six slots still free
    policy.install(caps={0: 2}, eviction={0: (1,)}, pinned=(), prefetch=[PrefetchJob((0, 5), Priority.HIGH, 1.0)])

    assert policy.run_prefetch(now_s=0.0) == 1

    wait_until(lambda: eng.pool.is_resident(0, 5), what="prefetch landed")
    assert eng.pool.resident_experts(0) == [0, 5]
    assert policy.stats()["evicted_for_room"] == 1


def test_a_failed_prefetch_is_counted_and_gives_its_slot_back(tmp_path: Path) -> None:
    agent = build_agent(tmp_path, store=StoreKind.NVME)
    try:
        eng, policy = agent.engine, agent.policy
        assert eng.nvme is not None
        region = eng.nvme.region(0, 2)
        fd = os.open(eng.nvme.path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x5a" * 64, region.offset_bytes)  # the record no longer matches its checksum
            os.fsync(fd)
        finally:
            os.close(fd)
        policy.install(caps={}, eviction={}, pinned=(), prefetch=[PrefetchJob((0, 2), Priority.URGENT, 10.0)])

        assert policy.run_prefetch(now_s=0.0) == 1
        wait_until(lambda: eng.loader.stats()["loads_failed"] == 1, what="the load failed")
        policy.run_prefetch(now_s=1.0)

        assert policy.stats()[Fallback.PREFETCH_FAILED] == 1 and policy.stats()[Fallback.PREFETCH_LATE] == 0
        assert not eng.pool.is_resident(0, 2) and eng.pool.num_free_slots == eng.pool.num_slots
    finally:
        agent.close()


def test_expert_miss_stalls_are_timed(agent: Agent) -> None:
    res = agent.engine.generate(PROMPTS, 3)
    assert 0 < agent.engine.experts.num_stalls <= res.expert_misses  # one stall per layer list of misses
    assert agent.engine.experts.stalls_ms > 0.0


def test_install_refuses_what_the_pool_cannot_hold_and_changes_nothing(agent: Agent) -> None:
    policy: LocalPolicy = agent.policy
    policy.install(caps={0: 3}, eviction={0: (1, 2)}, pinned={(1, 1)},
                   prefetch=[PrefetchJob((0, 4), Priority.LOW, 1.0)])
    before = policy.snapshot()
    with pytest.raises(ConfigError, match=r"caps\[2\]"):
        policy.install(caps={2: 1}, eviction={}, pinned=(), prefetch=())
    with pytest.raises(ConfigError, match=r"eviction\[0\]: repeats"):
        policy.install(caps={}, eviction={0: (1, 1)}, pinned=(), prefetch=())
    with pytest.raises(ConfigError, match="prefetch"):
        policy.install(caps={}, eviction={}, pinned=(), prefetch=[PrefetchJob((0, 8), Priority.LOW, 1.0)])
    assert policy.snapshot() == before


def test_make_room_counts_a_layer_s_loads_it_did_not_start_against_the_cap(agent: Agent) -> None:
    """A load in flight that the policy did not queue (the layer-ahead predictor's, a demand miss) holds a slot of
    its layer: at the cap, room means an eviction, or the load it makes room for is refused by the pool (H200
    phase run 06's diagnostic: 7,617 of the predictor's loads failed so)."""
    eng, policy = agent.engine, agent.policy
    fill(agent, {0: [0]})
    policy.install(caps={0: 2}, eviction={}, pinned=(), prefetch=())
    eng.pool.limits.set({0: 2})
    eng.pool.prepare_load(0, 3)  # loading, bound to a slot, not resident
    try:
        assert policy.make_room((0, 5))
        assert eng.pool.resident_experts(0) == []  # (0, 0) made the room
        assert policy.stats()["evicted_for_room"] == 1
        eng.experts.load_async(0, 5).wait(timeout_s=30)  # the pool takes it now
    finally:
        eng.pool.complete_load(0, 3, ok=False)


def test_make_rooms_frees_a_whole_list_at_once_by_the_plan_s_order(agent: Agent) -> None:
    """The layer-ahead predictor's room for all its loads into one layer, ranked once: past the cap the layer's own
    residents go (plan-ranked first), the rest take free slots, then any layer's victims; fewer when they run out."""
    eng, policy = agent.engine, agent.policy
    fill(agent, {0: [0, 1, 2], 1: [0, 1, 2, 3]})  # 7 of 8 slots
    policy.install(caps={0: 3}, eviction={0: (2,)}, pinned={(1, 0)}, prefetch=())
    eng.pool.limits.set({0: 3})
    assert policy.make_rooms(0, 2) == 2  # the cap: two of layer 0's own go, plan-ranked (0, 2) first
    assert eng.pool.resident_experts(0) == [1] and eng.pool.num_free_slots == 3
    assert policy.make_rooms(1, 4) == 4  # no cap: 3 free slots and one victim (the LRU one, (0, 1))
    assert eng.pool.resident_experts(0) == [] and eng.pool.num_free_slots == 4
    protect = frozenset((1, e) for e in range(4))
    assert policy.make_rooms(1, 6, protect=protect) == 4  # only free slots left: (1, 0) is pinned, the rest kept
    assert policy.stats()["evicted_for_room"] == 3
