"""`tierplan`: the live controller (its predictors, cost model and MCKP optimizer) re-planning every window.

Bench driver code. Builds the controller exactly as the service would for this engine (`api.hub_config.
controller_config` from the engine's `AgentRegistration` and the group's knobs, then `controller.loop.
Controller`, as api/demo_loop.py's `_controller` does) and hands it to the runner as the plan source. The run
starts from the serving shape an operator declares (vLLM's max_num_seqs and max_model_len), which the enforcer
applies before the first step, so the budget holds from step one and the controller moves away from it only
where its model says it pays. Which shape (`start_split`): KV first (GPU blocks for the batch's largest requests
whole, experts the rest) where that share runs enough sequences that a step's tokens share the experts it
streams (`KV_FIRST_MIN_BATCHES`) or where it costs next to no expert slots (`KV_FIRST_FREE_SLOT_SHARE`), else
the resident split (every expert that fits, KV the rest). `mv_wsa`,
`fluxmoe` and the variant `tierplan_kf` always start KV first: among them only the allocator differs; where
tierplan starts resident, it differs from them in its start too. The controller never issued that plan, so
`AfterInitialPlan` shifts plan versions between the agent and the controller by one. `mv_wsa` and `fluxmoe`
reuse this with another allocator. It must never move bytes or build a plan itself.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from tierplan.bench.baselines.base import (
    PointContext,
    PolicyRun,
    Split,
    kv_first_split,
    kv_floor_blocks,
    make_plan,
    request_kv_blocks,
)
from tierplan.bench.baselines.static import resident_split

if TYPE_CHECKING:
    from tierplan.controller.protocol import Plan, PlanAck, Telemetry
    from tierplan.runtime.engine.engine import ReferenceEngine

# Telemetry windows of 8 steps and plans expected to hold 8 windows: a migration is priced over 64 steps, so a
# transient (a prefill burst) does not move experts that the next windows want back (4 and 4 churned on the
# quick sweep: 3-5 plan changes in a 30-step run).
WINDOW_STEPS = 8
HORIZON_WINDOWS = 8


def registration(engine: ReferenceEngine, ctx: PointContext, agent_id: str = "controller") -> Any:
    """The engine's `AgentRegistration`: its shape, the point's link figure and budget, the KV tiers. The
    compute sheet is a prior the windows correct when the controller calibrates."""
    from tierplan.controller.protocol import Link
    from tierplan.controller.protocol_service import (
        AgentRegistration,
        ComputeSheet,
        HardwareSheet,
        ShapeSpec,
        SplitSheet,
    )
    from tierplan.runtime.kv import Tier

    spec = engine.spec
    return AgentRegistration(
        agent_id=agent_id, group="phase", engine="tierplan-reference", registered_s=0.0,
        shape=ShapeSpec(name=spec.name, num_layers=spec.num_layers, moe_layers=tuple(spec.moe_layers),
                        num_experts=spec.num_experts, top_k=spec.top_k, expert_bytes=ctx.expert_stride_bytes,
                        dense_bytes=0, kv_bytes_per_token=max(1, ctx.kv_block_bytes // ctx.block_tokens),
                        block_tokens=ctx.block_tokens),
        hardware=HardwareSheet(name="phase point", link_bytes_per_s=dict.fromkeys(Link, ctx.link_bytes_per_s),
                               transfer_overhead_s=2e-4, hbm_bytes=ctx.hbm_budget_bytes,
                               hbm_bytes_per_s=ctx.memory_bytes_per_s),
        split=SplitSheet(hbm_budget_bytes=ctx.hbm_budget_bytes, dense_bytes=0, workspace_bytes=0,
                         slot_bytes=ctx.expert_stride_bytes, kv_block_bytes=ctx.kv_block_bytes,
                         kv_gpu_blocks_max=engine.cache.manager.capacity[Tier.GPU],
                         kv_gpu_blocks_min=kv_floor_blocks(ctx), kv_block_tokens=ctx.block_tokens,
                         max_running_seqs=ctx.batch,
                         kv_cpu_blocks=ctx.kv_cpu_blocks, kv_nvme_blocks=ctx.kv_nvme_blocks),
        compute=ComputeSheet(step_ms=1.0, dense_ms=0.5, moe_ms=0.3, dense_ms_per_token=0.01, moe_ms_per_token=0.01,
                             moe_ms_per_active_expert=active_expert_prior_ms(ctx)))


def active_expert_prior_ms(ctx: PointContext) -> float:
    """The compute prior of one active expert: its bytes read once at the measured memory bandwidth (0.05 ms
    where none was measured). Calibration cannot correct this term where every step has about the same active
    experts (a layer whose steps all use its ~66 hot experts): it stays at the prior, and 0.05 ms made the live
    controllers predict 1.1-4.5x the measured step at the H200's 40-56 GiB points (runs 17-19), where an H200
    would read a 9.4 MiB expert in ~2 microseconds at its datasheet bandwidth (4.8 TB/s; not measured here)."""
    return ctx.expert_stride_bytes / ctx.memory_bytes_per_s * 1e3 if ctx.memory_bytes_per_s > 0 else 0.05


def controller_config(engine: ReferenceEngine, ctx: PointContext, calibrate: bool) -> Any:
    """The group's ControllerConfig for this point (ValueError if the knobs do not fit the registration)."""
    from tierplan.api.hub_config import controller_config as hub_controller_config
    from tierplan.controller.protocol_service import PolicyKnobs

    knobs = PolicyKnobs(min_slots_per_layer=max(1, min(ctx.top_k, ctx.num_experts)),
                        horizon_steps=HORIZON_WINDOWS * WINDOW_STEPS, calibrate=calibrate)
    cfg = hub_controller_config(registration(engine, ctx), knobs)
    # The local predictor's prior recall until measured, as the demo's in-process controller has it.
    return dataclasses.replace(cfg, space=dataclasses.replace(cfg.space, prefetch_recall=0.3))


