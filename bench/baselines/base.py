"""The baselines' interface: what the phase runner tells a baseline about a point, and what it asks back.

Bench driver code (the `tierplan bench phase` process, engine thread). A baseline is a policy on our reference
engine: it answers one `PolicyRun` per point (an initial plan the agent's enforcer applies before the first step,
then optionally a live plan source, a victim order and a per-step hook), and everything it does goes through
the agent's enforcer and the engine's mechanisms, so only the policy differs between rows. It must never move
bytes itself, load or evict outside a plan's rules, or change what a kernel computes.

Changes from PHASE_CONTRACT.md's sketch (the runner must know these):
- `PointContext.split`: the split the oracle runs at (one of `oracle_splits(ctx)`); None for every other run.
  `PointContext.num_layers` (the run's model layers, expert_bytes_per_layer's length) and `top_k` added;
  `PolicyRun.split` added (the initial plan's split, for the cost model's predicted step of static rows).
- `ExpertFuture` records per step and per MoE (pool) layer the experts a step used, and the `kv_gpu_blocks` it
  was recorded under. The scheduler's admission follows the applied plan's GPU KV blocks (the runner clamps
  `Scheduler.gpu_blocks` to the KV manager's GPU limit every step), so the KV split DOES change the schedule:
  the runner records one future per oracle split, with that split's `kv_gpu_blocks` applied (any expert
  policy will do: expert placement never changes which sequences run), with `oracle.RecordingPass(split)`
  as the baseline (its `future()` after the run); the oracle refuses a future recorded under other KV blocks.
  The record counts engine steps: warm-up steps run before the replay must run in the recording pass too.
- Caps never exceed `engine.pool.num_slots`: the runner builds each engine's slot pool large enough
  (`resident_frac=1.0` always is), with `kv_gpu_blocks` >= the point's largest GPU KV share.
- A plan's versions start at 1 on base 0: the runner applies `initial_plan` to a fresh enforcer.
- Order per run: build the engine (EngineConfig with `engine_options`), the Scheduler and the Runner with its
  ForcedRouter (so the forced routes are set), THEN `start(engine, ctx)`, then apply `initial_plan` through
  the adapter's enforcer, plug `victim_order`, run. Baselines that count routes (static_lfru, oracle) wrap
  the engine's forced routes in `start` (`observe_routes`); static ones read a warm-up window of the table.
- A run with `source` goes through `agent.closed_loop.InProcessLoop(engine, run.source, window_steps=
  run.window_steps, hbm_budget_bytes=budget)`: its new `apply_initial(plan)` applies the starting plan (the
  source never issued it, so its ack is not handed on); `loop.on_step` is the step hook, `loop.finish()` after.
  Planner errors and refused telemetry are counted in `loop.stats()`: put them in the row's notes.
- `PolicyRun.local_predictor` (added; default False): whether the run uses the plan's layer-ahead local
  predictor (agent/local_predictor.py), which observes every MoE layer's routes. Only the live policies
  (tierplan, mv_wsa, fluxmoe: their controller trains on its window counts) may set it, when built with
  `local_predictor=True` (off by default, tierplan_live.py says why); a static baseline's run must attach the
  agent without it (`ReferenceAdapter(local_predictor=False)`), so it never pays for it.
- `bench.baselines.replay.run_point` does exactly this on one point (the tests use it; the runner may too).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tierplan.controller.protocol import ExpertKey, LayerEviction, Plan, Tier

if TYPE_CHECKING:
    from tierplan.agent.closed_loop import PlanSource
    from tierplan.runtime.engine.engine import ReferenceEngine
    from tierplan.runtime.engine.hooks import ForcedRoutes
    from tierplan.runtime.engine.scheduler import Batch
    from tierplan.runtime.engine.victims import VictimOrder
    from tierplan.runtime.engine.workloads import Request


@dataclass(frozen=True)
class Split:
    """An HBM split: expert slots per MoE layer (pool order) and GPU KV blocks."""

    expert_slots_per_layer: tuple[int, ...]
    kv_gpu_blocks: int

    @property
    def expert_slots(self) -> int:
        return sum(self.expert_slots_per_layer)

    def hbm_bytes(self, stride_bytes: int, kv_block_bytes: int) -> int:
        return self.expert_slots * stride_bytes + self.kv_gpu_blocks * kv_block_bytes


@dataclass(frozen=True)
class ExpertFuture:
    """What a recording pass saw: `steps[t][m]` is the set of experts MoE (pool) layer m used at step t, under
    `kv_gpu_blocks` GPU KV blocks. `next_use(m, e, t)` is the first step >= t that uses (m, e) (math.inf: none
    recorded), from a per-key index of sorted steps built once."""

    steps: tuple[tuple[frozenset[int], ...], ...]
    kv_gpu_blocks: int
    _index: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for t, layers in enumerate(self.steps):
            for m, experts in enumerate(layers):
                for e in experts:
                    self._index.setdefault((m, e), []).append(t)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def next_use(self, layer: int, expert: int, step: int) -> float:
        uses = self._index.get((layer, expert))
        if not uses:
            return math.inf
        i = bisect.bisect_left(uses, step)
        return uses[i] if i < len(uses) else math.inf


StepExperts = tuple[frozenset[int], ...]  # per MoE (pool) layer: the experts one forward uses


class FutureRecorder:
    """A `ForcedRoutes` wrapper: forwards the table unchanged, and for every forward (the engine asks
    `trace_rows` once per step, before the step runs) keeps the experts each MoE layer uses and hands them to
    `listener` (a policy's bookkeeping). The recording pass passes it as the Runner's router and reads
    `future(kv_gpu_blocks)` at the end; a baseline installs one with `observe_routes`."""

    def __init__(self, router: ForcedRoutes, listener: Callable[[StepExperts], None] | None = None) -> None:
        self.router, self.listener = router, listener
        self.ids, self.weights, self.ids_host = router.ids, router.weights, router.ids_host
        self._steps: list[StepExperts] = []

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def trace_rows(self, seqs: Sequence[int], starts: Sequence[int], num_tokens: Sequence[int]) -> list[int]:
        rows = self.router.trace_rows(seqs, starts, num_tokens)
        ids = self.ids_host[np.asarray(rows, dtype=np.int64)]  # [N, L, k]
        used = tuple(frozenset(int(e) for e in np.unique(ids[:, m])) for m in range(ids.shape[1]))
        self._steps.append(used)
        if self.listener is not None:
            self.listener(used)
        return rows

    def future(self, kv_gpu_blocks: int) -> ExpertFuture:
        return ExpertFuture(tuple(self._steps), kv_gpu_blocks)


@dataclass(frozen=True)
class PointContext:
    """One sweep point, as the runner sees it (read-only for a baseline)."""

    model: str  # preset name, e.g. "qwen3-30b-a3b"
    layers: int  # layers kept (the run may cut the model)
    batch: int  # the point's concurrency (max running sequences)
    context_tokens: int  # the point's context (prompt length scale)
    hbm_budget_bytes: int  # experts + GPU KV (scaled by the kept fraction of layers; workspace already out)
    block_tokens: int
    kv_block_bytes: int  # one KV block on the GPU (all layers)
    expert_stride_bytes: int  # one expert slot
    moe_layers: tuple[int, ...]  # model layer ids that are MoE
    num_experts: int
    kv_cpu_blocks: int  # the CPU and NVMe tiers' capacities in this run
    kv_nvme_blocks: int
    link_bytes_per_s: float  # pinned host->device, measured in this process (CPU run: a nominal figure)
    requests: tuple[Request, ...]  # in arrival order
    future: ExpertFuture | None = None  # only for needs_future baselines: the recorded access stream
    split: Split | None = None  # only for the oracle's search: the split to run
    num_layers: int = 0  # model layers in the run (expert_bytes_per_layer's length); 0: max(moe_layers) + 1
    top_k: int = 1
    memory_bytes_per_s: float = 0.0  # device memory read bandwidth, measured (0: unknown)
    planner_cores: int = 0  # CPUs a controller's child process may use (Sizes.planner_cores; 0: all)

    @property
    def num_model_layers(self) -> int:
        return self.num_layers or max(self.moe_layers) + 1

    @property
    def num_moe(self) -> int:
        return len(self.moe_layers)


@dataclass
class PolicyRun:
    """What a baseline asks of the runner for one point."""

    initial_plan: Plan  # applied through the agent's enforcer before the first step; fits hbm_budget_bytes
    source: PlanSource | None = None  # live re-planning through InProcessLoop; None: the plan holds
    window_steps: int = 8
    victim_order: VictimOrder | None = None  # plugged with engine.experts.set_victim_order after the plan
    on_step: Callable[[Batch, float], None] | None = None  # per-step bookkeeping (LFRU counts, oracle's clock)
    notes: str = ""  # what this baseline simplifies (the table says it)
    split: Split | None = None  # the split the initial plan sets (for the cost model's predicted step)
    local_predictor: bool = False  # attach the agent's layer-ahead predictor (live policies only; see the top)

    def close(self) -> str | None:
        """Stop the source where it has something to stop (a controller's process): why not cleanly, or None."""
        close = getattr(self.source, "close", None)
        return close() if close is not None else None


class Baseline(Protocol):
    name: str  # the row's "policy"
    needs_future: bool  # True: the runner first records the point's access stream (ExpertFuture)

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        """EngineConfig overrides for this run, e.g. {"expert_lookahead_layers": 2}."""
        ...

    def start(self, engine: ReferenceEngine, ctx: PointContext) -> PolicyRun: ...


# ---- helpers every baseline uses ------------------------------------------------------------------------
def observe_routes(engine: ReferenceEngine, listener: Callable[[StepExperts], None]) -> FutureRecorder:
    """Wrap the engine's forced routes (set by the Runner, which the runner builds before `start`) so that
    `listener` sees each step's experts per MoE layer before the step runs; ValueError without forced routes."""
    table = engine.model.forced_routes
    if table is None:
        raise ValueError("this baseline reads the step's routes from the forced routing table: build the Runner "
                         "(ForcedRouter) before calling start()")
    rec = FutureRecorder(table, listener)
    engine.set_hooks(forced_routes=rec)
    return rec


def warmup_counts(engine: ReferenceEngine, num_tokens: int = 256) -> np.ndarray | None:
    """Expert activation counts [L_moe, E] over the routing table's first `num_tokens` tokens (a warm-up window,
    as agent/static_plan.py uses), or None without forced routes."""
    table = engine.model.forced_routes
    if table is None:
        return None
    ids = table.ids_host[:num_tokens]  # [T, L, k]
    e = engine.pool.layout.num_experts
    return np.stack([np.bincount(ids[:, m].reshape(-1), minlength=e) for m in range(ids.shape[1])])


def request_kv_blocks(requests: Sequence[Request], block_tokens: int) -> list[int]:
    """KV blocks each request needs whole (prompt and output), largest first."""
    return sorted((-(-(r.prompt_len + r.output_len) // block_tokens) for r in requests), reverse=True)


def kv_floor_blocks(ctx: PointContext) -> int:
    """GPU KV blocks the largest request needs whole (the scheduler refuses one that could never fit), plus one."""
    return (request_kv_blocks(ctx.requests, ctx.block_tokens) or [1])[0] + 1


def kv_demand_blocks(ctx: PointContext) -> int:
    """GPU KV blocks that would hold the `batch` largest requests at once (the KV share that never preempts)."""
    return max(kv_floor_blocks(ctx), sum(request_kv_blocks(ctx.requests, ctx.block_tokens)[: ctx.batch]))


def even_slots(ctx: PointContext, total_slots: int, min_per_layer: int = 1) -> tuple[int, ...]:
    """`total_slots` spread evenly over the MoE layers (the first layers take the remainder), each within
    [min_per_layer, num_experts]."""
    n = ctx.num_moe
    base, extra = divmod(max(total_slots, min_per_layer * n), n)
    return tuple(min(ctx.num_experts, max(min_per_layer, base + (1 if m < extra else 0))) for m in range(n))


def split_for(ctx: PointContext, expert_bytes: int, min_per_layer: int = 1) -> Split:
    """Spend up to `expert_bytes` on even expert slots (at least `min_per_layer` a layer) and the rest of the
    budget on GPU KV blocks."""
    slots = even_slots(ctx, expert_bytes // ctx.expert_stride_bytes, min_per_layer)
    kv = (ctx.hbm_budget_bytes - sum(slots) * ctx.expert_stride_bytes) // ctx.kv_block_bytes
    return Split(slots, kv)


def fits(ctx: PointContext, split: Split) -> bool:
    return split.hbm_bytes(ctx.expert_stride_bytes, ctx.kv_block_bytes) <= ctx.hbm_budget_bytes


def clamp_split(ctx: PointContext, split: Split, engine: ReferenceEngine) -> Split:
    """The split within what this engine can hold: caps within its slot pool (layer by layer from the last),
    GPU KV blocks within its GPU tier (1 at least, attention reads KV only there)."""
    slots = list(split.expert_slots_per_layer)
    excess = sum(slots) - engine.pool.num_slots
    for m in reversed(range(len(slots))):
        cut = max(0, min(excess, slots[m] - 1))
        slots[m] -= cut
        excess -= cut
    cap = engine.cache.manager.capacity
    from tierplan.runtime.kv import Tier as KVTier

    kv = max(1, min(split.kv_gpu_blocks, cap[KVTier.GPU]))
    return Split(tuple(slots), kv)


def kv_first_split(ctx: PointContext, engine: ReferenceEngine) -> Split:
    """KV first: GPU blocks for the batch's whole demand (`kv_demand_blocks`), experts the rest (even, at most
    every expert), within this engine; mv_wsa's, fluxmoe's and tierplan_kf's start, and tierplan's where its share runs
    enough sequences (`tierplan_live.chosen_start`). At least top_k slots a layer, where the demand
    would take more: a layer of fewer slots than a token's experts runs every step in chunks of them, one
    synchronised load after another (at B=128-256 or 16K context the demand outgrows the scaled budgets)."""
    floor = min(ctx.top_k, ctx.num_experts)
    return clamp_split(ctx, split_for(ctx, kv_first_expert_bytes(ctx, floor), min_per_layer=floor), engine)


def kv_first_expert_bytes(ctx: PointContext, min_per_layer: int) -> int:
    """The expert bytes the budget leaves beside the batch's whole KV demand, `min_per_layer` slots a layer at
    least (the KV-first split's experts; the oracle's first candidate with 1)."""
    return max(min_per_layer * ctx.num_moe * ctx.expert_stride_bytes,
               ctx.hbm_budget_bytes - kv_demand_blocks(ctx) * ctx.kv_block_bytes)


def make_plan(ctx: PointContext, split: Split, name: str, reason: str, *,
              pinned: Sequence[tuple[int, int]] = (), eviction: dict[int, Sequence[int]] | None = None,
              kv_cpu_blocks: int | None = None, kv_nvme_blocks: int | None = None) -> Plan:
    """The plan (version 1 on base 0) that sets `split`: caps in model layers, pins and eviction orders given in
    pool layers ((pool layer, expert); {pool layer: first-to-evict ..}), the CPU/NVMe tiers at their capacity
    unless given. ValueError if it does not fit the point's budget (a baseline bug, never a runner's)."""
    if not fits(ctx, split):
        raise ValueError(f"{name}: split {split} needs {split.hbm_bytes(ctx.expert_stride_bytes, ctx.kv_block_bytes)}"
                         f" bytes, over the point's hbm_budget_bytes={ctx.hbm_budget_bytes}")
    per_layer = [0] * ctx.num_model_layers
    for m, layer in enumerate(ctx.moe_layers):
        per_layer[layer] = split.expert_slots_per_layer[m] * ctx.expert_stride_bytes
    kv = {Tier.GPU: split.kv_gpu_blocks,
          Tier.CPU: ctx.kv_cpu_blocks if kv_cpu_blocks is None else kv_cpu_blocks,
          Tier.NVME: ctx.kv_nvme_blocks if kv_nvme_blocks is None else kv_nvme_blocks}
    return Plan(plan_id=f"{name}-1", version=1, base_version=0, created_s=0.0,
                hbm_budget_bytes=ctx.hbm_budget_bytes, expert_bytes_per_layer=tuple(per_layer),
                kv_blocks_per_tier=kv,
                pinned_experts=tuple(ExpertKey(layer=ctx.moe_layers[m], expert=e) for m, e in pinned),
                eviction_priority=tuple(LayerEviction(layer=ctx.moe_layers[m], order=tuple(order))
                                        for m, order in sorted((eviction or {}).items())),
                reason=f"{name}: {reason}")
