"""Plan enforcement: validates a controller `Plan`, applies it through runtime mechanisms, answers `PlanAck`.

Runs in the inference process, on the engine thread between steps. `apply` first checks everything (the
message itself again, however it was built; version, shape, layer and expert ids, expert bytes as whole
slots, caps against the slot pool, pins against caps, HBM budget, whether the live KV blocks fit the plan's
tier counts) and only then changes anything; a refused plan changes no state (beyond the refusal counters).
Applying: settle in-flight prefetches, unpin what is no longer pinned, install the plan's rules into the
`LocalPolicy` (which runs them between plans), evict experts over the new caps, set the caps as the slot
pool's layer limits and the KV tier counts as the block manager's limits (so every later load and every
cache growth is bounded by them until the next plan: the runtime refuses or spills, never exceeds), load
and pin newly pinned experts, spill KV blocks down to the plan's tier counts, plug the policy's ranking
and grouping into the expert provider, check the footprint is within the plan, and start the prefetch list.

Plans speak in model layers: `expert_bytes_per_layer` has one entry per model layer (0 for dense layers,
which hold no experts) and every layer field names a model layer; the slot pool counts MoE layers only
(`moe_layers` lists them in order), so layers are translated here.
A tier missing from `kv_blocks_per_tier` keeps its full capacity. Caps are `bytes / stride_bytes` (a whole
number of slots, at most the layer's number of experts); a MoE layer's cap must leave at least one slot
beside its pinned experts (its other experts are computed through it). The GPU tier needs at least one KV
block (attention reads KV only there). It must never talk to the network, build a plan, or change what a
kernel computes: placement moves bytes, never changes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tierplan.agent.local_policy import Key, LocalPolicy, PolicyState, PrefetchJob
from tierplan.controller.protocol import AckStatus, Footprint, Plan, PlanAck, ProtocolError, RejectReason, Tier, parse
from tierplan.runtime.engine.experts import OnDemandExperts
from tierplan.runtime.engine.kv_cache import PagedKVCache
from tierplan.runtime.errors import ConfigError
from tierplan.runtime.kv import Tier as KVTier
from tierplan.runtime.memory.slots import ExpertSlotPool
from tierplan.runtime.transfer import Priority
from tierplan.runtime.weights.loader import ExpertLoadHandler


class PlanRefused(Exception):
    """Raised inside `apply` to stop before any state changes; becomes a REJECTED ack."""

    def __init__(self, code: RejectReason, text: str) -> None:
        super().__init__(text)
        self.code, self.text = code, text


@dataclass(frozen=True)
class _Target:
    """A validated plan in the pool's terms: everything `_enact` needs, nothing left to check."""

    caps: dict[int, int]
    kv_limit: dict[KVTier, int]
    eviction: dict[int, tuple[int, ...]]
    pinned: frozenset[Key]
    prefetch: tuple[PrefetchJob, ...]
    kv_moves: tuple[tuple[tuple[int, ...], KVTier], ...] = field(default=())  # (blocks, destination), in order


def _kv_moves(by_tier: dict[KVTier, list[int]], limit: dict[KVTier, int]) -> list[tuple[tuple[int, ...], KVTier]]:
    """Spills (each tier's blocks in the order given, first to go first) that bring each tier to at most its
    limit, bottom tier first so no move needs to make room; PlanRefused if the blocks cannot fit."""
    gpu, cpu, nvme = by_tier[KVTier.GPU], by_tier[KVTier.CPU], by_tier[KVTier.NVME]
    gpu_out = gpu[: max(0, len(gpu) - limit[KVTier.GPU])]
    cpu_excess = max(0, len(cpu) + len(gpu_out) - limit[KVTier.CPU])
    cpu_to_nvme = cpu[:cpu_excess]
    gpu_to_nvme = gpu_out[: cpu_excess - len(cpu_to_nvme)]
    gpu_to_cpu = gpu_out[len(gpu_to_nvme):]
    if len(nvme) + cpu_excess > limit[KVTier.NVME]:
        counts = ", ".join(f"{t.value} {len(by_tier[t])} -> at most {limit[t]}" for t in KVTier)
        raise PlanRefused(RejectReason.OVER_BUDGET, f"kv_blocks_per_tier: the {len(gpu) + len(cpu) + len(nvme)} "
                          f"live KV blocks do not fit by spilling down ({counts})")
    moves = [(tuple(cpu_to_nvme), KVTier.NVME), (tuple(gpu_to_nvme), KVTier.NVME), (tuple(gpu_to_cpu), KVTier.CPU)]
    return [(blocks, tier) for blocks, tier in moves if blocks]