# KV first pays where its share runs at least this many times num_experts / top_k sequences: a decode step's
# tokens then route to about every expert of a layer, so the experts it streams are shared by many tokens; with
# fewer, each token pays for loads of its own and the experts KV first gave up cost more than its sequences
# earn. H100 phase runs 52-53 (bench/results/phase_h200.md, session 30), tierplan from KV first against
# tierplan_rs from the resident split, the same controller: KV first 2.5x at b128 4K 40 GiB (its share runs ~103
# sequences) and 1.15x at b256 1K 40 GiB (256); the resident start 1.07-1.24x at the 16K b128/b256 40 GiB points
# (~22) and 1.14-1.66x at three b8 points (0.94x at b8 16K 24 GiB). 2 x 128 / 8 = 32 for qwen3 sits between; the
# factor is chosen from these runs, not derived. Measured in H100 runs 54-55 (session 31): the resident start
# 1.06-1.81x tierplan_kf at the four b8 points, 0.93x at b128 16K 40 GiB. The 16K 56 GiB points sit on it (~32 at
# b32, ~35 at b128): there tierplan from KV first lost to static_lru in all seven runs (phase runs 37-57,
# 0.59-0.93x, 5-6 preemptions each) yet beat resident 1.36x at b128 (H100 run 57); a larger factor would also start
# resident at b32 1K 24/40 GiB (32 sequences, KV first keeping 299/572 slots: tierplan 1.31x/1.00x the best
# baseline there) and b128/b256 4K 24 GiB (~40; KV first 1.56-1.71x resident), so it stays until the two starts
# are measured side by side there.
KV_FIRST_MIN_BATCHES = 2.0
# Below that, KV first still pays where it costs next to no experts: at most this share of the resident split's
# slots, and its smallest layer holds a decode step's union at the batch it runs (uniform routing, the largest
# union). H100 phase run 62, b8 1K 40/56 GiB: KV first kept 611/885 slots against the resident 623/897 (2.0 %/1.3 %)
# for 651/614 KV blocks against 171/134, all 8 sequences against 2.5 a step, a 128-expert layer holding 76/110 slots
# against a 51.6-expert union at 8 tokens: fluxmoe 846.2/681.1 tok/s and static_lru 440.1/750.6 against the
# resident split's 554.9/529.2 (tierplan from it 536.7/503.8). Not at b8 1K 24 GiB (338 against 350 slots, 3.4 %,
# 42 a layer under the union: resident 206.3, fluxmoe 220.1, tierplan from the resident split 230.2) nor at b8 16K
# 56 GiB (574 against 753 slots, 24 %: KV first 253-256 tok/s, resident 274.6; sessions 33-35's rows). 10 %, not
# the 5 % of session 36: H100 phase runs 69-70 (session 38), b8 4K 40/56 GiB, KV first gave up 7.7 %/5.3 % of the
# slots for all 8 sequences against 2.5, every layer above the union, with no miss either way: fluxmoe and mv_wsa
# 634.5-641.8 / 662.1-795.1 tok/s against the resident split's 511.4/460.7, tierplan from it 550.9/525.0. The next
# share measured, 14 % (b8 4K 24 GiB), fails the union anyway; none lies between.
KV_FIRST_FREE_SLOT_SHARE = 0.10


