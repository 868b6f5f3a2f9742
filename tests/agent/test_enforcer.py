"""The enforcer on the CPU twin: plans apply or are refused whole, and placement never changes bits."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.agent import KV_GPU_BUDGET_BLOCKS, PROMPTS, Agent, build_agent, make_plan, placement
from tests.conftest import wait_until
from tierplan.controller.protocol import AckStatus, Link, Plan, RejectReason, Tier
from tierplan.runtime.engine.hf_config import load_hf_config
from tierplan.runtime.engine.presets import PRESETS
from tierplan.runtime.errors import CapacityError
from tierplan.runtime.kv import Tier as KVTier


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = build_agent(tmp_path)
    yield a
    a.close()


def cool_down(agent: Agent) -> None:
    """Evict every unpinned expert: the pool as cold as a fresh engine's."""
    for key in agent.engine.experts.residents_lru():
        if not agent.engine.pool.is_pinned(*key):
            agent.engine.experts.evict(*key)


def hottest(agent: Agent, num_tokens: int = 4) -> dict[int, list[int]]:
    """Experts per model layer, most routed first, seen while generating PROMPTS."""
    counts: dict[int, Counter[int]] = {layer: Counter() for layer in agent.engine.spec.moe_layers}

    def tap(layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        counts[layer].update(ids.reshape(-1).tolist())

    agent.engine.set_hooks(route_tap=tap)
    agent.engine.generate(PROMPTS, num_tokens)
    agent.engine.set_hooks(route_tap=None)
    return {layer: [e for e, _ in c.most_common()] for layer, c in counts.items()}


def grow_live_blocks(agent: Agent, num_blocks: int) -> None:
    """A sequence the engine is in the middle of serving: `num_blocks` KV blocks on the GPU tier."""
    cache = agent.engine.cache
    cache.grow(1000, num_blocks * cache.block_tokens)


def test_a_valid_plan_pins_and_prefetches_and_the_next_generate_hits_more(agent: Agent) -> None:
    eng = agent.engine
    hot = hottest(agent)
    cool_down(agent)
    hits0, misses0 = eng.experts.hits, eng.experts.misses
    cold = eng.generate(PROMPTS, 4)
    cold_hits = eng.experts.hits - hits0
    assert eng.experts.misses - misses0 > 0

    cool_down(agent)
    plan = make_plan(agent, caps=(4, 4), pinned=[(0, hot[0][0]), (1, hot[1][0])],
                     prefetch=[(layer, e, 50.0, i % 4) for layer in (0, 1) for i, e in enumerate(hot[layer][1:4])])
    ack = agent.enforcer.apply(plan)

    assert ack.status is AckStatus.APPLIED and ack.reason_code is None, ack.reason
    assert (ack.agent_id, ack.plan_id, ack.version) == ("agent-0", "plan-1", 1)
    assert agent.enforcer.applied_version == 1
    assert eng.pool.is_pinned(0, hot[0][0]) and eng.pool.is_pinned(1, hot[1][0])
    wait_until(lambda: all(eng.pool.is_resident(layer, e) for layer in (0, 1) for e in hot[layer][:4]),
               what="prefetched experts resident")
    assert agent.policy.run_prefetch(agent.clock()) == 0  # nothing left to start; the landed ones are settled
    assert agent.policy.stats()["prefetch_landed"] == 6
    assert eng.experts.victim_order == agent.policy.victim_order
    fp = agent.enforcer.footprint()
    assert fp.expert_bytes_per_layer == (4 * agent.stride_bytes, 4 * agent.stride_bytes)
    assert fp.kv_blocks_per_tier == {Tier.GPU: 0, Tier.CPU: 0, Tier.NVME: 0}

    hits1 = eng.experts.hits
    warm = eng.generate(PROMPTS, 4)
    assert eng.experts.hits - hits1 > cold_hits
    assert torch.equal(warm.logits, cold.logits) and warm.tokens == cold.tokens
    assert agent.enforcer.stats() == {"applied_version": 1, "plans_applied": 1, "rejected_stale": 0,
                                      "rejected_over_budget": 0, "rejected_malformed": 0,
                                      "rejected_unknown_expert": 0, "rejected_other": 0}


def test_a_stale_plan_is_rejected_and_nothing_changes(agent: Agent) -> None:
    eng = agent.engine
    eng.generate(PROMPTS, 2)
    assert agent.enforcer.apply(make_plan(agent, pinned=[(0, 1)], prefetch=[(1, 2, 10.0, 0)])).status is \
        AckStatus.APPLIED
    wait_until(lambda: eng.pool.is_resident(1, 2), what="prefetch landed")
    agent.policy.run_prefetch(agent.clock())
    before = placement(agent)

    ack = agent.enforcer.apply(make_plan(agent, version=3, base_version=0, pinned=[(1, 3)]))

    assert ack.status is AckStatus.REJECTED and ack.reason_code is RejectReason.STALE
    assert "base_version" in ack.reason and "applied version is 1" in ack.reason
    assert ack.footprint == before["footprint"]
    assert placement(agent) == before
    assert agent.enforcer.num_rejected[RejectReason.STALE] == 1
    # the plan rebuilt on the applied version goes through
    assert agent.enforcer.apply(make_plan(agent, version=2, pinned=[(1, 3)])).status is AckStatus.APPLIED
    assert eng.pool.is_pinned(1, 3) and not eng.pool.is_pinned(0, 1)


REFUSALS: list[tuple[str, Callable[[Agent], Plan], RejectReason, str]] = [
    ("one expert_bytes entry per model layer", lambda a: make_plan(a, version=2, caps=(2, 2, 2)),
     RejectReason.MALFORMED, "expert_bytes_per_layer: has 3 entries, the model has 2 layers"),
    ("a KV tier over its capacity", lambda a: make_plan(a, version=2, kv={Tier.GPU: 4, Tier.CPU: 9}),
     RejectReason.MALFORMED, "kv_blocks_per_tier.cpu: 9 blocks exceed the tier's capacity of 8"),
    ("a pinned expert that does not exist", lambda a: make_plan(a, version=2, pinned=[(0, 1), (1, 8)]),
     RejectReason.UNKNOWN_EXPERT, "pinned_experts.1.expert: expert 8 does not exist (num_experts=8)"),
    ("an eviction order naming an unknown expert", lambda a: make_plan(a, version=2, eviction={1: [0, 11]}),
     RejectReason.UNKNOWN_EXPERT, "eviction_priority.0.order.1: expert 11 does not exist"),
    ("a prefetch of an unknown expert", lambda a: make_plan(a, version=2, prefetch=[(0, 9, 5.0, 1)]),
     RejectReason.UNKNOWN_EXPERT, "prefetch.0.key.expert: expert 9"),
    ("caps that need more slots than the pool has", lambda a: make_plan(a, version=2, caps=(5, 4)),
     RejectReason.OVER_BUDGET, "sum to 9, over the pool's num_slots=8"),
    ("more pins in a layer than its cap", lambda a: make_plan(a, version=2, caps=(1, 4), pinned=[(0, 0), (0, 1)]),
     RejectReason.OVER_BUDGET, "pinned_experts: 2 pinned in model layer 0, over its cap of 1 experts"),
    ("expert bytes that are not a whole number of slots",
     lambda a: make_plan(a, version=2, expert_bytes_per_layer=(4 * a.stride_bytes - 1, 4 * a.stride_bytes)),
     RejectReason.MALFORMED, "expert_bytes_per_layer.0: "),
    ("expert bytes for more experts than the layer has",
     lambda a: make_plan(a, version=2, caps=(9, 0), hbm_budget_bytes=a.enforcer.hbm_budget_bytes * 2),
     RejectReason.MALFORMED, "not a whole number of slots"),
    ("a cap of no slot at all", lambda a: make_plan(a, version=2, caps=(0, 0)),
     RejectReason.OVER_BUDGET, "a cap of 0 experts with 0 pinned leaves no slot"),
    ("a cap its pins fill", lambda a: make_plan(a, version=2, caps=(1, 4), pinned=[(0, 2)]),
     RejectReason.OVER_BUDGET, "a cap of 1 experts with 1 pinned leaves no slot"),
    ("no GPU KV block", lambda a: make_plan(a, version=2, kv={Tier.GPU: 0}),
     RejectReason.MALFORMED, "kv_blocks_per_tier.gpu: 0 blocks"),
    ("a plan built without validation", lambda a: Plan.model_construct(**{
        **make_plan(a, version=2).__dict__, "version": -3}),
     RejectReason.MALFORMED, "version"),
    ("not a plan at all", lambda a: None, RejectReason.MALFORMED, "expected a Plan, got NoneType"),
    ("a mapping that is not a plan", lambda a: {"plan_id": "p", "version": 2}, RejectReason.MALFORMED,
     "invalid Plan: "),
    ("experts plus GPU KV over the agent's HBM budget",
     lambda a: make_plan(a, version=2, kv={Tier.GPU: KV_GPU_BUDGET_BLOCKS + 1},
                         hbm_budget_bytes=a.enforcer.hbm_budget_bytes * 2),
     RejectReason.OVER_BUDGET, "over the agent's hbm_budget_bytes"),
    ("experts plus GPU KV over the plan's own HBM budget",
     lambda a: make_plan(a, version=2, hbm_budget_bytes=a.enforcer.hbm_budget_bytes - 1),
     RejectReason.OVER_BUDGET, "over the plan's hbm_budget_bytes"),
    ("link shares the agent cannot enforce", lambda a: make_plan(a, version=2, link_shares={Link.H2D: 0.5}),
     RejectReason.MALFORMED, "link_shares: "),
    ("busy KV blocks the plan's GPU count would move", lambda a: _busy(a, make_plan(a, version=2, kv={Tier.GPU: 2})),
     RejectReason.OTHER, "KV blocks the limits would move are being read or moved"),
    ("live KV blocks that cannot fit the plan's tier counts",
     lambda a: make_plan(a, version=2, kv={Tier.GPU: 2, Tier.CPU: 2, Tier.NVME: 1}),
     RejectReason.OVER_BUDGET, "kv_blocks_per_tier: the 6 live KV blocks do not fit"),
]


def _busy(agent: Agent, plan: Plan) -> Plan:
    """`plan`, with the live sequence's blocks being read by a step (a reader holds each one)."""
    manager = agent.engine.cache.manager
    for b in agent.engine.cache.blocks_of(1000):
        manager.acquire(b)
    return plan


@pytest.mark.parametrize(("story", "build", "code", "says"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_refused_plan_changes_nothing(agent: Agent, story: str, build: Callable[[Agent], Any],
                                       code: RejectReason, says: str) -> None:
    eng = agent.engine
    eng.generate(PROMPTS, 2)
    assert agent.enforcer.apply(make_plan(agent, pinned=[(1, 4)], eviction={0: [3, 2]})).status is AckStatus.APPLIED
    grow_live_blocks(agent, 6)
    before = placement(agent)

    ack = agent.enforcer.apply(build(agent))

    assert (ack.status, ack.reason_code) == (AckStatus.REJECTED, code), ack.reason
    assert says in ack.reason
    assert placement(agent) == before
    assert agent.enforcer.num_rejected[code] == 1 and agent.enforcer.num_applied == 1


def test_a_layer_that_is_not_moe_is_malformed(tmp_path: Path) -> None:
    """Model layer 0 is dense here; the plan speaks in model layers, the pool in MoE layers."""
    spec = load_hf_config({**PRESETS["tiny"], "mlp_only_layers": [0]}, name="tiny-dense-first")
    assert spec.moe_layers == (1,)
    agent = build_agent(tmp_path, spec)
    try:
        before = placement(agent)
        ack = agent.enforcer.apply(make_plan(agent, caps=(0, 4), pinned=[(0, 2)]))
        assert (ack.status, ack.reason_code) == (AckStatus.REJECTED, RejectReason.MALFORMED)
        assert "pinned_experts.0.layer: model layer 0 is not a MoE layer (MoE layers: (1,))" in ack.reason
        assert placement(agent) == before
        ack = agent.enforcer.apply(make_plan(agent, caps=(2, 4)))  # bytes for the dense layer: malformed too
        assert "expert_bytes_per_layer.0: " in ack.reason and ack.reason_code is RejectReason.MALFORMED
        assert agent.enforcer.apply(make_plan(agent, caps=(0, 4), pinned=[(1, 2)])).status is AckStatus.APPLIED
    finally:
        agent.close()


def test_kv_blocks_are_spilled_down_to_the_plans_tier_counts(agent: Agent) -> None:
    grow_live_blocks(agent, 6)
    cache = agent.engine.cache
    cache.spill(cache.blocks_of(1000)[:1], KVTier.CPU)  # one already on the CPU tier: 5 GPU, 1 CPU

    ack = agent.enforcer.apply(make_plan(agent, kv={Tier.GPU: 2, Tier.CPU: 2, Tier.NVME: 8}))

    assert ack.status is AckStatus.APPLIED, ack.reason
    assert ack.footprint.kv_blocks_per_tier == {Tier.GPU: 2, Tier.CPU: 2, Tier.NVME: 2}
    assert ack.footprint.total_hbm_bytes == sum(ack.footprint.expert_bytes_per_layer) + 2 * cache.block_bytes
    cache.ensure_on_gpu(cache.blocks_of(1000)[-2:])  # blocks still come back when a step needs them, within
    with pytest.raises(CapacityError, match="KV tier gpu is full"):  # the plan's 2 GPU blocks: never past them
        cache.ensure_on_gpu(cache.blocks_of(1000))
    assert cache.manager.num_used(KVTier.GPU) == 2
    cache.free(1000)


def test_a_cut_of_the_kv_share_spills_the_sequences_the_scheduler_preempts_first(agent: Agent) -> None:
    """The newest sequence's blocks go first (the scheduler swaps out the newest running sequence), so the
    sequences that keep running keep theirs: oldest first spilled those, and the next step fetched them back."""
    cache = agent.engine.cache
    for seq in (1000, 1001, 1002):  # 1002 started last
        cache.grow(seq, 2 * cache.block_tokens)
    cache.grow(1000, 3 * cache.block_tokens)  # the oldest grew a block since: the newest block is not the newest seq's

    ack = agent.enforcer.apply(make_plan(agent, kv={Tier.GPU: 4, Tier.CPU: 8, Tier.NVME: 8}))

    assert ack.status is AckStatus.APPLIED, ack.reason
    def on_gpu() -> dict[int, int]:
        return {seq: sum(cache.manager.location(b).tier is KVTier.GPU for b in cache.blocks_of(seq))
                for seq in (1000, 1001, 1002)}

    assert on_gpu() == {1000: 3, 1001: 1, 1002: 0}
    cache.ensure_on_gpu(cache.blocks_of(1002))  # 1002 swapped back in (two of 1000's blocks make room)
    assert on_gpu() == {1000: 1, 1001: 1, 1002: 2}
    cache.touch(1002)  # the runner touches a sequence it swaps in: the newest again
    cache.touch(1000)  # then 1000: the newest of all, the first to go
    assert agent.enforcer.apply(make_plan(agent, version=2, kv={Tier.GPU: 2, Tier.CPU: 8, Tier.NVME: 8})
                                ).status is AckStatus.APPLIED
    assert on_gpu() == {1000: 0, 1001: 1, 1002: 1}  # 1000's block, then one of 1002's; 1001 keeps its own
    for seq in (1000, 1001, 1002):
        cache.free(seq)


def test_experts_over_a_new_cap_are_evicted_and_old_pins_released(agent: Agent) -> None:
    eng = agent.engine
    for e in range(6):
        eng.experts.ensure(0, [e])
    assert agent.enforcer.apply(make_plan(agent, caps=(6, 2), pinned=[(0, 5)])).status is AckStatus.APPLIED
    assert eng.pool.is_pinned(0, 5)

    ack = agent.enforcer.apply(make_plan(agent, version=2, caps=(2, 6), pinned=[(1, 7)], eviction={0: [4, 0]}))

    assert ack.status is AckStatus.APPLIED, ack.reason
    assert eng.pool.resident_experts(0) == [3, 5]  # evicted: 4, 0 (the plan's order), then 1, 2 (LRU)
    assert not eng.pool.is_pinned(0, 5) and eng.pool.is_pinned(1, 7)
    assert ack.footprint.expert_bytes_per_layer == (2 * agent.stride_bytes, agent.stride_bytes)


def test_a_late_prefetch_is_counted_on_the_agents_clock(agent: Agent) -> None:
    eng = agent.engine
    agent.clock.now_s = 100.0
    plan = make_plan(agent, prefetch=[(0, 1, 10.0, 0), (1, 1, 5000.0, 3)])  # due at 100.01 s and 105 s

    assert agent.enforcer.apply(plan).status is AckStatus.APPLIED
    wait_until(lambda: eng.pool.is_resident(0, 1) and eng.pool.is_resident(1, 1), what="prefetches landed")
    agent.clock.now_s = 101.0  # the agent looks again a second later: one deadline has passed unseen
    agent.policy.run_prefetch(agent.clock())

    stats = agent.policy.stats()
    assert (stats["prefetch_late"], stats["prefetch_landed"], stats["prefetch_failed"]) == (1, 2, 0)


def test_placement_never_changes_bits(tmp_path: Path) -> None:
    plain, planned = build_agent(tmp_path / "plain"), build_agent(tmp_path / "planned")
    try:
        want = plain.engine.generate(PROMPTS, 6)
        plan = make_plan(planned, caps=(2, 6), pinned=[(0, 3), (1, 0), (1, 1)], eviction={1: [7, 6, 5, 4]},
                         prefetch=[(1, e, 1.0, e % 4) for e in range(2, 6)], kv={Tier.GPU: 4})
        assert planned.enforcer.apply(plan).status is AckStatus.APPLIED
        got = planned.engine.generate(PROMPTS, 6)
        assert torch.equal(got.logits, want.logits) and got.tokens == want.tokens
        assert (got.expert_hits, got.expert_misses) != (want.expert_hits, want.expert_misses)  # it did move
    finally:
        plain.close()
        planned.close()


def test_a_plan_that_fails_midway_leaves_the_last_plans_limits_and_rules(agent: Agent,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: limits were installed before the footprint check, so a REJECTED plan's caps and KV counts
    stayed in force while applied_version named the old plan."""
    assert agent.enforcer.apply(make_plan(agent, caps=(4, 4), pinned=[(1, 4)])).status is AckStatus.APPLIED
    before = placement(agent)

    def fail(target: object) -> None:
        raise RuntimeError("footprint over the plan after applying it")

    monkeypatch.setattr(agent.enforcer, "_check_within", fail)
    ack = agent.enforcer.apply(make_plan(agent, version=2, caps=(2, 3), pinned=[(0, 1)],
                                         kv={Tier.GPU: 2, Tier.CPU: 8, Tier.NVME: 8}))

    assert (ack.status, ack.reason_code) == (AckStatus.REJECTED, RejectReason.OTHER), ack.reason
    after = placement(agent)
    assert after["layer_limits"] == before["layer_limits"] and after["kv_limits"] == before["kv_limits"]
    assert after["policy"].caps == before["policy"].caps and after["policy"].pinned == before["policy"].pinned
    assert agent.engine.pool.is_pinned(1, 4) and not agent.engine.pool.is_pinned(0, 1)
    assert agent.enforcer.applied_version == 1


def test_a_plan_applied_while_the_engine_prefetches_ahead_still_holds(agent: Agent) -> None:
    """Regression: the engine's layer-ahead loads were neither waited for nor counted, so a new cap was installed
    over a layer still loading past it and the plan was REJECTED with the state partly changed."""
    eng = agent.engine
    cool_down(agent)
    assert eng.experts.prefetch(0, [4, 5, 6, 7]) == 4

    ack = agent.enforcer.apply(make_plan(agent, caps=(2, 3)))

    assert ack.status is AckStatus.APPLIED, ack.reason
    assert eng.pool.num_bound(0) <= 2 and eng.pool.num_bound(1) <= 3


def test_a_pinned_expert_the_layer_asks_for_needs_no_second_slot(agent: Agent) -> None:
    """Regression: capacity_of counted a pinned expert against the cap even when the step asked for it, so a
    layer at cap 3 with one pin refused to compute 3 experts at once."""
    eng = agent.engine
    cool_down(agent)
    assert agent.enforcer.apply(make_plan(agent, caps=(3, 4), pinned=[(0, 0)])).status is AckStatus.APPLIED
    eng.experts.ensure(0, [0, 1, 2])
    assert eng.pool.num_bound(0) == 3 and all(eng.pool.is_resident(0, e) for e in (0, 1, 2))


def test_the_applied_plans_slots_are_kept_by_model_layer(agent: Agent) -> None:
    """What the adapter reports as the split in force (`Telemetry.expert_slots`): each MoE layer's cap of the plan
    last applied, none before one; a refused plan leaves them as they were."""
    assert agent.enforcer.expert_slots == {}
    assert agent.enforcer.apply(make_plan(agent, caps=(3, 5))).status is AckStatus.APPLIED
    assert agent.enforcer.expert_slots == {0: 3, 1: 5}
    refused = agent.enforcer.apply(make_plan(agent, version=3, caps=(5, 3)))  # built on version 2, never applied
    assert refused.status is AckStatus.REJECTED and agent.enforcer.expert_slots == {0: 3, 1: 5}
