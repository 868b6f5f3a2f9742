"""Budgets that hold: once a plan applies, no later load or KV growth passes its caps, until the next plan.

A story per rule: a tight plan over a whole request replay (footprint sampled at every step and at every
expert load inside a step), the runtime's own refusals when something goes around the agent, and the
scan rule that keeps a subset resident where LRU keeps none.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.agent import Agent, build_agent, make_plan
from tierplan.agent.adapters.reference import ReferenceAdapter
from tierplan.agent.local_policy import ScanRule
from tierplan.controller.protocol import AckStatus, ExpertKey, Plan, Tier
from tierplan.runtime.device import Device
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.engine.routing_trace import RoutingTrace
from tierplan.runtime.engine.runner import ForcedRouter, Runner
from tierplan.runtime.engine.scheduler import PreemptMode, Scheduler
from tierplan.runtime.engine.workloads import load_mooncake, scale_requests
from tierplan.runtime.errors import CapacityError
from tierplan.runtime.kv import Tier as KVTier
from tierplan.runtime.selfcheck.exact import auto_block_tokens
from tierplan.runtime.weights.loader import StoreKind

DATA = Path(__file__).parents[2] / "data"
KV = {"gpu": 6, "cpu": 16, "nvme": 64}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = build_agent(tmp_path)
    yield a
    a.close()


def _replay(workdir: Path, plan_for: object | None, device: str = "cpu") -> tuple[dict[int, list[int]], list[str]]:
    """The demo's job (tiny MoE, Mooncake requests, FLAME-MoE routing); returns outputs and budget breaches."""
    spec = preset("tiny")
    bt = auto_block_tokens(spec)
    reqs = scale_requests(load_mooncake(DATA / "requests/mooncake_conversation_sample.jsonl", limit=12,
                                        time_scale=0.01), 48, 16, 12, block_tokens=16)
    eng = ReferenceEngine(spec, Device(device), EngineConfig(
        block_tokens=bt, resident_frac=0.5, kv_gpu_blocks=KV["gpu"], kv_cpu_blocks=KV["cpu"],
        kv_nvme_blocks=KV["nvme"], workdir=workdir))
    breaches: list[str] = []
    try:
        agent = ReferenceAdapter(eng, window_steps=4)
        if plan_for is not None:
            plan = plan_for(eng)
            ack = agent.apply(plan)
            assert ack.status is AckStatus.APPLIED, ack.reason
            caps = {m: plan.expert_bytes_per_layer[layer] // eng.pool.layout.stride_bytes
                    for m, layer in enumerate(spec.moe_layers)}
            kv = {KVTier(t.value): n for t, n in plan.kv_blocks_per_tier.items()}

            def sample(where: str) -> None:
                breaches.extend(f"{where}: pool layer {m} holds {eng.pool.num_bound(m)} > cap {c}"
                                for m, c in caps.items() if eng.pool.num_bound(m) > c)
                breaches.extend(f"{where}: kv {t.value} {eng.cache.manager.num_used(t)} > {n}"
                                for t, n in kv.items() if eng.cache.manager.num_used(t) > n)
                fp = agent.enforcer.footprint()
                if fp.total_hbm_bytes > plan.hbm_budget_bytes:
                    breaches.append(f"{where}: footprint {fp.total_hbm_bytes} > {plan.hbm_budget_bytes}")

            ensure = eng.experts.ensure

            def ensure_and_sample(layer: int, experts: list[int], **kw: bool) -> None:
                ensure(layer, experts, **kw)
                sample(f"after ensure({layer}, {experts})")

            eng.experts.ensure = ensure_and_sample  # type: ignore[method-assign]
            on_step = agent.on_step

            def step_and_sample(batch: object, step_s: float) -> None:
                sample("after a step")
                on_step(batch, step_s)
        else:
            step_and_sample = agent.on_step  # type: ignore[assignment]
        trace = RoutingTrace.load(DATA / "routing/flame_moe_290m_sample.npz")
        sched = Scheduler(KV["gpu"], bt, max_batch=8, preempt=PreemptMode.SWAP)
        report = Runner(eng, sched, ForcedRouter(trace, eng), on_step=step_and_sample, virtual_step_s=0.005).run(reqs)
        assert report.steps > 0
        agent.close()
        return {s.seq_id: s.output for s in sched.finished}, breaches
    finally:
        eng.close()