def sequences_run(ctx: PointContext, gpu_blocks: int) -> int:
    """About how many sequences `gpu_blocks` run at once: the point's requests' mean KV blocks whole (prompt and
    output) into them, at most the batch."""
    blocks = request_kv_blocks(ctx.requests, ctx.block_tokens)
    mean = sum(blocks) / len(blocks) if blocks else 1.0
    return min(ctx.batch, int(gpu_blocks / max(1.0, mean)))


def uniform_union(num_experts: int, top_k: int, tokens: int) -> float:
    """Experts a layer's step of `tokens` tokens needs when every token picks top_k of num_experts uniformly (the
    largest union any routing gives for that many tokens): E (1 - (1 - k/E)^tokens)."""
    return num_experts * (1.0 - (1.0 - min(top_k, num_experts) / num_experts) ** max(1, tokens))


def batch_rule(num_experts: int, top_k: int) -> tuple[float, str]:
    """The sequences KV first's share must run to pay on its own (`KV_FIRST_MIN_BATCHES` x num_experts / top_k),
    and the rule as the start's reason writes it."""
    need = KV_FIRST_MIN_BATCHES * num_experts / max(1, top_k)
    return need, f"{need:g} = {KV_FIRST_MIN_BATCHES:g} x experts / top-k"


def kv_first_pays(kv_first: Split, held: int, resident: Split, resident_held: int, num_experts: int,
                  top_k: int) -> str | None:
    """Why KV first (running ~`held` sequences) beats the resident split (running ~`resident_held`) as a start,
    or None where it does not: its share runs at least `KV_FIRST_MIN_BATCHES` x num_experts / top_k sequences,
    or it costs at most `KV_FIRST_FREE_SLOT_SHARE` of the resident split's slots for more sequences while its
    smallest layer holds a step's union at its batch (`uniform_union`)."""
    need, rule = batch_rule(num_experts, top_k)
    if held >= need:
        return f">= {rule}"
    given_up = resident.expert_slots - kv_first.expert_slots
    union = uniform_union(num_experts, top_k, held)
    if held > resident_held and given_up <= KV_FIRST_FREE_SLOT_SHARE * resident.expert_slots \
            and min(kv_first.expert_slots_per_layer) >= union:
        return (f"< {rule}, for {given_up} of the resident split's {resident.expert_slots} slots, every layer "
                f">= a {union:.1f}-expert step at {held} tokens")
    return None


def chosen_start(ctx: PointContext, engine: ReferenceEngine) -> tuple[Split, str]:
    """tierplan's start (module docstring): KV first where `kv_first_pays`, else the resident split; with the
    reason's opening."""
    kv_first, resident = kv_first_split(ctx, engine), resident_split(ctx, engine)
    held = sequences_run(ctx, kv_first.kv_gpu_blocks)
    why = kv_first_pays(kv_first, held, resident, sequences_run(ctx, resident.kv_gpu_blocks), ctx.num_experts,
                        ctx.top_k)
    if why is not None:
        return kv_first, (f"KV first ({kv_first.kv_gpu_blocks} GPU blocks for the batch, ~{held} sequences at "
                          f"once, {why}), experts the rest")
    rule = batch_rule(ctx.num_experts, ctx.top_k)[1]
    return resident, resident_reason(resident, f"KV first's {kv_first.kv_gpu_blocks} would run ~{held} sequences "
                                               f"at once, < {rule}, for {resident.expert_slots - kv_first.expert_slots}"
                                               f" of {resident.expert_slots} slots")