class Enforcer:
    """See the module docstring. `applied_version` is 0 until the first plan applies."""

    def __init__(self, pool: ExpertSlotPool, experts: OnDemandExperts, loader: ExpertLoadHandler,
                 cache: PagedKVCache, policy: LocalPolicy, moe_layers: tuple[int, ...], hbm_budget_bytes: int,
                 agent_id: str, rank: int, clock: Callable[[], float] = time.monotonic) -> None:
        if experts.pool is not pool or experts.loader is not loader or policy.experts is not experts:
            raise ConfigError("Enforcer: experts must wrap the pool and loader given, and policy those experts")
        if len(moe_layers) != pool.layout.num_layers or list(moe_layers) != sorted(set(moe_layers)):
            raise ConfigError(f"Enforcer: moe_layers {moe_layers} must be ascending, unique, and one per pool "
                              f"layer ({pool.layout.num_layers})")
        if hbm_budget_bytes < 0:
            raise ConfigError(f"Enforcer: hbm_budget_bytes must be >= 0, got {hbm_budget_bytes}")
        self.pool, self.experts, self.loader, self.cache, self.policy = pool, experts, loader, cache, policy
        self.moe_layers, self.hbm_budget_bytes = tuple(moe_layers), hbm_budget_bytes
        self.agent_id, self.rank, self.clock = agent_id, rank, clock
        self._pool_layer = {m: i for i, m in enumerate(self.moe_layers)}
        self.applied_version = 0
        self.num_applied = 0
        self.expert_slots: dict[int, int] = {}  # the applied plan's slots, by MoE model layer (telemetry reports them)
        self.num_rejected: dict[RejectReason, int] = dict.fromkeys(RejectReason, 0)

    # ---- the one entry point ------------------------------------------------------------------------
    def apply(self, plan: Plan | Mapping[str, Any]) -> PlanAck:
        """Apply `plan` (a Plan, or its JSON-shaped mapping) whole, or refuse it whole: always an ack."""
        now_s = self.clock()
        try:
            plan = self._revalidate(plan)
            target = self._validate(plan, now_s)
        except PlanRefused as refusal:
            return self._refuse(plan, now_s, refusal.code, refusal.text)
        except Exception as exc:  # a plan built around validation can break a check in unforeseen ways
            return self._refuse(plan, now_s, RejectReason.MALFORMED, f"invalid plan: {type(exc).__name__}: {exc}")
        try:
            self._enact(target, now_s)
        except Exception as exc:  # a byte move (or the driver) failed midway: say so, keep the old version
            return self._refuse(plan, now_s, RejectReason.OTHER, f"failed while applying (state partly changed, "
                                f"applied_version stays {self.applied_version}): {type(exc).__name__}: {exc}")
        self.applied_version = plan.version
        self.num_applied += 1
        self.expert_slots = {self.moe_layers[i]: cap for i, cap in target.caps.items()}
        return PlanAck(agent_id=self.agent_id, rank=self.rank, plan_id=plan.plan_id, version=plan.version,
                       status=AckStatus.APPLIED, applied_s=now_s, footprint=self.footprint())

    def _refuse(self, plan: object, now_s: float, code: RejectReason, text: str) -> PlanAck:
        """A REJECTED ack. It echoes the plan's id and version where they are valid; otherwise 'invalid-plan'
        and the version the agent would accept next (applied_version + 1), the reason naming what was wrong."""
        self.num_rejected[code] += 1
        plan_id = getattr(plan, "plan_id", None) if not isinstance(plan, Mapping) else plan.get("plan_id")
        version = getattr(plan, "version", None) if not isinstance(plan, Mapping) else plan.get("version")
        if not (isinstance(plan_id, str) and plan_id and len(plan_id) <= 256 and not any(c.isspace() for c in plan_id)):
            plan_id = "invalid-plan"
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            version = self.applied_version + 1
        return PlanAck(agent_id=self.agent_id, rank=self.rank, plan_id=plan_id, version=version,
                       status=AckStatus.REJECTED, reason_code=code, reason=text[:4000], applied_s=now_s,
                       footprint=self.footprint())

    @staticmethod
    def _revalidate(plan: object) -> Plan:
        """The plan checked again from its fields: `Plan.model_construct` (or a mutated copy) skips validation."""
        try:
            if isinstance(plan, Plan):
                return Plan.model_validate(plan.model_dump())
            if isinstance(plan, Mapping | str | bytes):
                return parse(Plan, plan)
        except ProtocolError as exc:
            raise PlanRefused(RejectReason.MALFORMED, str(exc)) from None
        except Exception as exc:  # fields of the wrong shape can break model_dump itself
            raise PlanRefused(RejectReason.MALFORMED, f"invalid Plan: {type(exc).__name__}: {exc}") from None
        raise PlanRefused(RejectReason.MALFORMED, f"expected a Plan, got {type(plan).__name__}")

    # ---- validation (reads only) --------------------------------------------------------------------
    def _layer(self, path: str, model_layer: int) -> int:
        if model_layer not in self._pool_layer:
            raise PlanRefused(RejectReason.MALFORMED, f"{path}: model layer {model_layer} is not a MoE layer "
                              f"(MoE layers: {self.moe_layers})")
        return self._pool_layer[model_layer]

    def _expert(self, path: str, expert: int) -> int:
        if expert >= self.pool.layout.num_experts:
            raise PlanRefused(RejectReason.UNKNOWN_EXPERT, f"{path}: expert {expert} does not exist "
                              f"(num_experts={self.pool.layout.num_experts})")
        return expert

    def _validate(self, plan: Plan, now_s: float) -> _Target:
        if plan.base_version != self.applied_version:
            raise PlanRefused(RejectReason.STALE, f"base_version: plan {plan.plan_id} v{plan.version} was built on "
                              f"version {plan.base_version}, but the applied version is {self.applied_version}")
        if plan.link_shares:  # nothing here splits a link's bandwidth yet: refuse rather than ignore it
            raise PlanRefused(RejectReason.MALFORMED, f"link_shares: {dict(plan.link_shares)} cannot be enforced by "
                              "this agent (the transfer engine has no per-class bandwidth shares); expected {}")
        n = self.cache.spec.num_layers
        if len(plan.expert_bytes_per_layer) != n:
            raise PlanRefused(RejectReason.MALFORMED, f"expert_bytes_per_layer: has {len(plan.expert_bytes_per_layer)}"
                              f" entries, the model has {n} layers (one entry per layer, 0 for dense ones)")
        for layer, b in enumerate(plan.expert_bytes_per_layer):
            if b and layer not in self._pool_layer:
                raise PlanRefused(RejectReason.MALFORMED, f"expert_bytes_per_layer.{layer}: {b} bytes for a dense "
                                  f"layer (MoE layers: {self.moe_layers})")
        pinned = [(self._layer(f"pinned_experts.{i}.layer", k.layer), k.expert)
                  for i, k in enumerate(plan.pinned_experts)]
        eviction = {self._layer(f"eviction_priority.{i}.layer", ev.layer): ev.order
                    for i, ev in enumerate(plan.eviction_priority)}
        prefetch = [(self._layer(f"prefetch.{i}.key.layer", it.key.layer), it) for i, it in enumerate(plan.prefetch)]
        capacity = self.cache.manager.capacity
        limit = {t: capacity[t] for t in KVTier}
        for tier, count in plan.kv_blocks_per_tier.items():
            kv_tier = KVTier(tier.value)
            if count > capacity[kv_tier]:
                raise PlanRefused(RejectReason.MALFORMED, f"kv_blocks_per_tier.{tier.value}: {count} blocks exceed "
                                  f"the tier's capacity of {capacity[kv_tier]}")
            limit[kv_tier] = count
        if limit[KVTier.GPU] < 1:
            raise PlanRefused(RejectReason.MALFORMED, "kv_blocks_per_tier.gpu: 0 blocks, but attention reads KV only "
                              "on the GPU tier: expected at least 1")
        for i, (_, e) in enumerate(pinned):
            self._expert(f"pinned_experts.{i}.expert", e)
        for i, ev in enumerate(plan.eviction_priority):
            for j, e in enumerate(ev.order):
                self._expert(f"eviction_priority.{i}.order.{j}", e)
        for i, (_, it) in enumerate(prefetch):
            self._expert(f"prefetch.{i}.key.expert", it.key.expert)
        caps = self._check_budget(plan, pinned, limit)
        jobs = tuple(PrefetchJob((layer, it.key.expert), Priority(it.priority), now_s + it.deadline_ms / 1000)
                     for layer, it in prefetch)
        return _Target(caps, limit, eviction, frozenset(pinned), jobs, tuple(self._plan_kv(limit)))

    def _check_budget(self, plan: Plan, pinned: list[Key], limit: dict[KVTier, int]) -> dict[int, int]:
        stride, num_slots = self.pool.layout.stride_bytes, self.pool.num_slots
        num_experts = self.pool.layout.num_experts
        for layer in self._pool_layer:
            b = plan.expert_bytes_per_layer[layer]
            if b % stride or b > num_experts * stride:
                raise PlanRefused(RejectReason.MALFORMED, f"expert_bytes_per_layer.{layer}: {b} bytes is not a whole "
                                  f"number of slots of stride_bytes={stride} from 0 to the layer's {num_experts} "
                                  f"experts (nearest: {b // stride * stride} or {-(-b // stride) * stride})")
        caps = {i: plan.expert_bytes_per_layer[layer] // stride for layer, i in self._pool_layer.items()}
        if sum(caps.values()) > num_slots:
            raise PlanRefused(RejectReason.OVER_BUDGET, f"expert_bytes_per_layer: caps of {list(caps.values())} "
                              f"experts (bytes // stride_bytes={stride}) sum to {sum(caps.values())}, over the "
                              f"pool's num_slots={num_slots}")
        num_all = self.pool.layout.num_layers * self.pool.layout.num_experts
        if len(pinned) > num_slots or (len(pinned) == num_slots < num_all):
            raise PlanRefused(RejectReason.OVER_BUDGET, f"pinned_experts: {len(pinned)} experts pinned leave no slot "
                              f"for the others (the pool has num_slots={num_slots} for {num_all} experts)")
        for layer, cap in caps.items():
            num_pinned = sum(1 for k in pinned if k[0] == layer)
            if num_pinned > cap:
                raise PlanRefused(RejectReason.OVER_BUDGET, f"pinned_experts: {num_pinned} pinned in model layer "
                                  f"{self.moe_layers[layer]}, over its cap of {cap} experts (expert_bytes_per_layer."
                                  f"{self.moe_layers[layer]}={plan.expert_bytes_per_layer[self.moe_layers[layer]]}"
                                  f" // stride_bytes={stride})")
            if cap - num_pinned < 1 and num_pinned < num_experts:
                raise PlanRefused(RejectReason.OVER_BUDGET, f"expert_bytes_per_layer.{self.moe_layers[layer]}: a cap "
                                  f"of {cap} experts with {num_pinned} pinned leaves no slot to compute the layer's "
                                  f"other experts through; expected at least {num_pinned + 1} slots "
                                  f"({(num_pinned + 1) * stride} bytes)")
        expert_bytes, block_bytes = sum(plan.expert_bytes_per_layer), self.cache.block_bytes
        total = expert_bytes + limit[KVTier.GPU] * block_bytes
        for whose, budget in (("the agent's", self.hbm_budget_bytes), ("the plan's", plan.hbm_budget_bytes)):
            if total > budget:
                raise PlanRefused(RejectReason.OVER_BUDGET, f"expert_bytes_per_layer + kv_blocks_per_tier.gpu: "
                                  f"{expert_bytes} + {limit[KVTier.GPU]} blocks * {block_bytes} bytes = {total} "
                                  f"bytes, over {whose} hbm_budget_bytes={budget}")
        return caps

    def _plan_kv(self, limit: dict[KVTier, int]) -> list[tuple[tuple[int, ...], KVTier]]:
        """The spills that bring every tier within `limit`. Blocks being read or moved count where they are
        (a moving one at its source) and go last in their tier, so idle blocks spill first; a plan whose
        limits would need one of them moved is refused before anything changes. GPU blocks go newest sequence
        first (the scheduler's preemption order: `PagedKVCache.newest_sequences_first`); lower tiers' in the
        order they were allocated."""
        manager = self.cache.manager
        idle: dict[KVTier, list[int]] = {t: [] for t in KVTier}
        busy: dict[KVTier, list[int]] = {t: [] for t in KVTier}
        for b in manager.blocks():
            (busy if manager.refcount(b) or manager.is_moving(b) else idle)[manager.location(b).tier].append(b)
        idle[KVTier.GPU] = self.cache.newest_sequences_first(idle[KVTier.GPU])
        moves = _kv_moves({t: idle[t] + busy[t] for t in KVTier}, limit)
        stuck = {b for t in KVTier for b in busy[t]} & {b for blocks, _ in moves for b in blocks}
        if stuck:
            raise PlanRefused(RejectReason.OTHER, f"kv_blocks_per_tier: {len(stuck)} KV blocks the limits would move "
                              "are being read or moved; apply between steps")
        return moves

    # ---- applying (after validation; changes state) -------------------------------------------------
    def _enact(self, t: _Target, now_s: float) -> None:
        """Apply a validated target; if anything fails midway, the last applied plan's limits, pins and rules
        are put back (experts evicted and KV blocks spilled stay where they went; the ack says so)."""
        saved = (self.pool.limits.as_dict(), self.cache.manager.limits(), self.policy.snapshot())
        try:
            self._enact_target(t, now_s)
        except BaseException:
            self._restore(*saved)
            raise

    def _restore(self, layer_limits: dict[int, int], kv_limits: dict[KVTier, int], rules: PolicyState) -> None:
        self.pool.limits.set(layer_limits)
        self.cache.manager.set_limits(kv_limits)
        for k in sorted(self.policy.pinned - rules.pinned):
            self.experts.unpin(*k)
        self.policy.install(dict(rules.caps), dict(rules.eviction), rules.pinned, rules.queued)
        for k in sorted(rules.pinned):
            if self.pool.is_resident(*k):
                self.experts.pin(*k)

    def _enact_target(self, t: _Target, now_s: float) -> None:
        policy, pool = self.policy, self.pool
        policy.drain(now_s)
        self.experts.drain()  # the engine's own loads ahead (a step's layer-ahead window) hold slots too
        for k in sorted(policy.pinned - t.pinned):
            self.experts.unpin(*k)
        policy.install(t.caps, t.eviction, t.pinned, t.prefetch)
        for layer in range(pool.layout.num_layers):
            for k in policy.over_cap_victims(layer):
                self.experts.evict(*k)
        pool.limits.set(t.caps)  # from here on no load passes a cap (the pool refuses), until the next plan
        self.cache.manager.set_limits(t.kv_limit)  # nor any KV growth or move a tier's count
        for k in sorted(t.pinned):
            if not pool.is_resident(*k):
                if not policy.make_room(k, protect=t.pinned):
                    raise PlanRefused(RejectReason.OTHER, f"pinned_experts: no slot could be freed for {k}")
                self.experts.load_async(*k, priority=Priority.URGENT).wait()
            self.experts.pin(*k)
        for blocks, tier in t.kv_moves:
            self.cache.spill(blocks, tier)
        self.experts.set_victim_order(policy.victim_order, policy)
        self.experts.set_chunk_order(policy.chunk_order)
        self._check_within(t)
        policy.run_prefetch(now_s)

    def _check_within(self, t: _Target) -> None:
        """After applying: every layer's slots and every tier's blocks within the plan (else the apply failed)."""
        over = [f"pool layer {layer}: {self.pool.num_bound(layer)} slots > cap {cap}" for layer, cap in t.caps.items()
                if self.pool.num_bound(layer) > cap]
        over += [f"kv {tier.value}: {self.cache.manager.num_used(tier)} blocks > {n}" for tier, n in t.kv_limit.items()
                 if self.cache.manager.num_used(tier) > n]
        if over:
            raise RuntimeError(f"footprint over the plan after applying it: {'; '.join(over)}")

    # ---- measurement --------------------------------------------------------------------------------
    def footprint(self) -> Footprint:
        stride = self.pool.layout.stride_bytes
        # Bound slots (loading ones too), the same count the pool's limits bound: what the layer really holds.
        per_layer = tuple(self.pool.num_bound(self._pool_layer[layer]) * stride
                          if layer in self._pool_layer else 0 for layer in range(self.cache.spec.num_layers))
        manager = self.cache.manager
        kv = {Tier(t.value): manager.num_used(t) for t in KVTier}
        total = sum(per_layer) + manager.num_used(KVTier.GPU) * self.cache.block_bytes
        return Footprint(expert_bytes_per_layer=per_layer, kv_blocks_per_tier=kv, total_hbm_bytes=total)

    def stats(self) -> dict[str, int]:
        rejected = {f"rejected_{code.value}": n for code, n in self.num_rejected.items()}
        return {"applied_version": self.applied_version, "plans_applied": self.num_applied, **rejected}