def _tight_plan(eng: ReferenceEngine) -> Plan:
    stride = eng.pool.layout.stride_bytes
    caps = (2, 3)  # of 8 slots: 5 used, and a step routes up to all 8 experts of a layer
    kv = {Tier.GPU: 4, Tier.CPU: 4, Tier.NVME: 64}  # of 6 GPU blocks: a request needs up to 4
    expert_bytes = tuple(c * stride for c in caps)
    return Plan(plan_id="tight", version=1, base_version=0, created_s=0.0,
                hbm_budget_bytes=sum(expert_bytes) + kv[Tier.GPU] * eng.cache.block_bytes,
                expert_bytes_per_layer=expert_bytes, kv_blocks_per_tier=kv,
                pinned_experts=(ExpertKey(layer=1, expert=0),), reason="tight test plan")


def test_a_tight_plan_holds_over_a_whole_replay_and_changes_no_output(tmp_path: Path) -> None:
    want, _ = _replay(tmp_path / "free", None)
    got, breaches = _replay(tmp_path / "tight", _tight_plan)
    assert breaches == []
    assert got == want  # placement moves bytes, never changes them


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_tight_plan_holds_on_cuda_too(tmp_path: Path) -> None:
    """The same replay on the GPU: CUDA graphs, real slot remaps and device KV; the same budgets and bits."""
    want, _ = _replay(tmp_path / "free", None, "cuda")
    got, breaches = _replay(tmp_path / "tight", _tight_plan, "cuda")
    assert breaches == []
    assert got == want


def test_the_pool_refuses_a_load_past_a_layer_limit_even_around_the_agent(agent: Agent) -> None:
    eng = agent.engine
    assert agent.enforcer.apply(make_plan(agent, caps=(2, 4))).status is AckStatus.APPLIED
    eng.loader.load(0, 0, StoreKind.PINNED).wait()
    eng.loader.load(0, 1, StoreKind.PINNED).wait()
    with pytest.raises(CapacityError, match="layer 0 holds 2 slot"):
        eng.loader.load(0, 2, StoreKind.PINNED)
    with pytest.raises(CapacityError, match="its limit is 2"):
        eng.loader.load_many(0, [3, 4])
    eng.experts.ensure(0, [2])  # the provider takes the place of one of the layer's own
    assert eng.pool.num_bound(0) == 2 and eng.pool.is_resident(0, 2)
    assert eng.experts.capacity_of(0) == 2 and eng.experts.chunks(0, [1, 3, 5]) == [[1, 3], [5]]


def test_kv_growth_spills_instead_of_passing_a_tier_limit(agent: Agent) -> None:
    cache = agent.engine.cache
    assert agent.enforcer.apply(make_plan(agent, kv={Tier.GPU: 2, Tier.CPU: 3, Tier.NVME: 8})).status is \
        AckStatus.APPLIED
    for seq in range(1, 5):  # 8 blocks: the newest 2 on the GPU, 3 on the CPU, the rest spilled to NVMe
        cache.grow(seq, 2 * cache.block_tokens)
    assert cache.tier_usage() == {"gpu": 2, "cpu": 3, "nvme": 3}
    with pytest.raises(CapacityError, match="at its limit of 2 blocks"):
        cache.manager.allocate(KVTier.GPU)
    # the next plan replaces the limits
    assert agent.enforcer.apply(make_plan(agent, version=2, kv={Tier.GPU: 8})).status is AckStatus.APPLIED
    cache.manager.free(cache.manager.allocate(KVTier.GPU))
    for seq in range(1, 5):
        cache.free(seq)


def _scan_hits(agent: Agent, rule: ScanRule, steps: int = 6) -> int:
    """A layer whose every step needs all 8 experts, with a cap of 4: moe_forward's loop, without the GEMMs."""
    eng = agent.engine
    agent.policy.set_scan_rule(rule)
    assert agent.enforcer.apply(make_plan(agent, caps=(4, 4))).status is AckStatus.APPLIED
    hits0 = eng.experts.hits
    for _ in range(steps):
        for chunk in eng.experts.chunks(0, list(range(8))):
            eng.experts.ensure(0, chunk)
            assert eng.pool.num_bound(0) <= 4
            eng.experts.done_reading(0, chunk)
    return eng.experts.hits - hits0


def test_the_scan_rule_keeps_a_subset_where_lru_keeps_none(tmp_path: Path) -> None:
    lru, mru = build_agent(tmp_path / "lru"), build_agent(tmp_path / "mru")
    try:
        assert _scan_hits(lru, ScanRule.LRU) == 0  # a cyclic scan defeats LRU: every expert evicted before reuse
        hits = _scan_hits(mru, ScanRule.MRU)
        assert hits == 5 * 4  # after the first step, 4 of 8 hit: the kept subset, then 4 streamed through a slot
        assert mru.policy.stats()["scan_layers"] == 6
    finally:
        lru.close()
        mru.close()