def resident_reason(split: Split, why: str = "") -> str:
    """The reason's opening for a start from the resident split, with `why` where it was chosen."""
    tail = f": {why}" if why else ""
    return f"resident start ({split.expert_slots} expert slots, {split.kv_gpu_blocks} GPU KV blocks{tail})"


class AfterInitialPlan:
    """A `PlanSource` in front of a controller that did not issue the plan the agent applied first: versions
    seen by the agent are the controller's plus `offset` (telemetry and acks shifted down, plans up)."""

    def __init__(self, source: Any, offset: int = 1) -> None:
        self.source, self.offset = source, offset
        self.unshiftable_acks = 0  # acks for versions the controller never issued (counted, not forwarded)

    def sync_from(self, telemetry: Telemetry) -> Any:
        v = max(0, telemetry.applied_plan_version - self.offset)
        return self.source.sync_from(telemetry.model_copy(update={"applied_plan_version": v}))

    def step_next(self) -> Plan | None:
        plan = self.source.step_next()
        if plan is None:
            return None
        return plan.model_copy(update={"version": plan.version + self.offset,
                                       "base_version": plan.base_version + self.offset})

    def record_ack(self, ack: PlanAck) -> None:
        if ack.version <= self.offset:
            self.unshiftable_acks += 1
            return
        self.source.record_ack(ack.model_copy(update={"version": ack.version - self.offset}))

    @property
    def history(self) -> list[Any]:
        return list(getattr(self.source, "history", []))

    @property
    def controller_stats(self) -> dict[str, Any] | None:
        """The controller's counters (`Controller.stats`), in this process or its own; None where it has none."""
        got = getattr(self.source, "controller_stats", None)
        if got is None and callable(stats := getattr(self.source, "stats", None)):
            got = stats()
        return got

    @property
    def host_spans(self) -> list[tuple[float, float]]:  # a controller in a child process: this side's work per call
        return list(getattr(self.source, "host_spans", []))

    @property
    def solve_spans(self) -> list[tuple[float, float, float]]:  # and the child's: (sent, answered, its CPU s)
        return list(getattr(self.source, "solve_spans", []))

    def close(self) -> str | None:
        """A controller in a child process stops (an in-process one has nothing to close): why not cleanly, or None."""
        close = getattr(self.source, "close", None)
        return close() if close is not None else None


def controller_class() -> type:
    from tierplan.controller.loop import Controller

    return Controller


def mckp_controller(config: Any) -> Any:
    """The controller as the service runs it: the MCKP optimizer (in the controller's process)."""
    return controller_class()(config)


PLANNERS = ("process", "thread")


