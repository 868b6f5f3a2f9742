"""Builders shared by the agent tests: a tiny CPU engine with a policy and an enforcer over its parts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import FakeClock
from tierplan.agent.enforcer import Enforcer
from tierplan.agent.local_policy import LocalPolicy
from tierplan.controller.protocol import ExpertKey, LayerEviction, Plan, PrefetchItem, Tier
from tierplan.runtime.device import Device
from tierplan.runtime.engine.config import ModelSpec
from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
from tierplan.runtime.engine.presets import preset
from tierplan.runtime.engine.routing_trace import RoutingTrace
from tierplan.runtime.selfcheck.exact import auto_block_tokens
from tierplan.runtime.weights.loader import StoreKind

KV_GPU_BLOCKS, KV_CPU_BLOCKS, KV_NVME_BLOCKS = 16, 8, 8
KV_GPU_BUDGET_BLOCKS = 8  # the agent's HBM budget: every slot's expert plus this many GPU KV blocks
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [100, 200, 300, 400]]


@dataclass
class Agent:
    engine: ReferenceEngine
    policy: LocalPolicy
    enforcer: Enforcer
    clock: FakeClock

    @property
    def stride_bytes(self) -> int:
        return self.engine.pool.layout.stride_bytes

    def close(self) -> None:
        self.engine.close()


def tiny_engine(workdir: Path) -> ReferenceEngine:
    """The tiny preset with half its experts' worth of slots and KV tiers of 8 / 8 / 16 blocks (the engine the
    adapter and loop tests drive with the bundled FLAME-MoE routing sample, `flame_trace()`)."""
    spec = preset("tiny")
    return ReferenceEngine(spec, Device("cpu"), EngineConfig(
        block_tokens=auto_block_tokens(spec), resident_frac=0.5, kv_gpu_blocks=8, kv_cpu_blocks=8, kv_nvme_blocks=16,
        workdir=workdir))


def flame_trace() -> RoutingTrace:
    return RoutingTrace.load(Path(__file__).parents[2] / "data/routing/flame_moe_290m_sample.npz")


def build_agent(workdir: Path, spec: ModelSpec | None = None, store: StoreKind = StoreKind.PINNED) -> Agent:
    """A tiny engine with half its experts' worth of slots, three KV tiers, and an agent over its parts."""
    spec = spec or preset("tiny")
    cfg = EngineConfig(block_tokens=auto_block_tokens(spec), resident_frac=0.5, expert_store=store,
                       kv_gpu_blocks=KV_GPU_BLOCKS, kv_cpu_blocks=KV_CPU_BLOCKS, kv_nvme_blocks=KV_NVME_BLOCKS,
                       workdir=workdir)
    eng = ReferenceEngine(spec, Device("cpu"), cfg)
    policy = LocalPolicy(eng.pool, eng.experts)
    budget = eng.pool.num_slots * eng.pool.layout.stride_bytes + KV_GPU_BUDGET_BLOCKS * eng.cache.block_bytes
    clock = FakeClock(0.0)
    enforcer = Enforcer(eng.pool, eng.experts, eng.loader, eng.cache, policy, spec.moe_layers, budget,
                        agent_id="agent-0", rank=0, clock=clock)
    return Agent(eng, policy, enforcer, clock)


def make_plan(agent: Agent, version: int = 1, base_version: int | None = None, caps: Iterable[int] = (4, 4),
              kv: Mapping[Tier, int] | None = None, pinned: Iterable[tuple[int, int]] = (),
              eviction: Mapping[int, Iterable[int]] | None = None,
              prefetch: Iterable[tuple[int, int, float, int]] = (), hbm_budget_bytes: int | None = None,
              **overrides: Any) -> Plan:
    """A plan in model layers; `prefetch` items are (layer, expert, deadline_ms, priority)."""
    expert_bytes = tuple(c * agent.stride_bytes for c in caps)
    kv = dict(kv) if kv is not None else {Tier.GPU: KV_GPU_BUDGET_BLOCKS, Tier.CPU: KV_CPU_BLOCKS,
                                          Tier.NVME: KV_NVME_BLOCKS}
    fields: dict[str, Any] = dict(
        plan_id=f"plan-{version}", version=version,
        base_version=version - 1 if base_version is None else base_version, created_s=0.0,
        hbm_budget_bytes=agent.enforcer.hbm_budget_bytes if hbm_budget_bytes is None else hbm_budget_bytes,
        expert_bytes_per_layer=expert_bytes, kv_blocks_per_tier=kv,
        pinned_experts=[ExpertKey(layer=layer, expert=e) for layer, e in pinned],
        eviction_priority=[LayerEviction(layer=layer, order=tuple(order)) for layer, order in (eviction or {}).items()],
        prefetch=[PrefetchItem(key=ExpertKey(layer=layer, expert=e), deadline_ms=ms, priority=p)
                  for layer, e, ms, p in prefetch],
        reason="test plan",
    )
    fields.update(overrides)
    return Plan(**fields)


def placement(agent: Agent) -> dict[str, Any]:
    """Everything a plan could change, to compare before and after a refusal."""
    eng = agent.engine
    pool, manager = eng.pool, eng.cache.manager
    layers = range(pool.layout.num_layers)
    return {
        "resident": [pool.resident_experts(layer) for layer in layers],
        "pinned": sorted((layer, e) for layer in layers for e in range(pool.layout.num_experts)
                         if pool.is_pinned(layer, e)),
        "recency": eng.experts.residents_lru(),
        "victim_order": eng.experts.victim_order,
        "policy": agent.policy.snapshot(),
        "policy_stats": agent.policy.stats(),
        "kv_usage": eng.cache.tier_usage(),
        "kv_blocks": {b: str(manager.location(b)) for b in manager.blocks()},
        "layer_limits": pool.limits.as_dict(),
        "kv_limits": manager.limits(),
        "applied_version": agent.enforcer.applied_version,
        "footprint": agent.enforcer.footprint(),
    }