class TierplanLive:
    name = "tierplan"
    needs_future = False
    allocator = "the MCKP optimizer (exact DP) over the predictors' miss-ratio curves and the cost model"
    factory = staticmethod(mckp_controller)  # config -> controller; module-level, so a child process can build it
    batch_coupling = True  # each KV share valued at the batch it runs (controller/coupling.py)
    # tierplan's own rules around its first plans (ControllerConfig.weigh_start, hold_slots_while_filling) and its
    # quiet windows (`quiet_windows`); the baselines that reuse this controller with their allocator re-plan as
    # published, every window, without them.
    tierplan_guards = True
    notes = ""  # the rows' notes (default: "live: " and the allocator)

    def __init__(self, calibrate: bool = True, planner: str = "process", local_predictor: bool = False) -> None:
        """planner: "process" runs the controller in a child process (plan_process.py), as a deployed one runs
        beside the engine; "thread" in the engine's process, on the loop's outbox thread. local_predictor:
        attach the agent's layer-ahead predictor (agent/local_predictor.py: the step unions behind the measured
        miss-ratio curves, the pairs behind the prefetch table). Off by default: on the H200 (phase runs 15-16,
        bench/results/phase_h200.md) its prefetches never reached the precision the controller asks of a table,
        the run cost 3 ms a step more at B=1, and the measured curves led to slower splits than the activation
        frequencies (tierplan 95.1 / 111.6 / 161.6 tok/s with it, 145.4 / 188.4 / 205.4 without, at B=1/8/32)."""
        if planner not in PLANNERS:
            raise ValueError(f"{self.name}: planner must be one of {', '.join(PLANNERS)}, got {planner!r}")
        self.calibrate = calibrate  # False: priors only, so no wall-clock time enters a decision (tests)
        self.planner = planner
        self.local_predictor = local_predictor
        self.controller: Any = None

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        return {}

    def make_controller(self, engine: ReferenceEngine, ctx: PointContext) -> Any:
        config = dataclasses.replace(controller_config(engine, ctx, self.calibrate),
                                     batch_coupling=type(self).batch_coupling,
                                     weigh_start=type(self).tierplan_guards,
                                     hold_slots_while_filling=type(self).tierplan_guards)
        if not type(self).tierplan_guards:
            config = dataclasses.replace(config, quiet_windows=0)
        if self.planner == "process":
            from tierplan.bench.baselines.plan_process import ProcessPlanSource

            return ProcessPlanSource(type(self).factory, config, cores=ctx.planner_cores)
        return type(self).factory(config)

    def start_split(self, ctx: PointContext, engine: ReferenceEngine) -> tuple[Split, str]:
        """The split the agent applies before the first step, and its reason's opening: tierplan's own choice
        (`chosen_start`)."""
        return chosen_start(ctx, engine)

    def start(self, engine: ReferenceEngine, ctx: PointContext) -> PolicyRun:
        self.controller = self.make_controller(engine, ctx)
        split, why = self.start_split(ctx, engine)
        plan = make_plan(ctx, split, self.name, f"{why}; then {self.allocator}")
        cpus = getattr(self.controller, "cpus", ())  # a controller in a child process: the CPUs it may run on
        mine = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
        where = (f"; planner process on {len(cpus)} CPU(s) {_ranges(cpus)}"
                 + (f", the engine on {len(mine)} CPU(s) {_ranges(mine)}" if mine else "")) if cpus else ""
        if (why := getattr(self.controller, "confine_error", None)) is not None:
            where += f" (not confined: {why})"
        return PolicyRun(plan, source=AfterInitialPlan(self.controller), window_steps=WINDOW_STEPS, split=split,
                         notes=(self.notes or f"live: {self.allocator}") + where, local_predictor=self.local_predictor)


def _ranges(cpus: tuple[int, ...]) -> str:
    """CPU ids as ranges, e.g. (12, 13, 14, 15) -> "12-15"."""
    out: list[list[int]] = []
    for c in cpus:
        if out and c == out[-1][1] + 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out)


class KVFirstStart:
    """The start `mv_wsa`, `fluxmoe` and `tierplan_kf` share: KV first, whatever the batch it runs."""

    def start_split(self, ctx: PointContext, engine: ReferenceEngine) -> tuple[Split, str]:
        split = kv_first_split(ctx, engine)
        return split, f"KV first ({split.kv_gpu_blocks} GPU blocks for the batch), experts the rest"


class TierplanKVFirst(KVFirstStart, TierplanLive):
    """`tierplan` always started KV first (its start through session 29): a variant to measure `chosen_start`
    against (`--policies tierplan,tierplan_kf,...`), never a baseline."""

    name = "tierplan_kf"


class TierplanResidentStart(TierplanLive):
    """`tierplan` always started from the resident split (every expert that fits, KV the rest): the
    same controller, only the start differs. A variant to measure the start with (`--policies tierplan,
    tierplan_rs,...`), never a baseline: the report sets tierplan against the baselines, not its variants. At the
    16K points the controller's first plan cut the KV-first start's share to about resident's (H100 runs 49-51:
    18,691 -> 2,070-2,080 GPU blocks, ~16,600 moved in 1.24 s of a 2.46 s run at b256 16K 40 GiB); runs 20-22
    (session ~15's controller) found the resident start held the batch back at 1K-4K."""

    name = "tierplan_rs"

    def start_split(self, ctx: PointContext, engine: ReferenceEngine) -> tuple[Split, str]:
        split = resident_split(ctx, engine)
        return split, resident_reason(split)
