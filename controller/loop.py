"""The controller: mirror what agents report (`sync_from`), then decide the next plan (`step_next`).

Runs in the controller process (in process beside the engine for now; behind the HTTP service later).
`sync_from(telemetry)` records an accepted window in `ControllerState`, calibrates the cost model on it and
feeds the demand models; it decides nothing. `step_next()` forecasts, values every option of the split (per
MoE layer: resident slots; KV: GPU blocks; see valuation.py), solves the knapsack exactly (DP by default,
the HiGHS MILP on request) for the candidate KV shares, each at the batch it runs (coupling.py; the
separable split with `batch_coupling=False`), gives the HBM no option valued to GPU KV blocks (`with_spare_kv`),
holds the current split (before our first plan applies: the one the agent reports it started with) unless the new
one is better by the hysteresis margin, takes no slots from a layer while the batch first fills, and emits a
`Plan` with the split, pins (leaving room for the union of the busiest step) and eviction orders from the
activation frequencies, the local transition table and its prefetch byte budget, the KV retention order (prefix
hashes, most likely reused first, from the reuse predictor `sync_from` feeds live: kv_reuse_feed.py; a kept split
is re-issued when that order moves by `kv_retention_refresh`), and a reason naming the top factors.
An operator's pinned experts are always in the plan's pins (their layers get the slots for them); `predictor`
picks the forecast's curve source, and a shadow source is scored beside it (controller/curve_shadow.py),
promoted only when it predicts better.
It never applies anything (the agent does), never imports torch, runtime or agent, and keeps no globals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum

from tierplan.controller.chunk_whole import unions_high
from tierplan.controller.costmodel import ComputeParams, CostModel, HardwareSpec
from tierplan.controller.coupling import ShareTerms, busiest_batch, slots_of, solve_coupled
from tierplan.controller.curve_shadow import CurveShadow
from tierplan.controller.demand import CurveSource, DemandForecast, DemandModel
from tierplan.controller.kv_reuse_feed import KvReuseConfig, KvReuseFeed, Retention
from tierplan.controller.model_shape import ModelShape
from tierplan.controller.optimizer import Action, HysteresisPolicy, SplitHysteresis, solve
from tierplan.controller.optimizer.problem import SplitSolution, evaluate, units_for_bytes
from tierplan.controller.plan_reason import Split, explain
from tierplan.controller.protocol import (
    MAX_RETENTION,
    AckStatus,
    ExpertKey,
    Forecast,
    LayerEviction,
    LayerForecast,
    LocalPredictor,
    Plan,
    PlanAck,
    Telemetry,
    Tier,
)
from tierplan.controller.state import AgentRecord, ControllerState, ModelInfo
from tierplan.controller.valuation import SplitSpace, Valuation, build_problem

MAX_REASON_CHARS = 4000  # a plan's reason (the protocol allows a little more)
# A window's planning is mostly its forecast's LRU curves (8 layers: ~170 of ~220 ms on a 2-core box), computed
# again at every window since a window's tokens move some expert's step-need past the memo's tolerance; on the
# H100 tierplan's planner took ~150 ms a window against windows of ~100 ms at b256 4K 56 GiB (phase run 75), never
# idle (88-91 ms with quiet windows, runs 78-79; the slow prefill steps first blamed on it were the first run's place
# at the point, bench/phase_grid.py `warmup_policies`). A split that
# held at the last QUIET_AFTER_HELD windows, for windows within QUIET_TOLERANCE of the last one planned, is held
# again without planning (at most `quiet_windows` in a row; none while the KV demand rises).
QUIET_AFTER_HELD = 2
QUIET_TOLERANCE = 0.10  # relative, on the batch and the KV demand; absolute on the share of expert accesses missed
PIN_UNION_HEADROOM = 1.25  # step unions vary around their mean: room for most steps' unions, not the mean's


def with_spare_kv(split: Split, space: SplitSpace) -> tuple[Split, int]:
    """`split` with the HBM it leaves unspent given to GPU KV blocks (up to the tier's capacity), and how many.

    Where more expert slots buy nothing (a layer's curve is flat past the experts its steps use) and the KV
    demand is met, the solve may leave HBM idle: all options price it at zero. Idle HBM helps nobody, and KV
    blocks admit the requests that queue up before the next window's plan (H200 phase runs 18-19: the first
    plan held 134 KV blocks at 40-56 GiB with most of the budget idle, and more KV came three windows later, at
    0.75-0.85x the policies that started with it). A later plan takes the blocks back for experts if they pay.
    The spare is counted in the problem's HBM units, as the next window's problem counts the split in force (each
    layer's slots and the KV share rounded up to whole units), not in bytes: filled to the byte, a split used a
    unit or two more than the capacity the next problem gives, read as "no longer fits", and that forced a switch
    every window (H200 phase run 37, b32 16K 24 GiB: 18 plans, each one slot and 40 blocks off the one before)."""
    fit = units_beside(split.slots, space) * space.unit_bytes // space.kv_block_bytes
    extra = max(0, min(fit - split.kv_blocks, space.kv_gpu_blocks_max - split.kv_blocks))
    return (replace(split, kv_blocks=split.kv_blocks + extra), extra) if extra else (split, 0)


def units_beside(slots: tuple[int, ...], space: SplitSpace) -> int:
    """The problem's HBM units left beside `slots` per MoE layer, each layer's slots rounded up to whole units as
    the problem counts a split (negative where the slots alone are over the capacity)."""
    return space.capacity_units - sum(units_for_bytes(s * space.slot_bytes, space.unit_bytes) for s in slots)


def in_units(split: Split, space: SplitSpace) -> Split:
    """A split the agent started with (sized in bytes by whoever launched it), as the problem counts splits: each
    layer's slots and the KV share rounded up to whole HBM units. Filled to the byte, it reads up to a unit a group
    over the capacity, and a split that "no longer fits" forces a switch past the hysteresis margin and the
    first-fill hold (H100 phase run 60, b128 16K 40 GiB: the resident start read 4,100 units of 4,095, and the
    first plan moved 91 slots to KV while the demand rose; its twin in run 59, the same work as resident, had not).
    Over by no more than the rounding, its KV share gives up the blocks of the excess; over by more, the budget
    did shrink: it stays as it is, and the switch is owed."""
    unit = space.unit_bytes
    free = units_beside(split.slots, space)
    over = units_for_bytes(split.kv_blocks * space.kv_block_bytes, unit) - free
    if over <= 0 or over > len(split.slots) + 1:
        return split
    return replace(split, kv_blocks=max(0, free * unit // space.kv_block_bytes))


def num_pins(slots: int, union: float, top_k: int, pin_frac: float, operator_pins: int = 0) -> int:
    """Experts to pin in a layer of `slots` slots whose steps need `union` distinct experts on average.

    A step runs through the piecewise graphs only if each layer's union fits its slots less the pinned experts
    the step does not ask for (the engine's `PieceResidency.fits`); otherwise the whole step runs eagerly, in
    chunks. So pins leave the union room: at pin_frac 0.5, 72 of 163 decode steps fell back at B=8 and 26
    without pins (H200 phase run 13, bench/results/phase_h200.md). The operator's pins are kept whatever."""
    room = max(top_k, math.ceil(PIN_UNION_HEADROOM * union))
    return max(operator_pins, min(int(pin_frac * slots), max(0, slots - room)))


class Solver(StrEnum):  # the optimizer's exact solvers (its greedy is a baseline, not offered here)
    DP = "dp"
    MILP = "milp"


class Outcome(StrEnum):
    ISSUED = "issued"
    HELD = "held"  # the new split was not better by the hysteresis margin
    WAITING = "waiting"  # no new window, or the last plan is neither applied nor rejected yet


@dataclass(frozen=True)
class ControllerConfig:
    shape: ModelShape
    hardware: HardwareSpec
    space: SplitSpace
    kv_cpu_blocks: int
    kv_nvme_blocks: int
    solver: Solver = Solver.DP
    hysteresis: float = 0.10  # a new split must save this share of the current cost, and of the step compute
    cooldown_windows: int = 0  # windows after a change during which the split is kept
    horizon_steps: int = 64  # steps a plan is expected to hold (migration is amortised over them)
    top_m: int = 4  # successors per source expert in the local table
    min_prob: float = 0.05  # successors below this are left out of the table
    min_score: float = 0.5  # the agent prefetches experts scored at least this
    # The prefetch table is withheld while fewer of the agent's prefetches are used than this (measured): a wasted
    # one moves an expert and evicts a resident, about what a used one saves (H200 phase run 08: 0.48 used).
    min_prefetch_precision: float = 0.5
    # Share of a layer's slots pinned to its hottest experts (against LRU scans), never so many that the slots
    # left beside them hold less than PIN_UNION_HEADROOM x the layer's step union (see `num_pins`).
    pin_frac: float = 0.5
    compute: ComputeParams | None = None  # the cost model's compute prior (None: from the hardware sheet)
    calibrate: bool = True  # fit the cost model to each window; False keeps the priors (deterministic plans)
    pinned_experts: tuple[ExpertKey, ...] = ()  # always pinned, whatever their demand (an operator's choice)
    predictor: CurveSource = CurveSource.MISS_RATIO  # where the forecast's miss curves come from
    shadow_predictor: CurveSource | None = None  # scored beside `predictor` on every window
    auto_promote: bool = False  # the shadow replaces `predictor` once it predicts better (else only reported)
    kv_reuse: KvReuseConfig = field(default_factory=KvReuseConfig)  # the live KV reuse predictor
    kv_retention_max: int = 1024  # prefixes a plan's kv_retention lists (also at most the CPU + NVMe blocks)
    kv_retention_refresh: float = 0.25  # share of the list that must change to re-issue a kept split for it
    batch_coupling: bool = True  # value each KV share at the batch it runs (coupling.py); False: separable
    # Weigh the first plan against the split the agent reports it started with (Telemetry.expert_slots), hysteresis
    # and moves priced as for any later plan; False: the first plan is the solve's, whatever the start.
    weigh_start: bool = True
    # While the batch first fills (the KV demand rising, never settled nor fallen yet), no layer gives up slots
    # (`step_next` says why); False: none held.
    hold_slots_while_filling: bool = True
    # Up to this many windows in a row are not planned while they look like the window last planned (`Quiet`):
    # the split held at the last QUIET_AFTER_HELD decisions, the KV demand not rising. 0: every window is planned.
    quiet_windows: int = 3


def pinned_by_layer(shape: ModelShape, pinned: tuple[ExpertKey, ...]) -> dict[int, tuple[int, ...]]:
    """Operator pins by model layer; ValueError naming the first pin outside the model's MoE experts."""
    moe, out = set(shape.moe_layers), {}
    for i, key in enumerate(pinned):
        if key.layer not in moe or key.expert >= shape.num_experts:
            raise ValueError(f"pinned_experts.{i}: layer {key.layer} expert {key.expert} is not a routed expert of "
                             f"{shape.name!r} (MoE layers {shape.moe_layers}, {shape.num_experts} experts each)")
        out.setdefault(key.layer, ())
        out[key.layer] = (*out[key.layer], key.expert)
    return out


@dataclass(frozen=True)
class Decision:
    """One `step_next` that had something to decide: issued or held, and why (the demo's plan history)."""

    outcome: Outcome
    version: int  # the plan issued, or the one kept
    window: int  # windows seen so far
    batch_tokens: float
    kv_demand_blocks: float
    split: Split
    predicted_ms: float  # predicted cost per step of the split (stall + KV deferral)
    reason: str
    step_ms: float = 0.0  # predicted step time of the split: compute at the batch plus its expert stall
    shares: tuple[ShareTerms, ...] = ()  # every KV share the coupled search solved, term by term (none: separable)


@dataclass(frozen=True)
class Quiet:
    """What a window is compared by, to tell whether planning it would see what the last planned window saw."""

    batch_tokens: float  # the demand model's running batch
    kv_demand_blocks: float  # KV blocks held plus queued at the window's end
    miss_share: float  # expert accesses missed in the window

    def like(self, other: Quiet, tolerance: float = QUIET_TOLERANCE) -> bool:
        """Whether this window is within `tolerance` of `other` on every figure."""
        def near(a: float, b: float) -> bool:
            return abs(a - b) <= tolerance * max(abs(a), abs(b), 1.0)

        return (near(self.batch_tokens, other.batch_tokens) and near(self.kv_demand_blocks, other.kv_demand_blocks)
                and abs(self.miss_share - other.miss_share) <= tolerance)


@dataclass
class _Current:
    split: Split | None = None
    start: Split | None = None  # the split the agent started with (reported), before any plan of ours applied
    forecast: DemandForecast | None = None
    plan: Plan | None = None
    history: list[Decision] = field(default_factory=list)
    window: Quiet | None = None  # the newest window's figures
    planned: Quiet | None = None  # those of the window last planned
    held_in_row: int = 0  # decisions in a row that held the split
    quiet_in_row: int = 0  # windows in a row not planned (`ControllerConfig.quiet_windows`)


class Controller:
    """See the module docstring."""

    def __init__(self, config: ControllerConfig, agent_id: str = "controller") -> None:
        shape = config.shape
        self.pins = pinned_by_layer(shape, config.pinned_experts)
        if self.pins:  # a layer with pins keeps them resident plus room for one token's top-k
            floors = tuple(min(shape.num_experts, len(self.pins.get(layer, ())) + shape.top_k) if layer in self.pins
                           else 0 for layer in shape.moe_layers)
            config = replace(config, space=replace(config.space, layer_min_slots=floors))
        self.config, self.agent_id = config, agent_id
        self.shadow = (CurveShadow(config.predictor, config.shadow_predictor, config.auto_promote)
                       if config.shadow_predictor is not None else None)
        self.state = ControllerState(ModelInfo(shape.name, shape.num_layers, shape.num_experts, shape.moe_layers))
        self.cost = CostModel(shape, config.hardware, compute=config.compute)
        self.demand = DemandModel(shape.moe_layers, shape.num_experts, shape.top_k, block_tokens=shape.block_tokens)
        self.kv_reuse = KvReuseFeed(config.kv_reuse)
        self._now = _Current()
        self.hysteresis = SplitHysteresis(HysteresisPolicy(rel_margin=config.hysteresis,
                                                           cooldown_windows=config.cooldown_windows))
        self._fresh = False
        self._created_s = 0.0
        self.plans_rejected = 0  # plans an agent refused (each version once); the next window re-plans
        self.stale_acks = 0  # APPLIED acks for a version older than the current plan: mirrored, not followed
        self.windows_quiet = 0  # windows not planned: like the last one planned, the split held (`_quiet`)

    @property
    def history(self) -> list[Decision]:
        return list(self._now.history)

    def pop_decisions(self) -> list[Decision]:
        """The decisions since the last call, handed over and forgotten (a long-running service keeps none)."""
        out, self._now.history = self._now.history, []
        return out

    @property
    def predictor(self) -> CurveSource:
        """The curve source the forecast uses now (the configured one, or a promoted shadow)."""
        return self.shadow.active if self.shadow is not None else self.config.predictor

    def stats(self) -> dict[str, int]:
        """Counters of what the controller did with the plan side (issued, refused by an agent, stale acks), with
        the step unions (reported steps past the curves' per-window cap, left out) and with KV reuse events (fed
        to the reuse predictor, over a window's cap, windows behind the clock)."""
        return {"plans_issued": self.state.issued_version, "plans_rejected": self.plans_rejected,
                "stale_acks": self.stale_acks, "applied_version": self.state.applied_version(),
                "windows_quiet": self.windows_quiet,
                "union_steps_skipped": self.demand.union_steps_skipped,
                **{f"kv_reuse_{k}": v for k, v in self.kv_reuse.stats().items() if k != "windows"}}

    # ---- observe ----------------------------------------------------------------------------------------
    def sync_from(self, telemetry: Telemetry) -> AgentRecord:
        """Mirror one window (TelemetryRejected, changing nothing, if it does not fit), calibrate, learn."""
        rec = self.state.sync_from(telemetry)
        if self.shadow is not None:
            self.shadow.score(self.demand, self._now.split.slots if self._now.split else None, telemetry)
        if self.config.calibrate:
            self.cost.calibrate(telemetry)
        self.demand.observe(telemetry)
        self.kv_reuse.observe(telemetry)
        if self.config.weigh_start and telemetry.applied_plan_version == 0 and telemetry.expert_slots \
                and telemetry.kv_gpu_limit_blocks is not None:
            reported = {row.layer: row.slots for row in telemetry.expert_slots}
            slots = tuple(reported.get(layer, 0) for layer in self.config.shape.moe_layers)
            self._now.start = in_units(Split(slots, telemetry.kv_gpu_limit_blocks), self.config.space)
        self._created_s = max(self._created_s, telemetry.window_end_s)
        self._fresh = True
        accesses = telemetry.expert_hits + telemetry.expert_misses
        self._now.window = Quiet(self.demand.batch_tokens or 0.0, self.demand.kv_live_now,
                                 telemetry.expert_misses / accesses if accesses else 0.0)
        return rec

    def record_ack(self, ack: PlanAck) -> None:
        """Mirror an ack (TelemetryRejected, changing nothing, if the state refuses it). An APPLIED ack moves
        the current split only when it names a newer plan than the current one: a late ack for an older plan
        is counted in `stale_acks` and must not roll the split back."""
        newly_rejected = ack.status is AckStatus.REJECTED and ack.version not in self.state.rejected
        self.state.record_ack(ack)
        if newly_rejected:
            self.plans_rejected += 1
        if ack.status is not AckStatus.APPLIED:
            return
        current = self._now.plan.version if self._now.plan is not None else 0
        if ack.version < current:
            self.stale_acks += 1
            return
        plan = self.state.plans.get(ack.version)
        if ack.version > current and plan is not None:
            self._now.split = self._split_of(plan)
            self._now.plan = plan
            self.demand.kv_gpu_limit = self._now.split.kv_blocks

    def forecast_message(self) -> Forecast:
        """The demand forecast as the protocol's `Forecast` (per MoE layer, P(expert needed within the plan's
        horizon); KV reuse scores: the live reuse model's probabilities by prefix hash (empty before its fit)."""
        shape, fc = self.config.shape, self.demand.forecast(self.predictor)
        probs = self.demand.need_probs(fc.batch_tokens, self.config.horizon_steps)
        return Forecast(model=shape.name, num_layers=shape.num_layers, num_experts=shape.num_experts,
                        horizon_steps=self.config.horizon_steps, created_s=self._created_s,
                        layers=tuple(LayerForecast(layer=layer, probs=tuple(float(x) for x in probs[m]))
                                     for m, layer in enumerate(shape.moe_layers)),
                        kv_reuse_scores=self.kv_reuse.reuse_scores())

    # ---- decide -----------------------------------------------------------------------------------------
    def _split_of(self, plan: Plan) -> Split:
        slots = tuple(plan.expert_bytes_per_layer[layer] // self.config.space.slot_bytes
                      for layer in self.config.shape.moe_layers)
        return Split(slots, plan.kv_blocks_per_tier.get(Tier.GPU, 0))

    def _solve(self, val: Valuation) -> SplitSolution:
        return solve(val.problem, self.config.solver.value)

    def step_next(self) -> Plan | None:
        """The next plan, or None: nothing new was observed, the last plan is neither applied nor rejected yet,
        or the current split is within the hysteresis margin of the best (recorded in `history` as HELD).
        After a rejection the next plan builds on the applied version (its reason names the refused one)."""
        st = self.state
        if not self._fresh or (st.issued_version > st.applied_version() and not st.last_issued_rejected()):
            return None
        self._fresh = False
        cfg, now = self.config, self._now
        if self._quiet():
            now.quiet_in_row += 1
            self.windows_quiet += 1
            return None
        now.quiet_in_row, now.planned = 0, now.window
        fc = self.demand.forecast(self.predictor)
        if not self._prefetch_pays(fc):  # no table goes out: nothing is streamed ahead of a layer
            fc = replace(fc, prefetch_recall=0.0)
        kv_demand = fc.kv_live_blocks
        # Before any plan of ours applies, the split the agent started with (where it reports one) is the one in
        # force: the first plan is weighed against it, its moves priced, as any later plan is.
        cur = now.split if now.split is not None else now.start
        cur_slots, cur_kv = (cur.slots, cur.kv_blocks) if cur else (None, None)
        space = cfg.space
        if cfg.batch_coupling:
            val, sol = solve_coupled(fc, self.cost, space, cur_slots, cur_kv, cfg.horizon_steps, self._solve)
        else:
            val = build_problem(fc, self.cost, space, cur_slots, cur_kv, cfg.horizon_steps, kv_demand)
            sol = self._solve(val)
        cur_choice = None if cur is None else self._choice_of(val, cur)
        cur_ms = None if cur_choice is None else evaluate(val.problem, cur_choice)[0]
        decision = self.hysteresis.decide(val.problem, cur_choice, sol, fc.num_windows)
        # Besides the optimizer's relative margin, a change must save a share of the step itself: near-zero
        # costs move with noise, and any relative gain of nothing is large. Not where the current split breaks
        # the budgets: that switch is owed (its gain reads 0). Phase run 30 (H100, b128 1K 40 GiB) held such a
        # split for 25 windows, 21 ms of predicted stalls a step against 0.3 for the new one.
        floor_ms = cfg.hysteresis * val.step_ms
        keep = decision.action is Action.KEEP or (not decision.forced and cur_ms is not None
                                                  and decision.gain_ms <= floor_ms)
        choice = cur_choice if keep and cur_choice is not None else decision.choice
        new, spare = with_spare_kv(
            Split(slots_of(val, choice), val.kv_blocks[choice[-1]]),
            space)
        retention = self.kv_reuse.retention(self._retention_bound())
        shrunk = 0 if keep or cur is None or decision.forced else sum(
            max(0, a - b) for a, b in zip(cur.slots, new.slots, strict=True))
        if not keep and new == cur:  # the solve's split with its spare HBM as KV is the one in force
            keep, why = True, "the new split, its spare HBM given to KV, is the current one"
        elif shrunk and fc.kv_first_fill and cfg.hold_slots_while_filling and not self._keeps_the_union(cur, new, fc):
            # A filling batch's windows price the experts for a step the batch outgrows (1 decode token a step
            # in the first window, 3-5 a few windows on): 28 of tierplan's plans in H100 phase runs 45-56 took
            # slots from a layer while the KV demand still rose; at b8 the first of them left 19-22 of the next 23
            # decode steps chunked, and at b256 1K 40 GiB one that moved ~290 slots to KV ran 1,241 tok/s against
            # 2,735 for its twin that did not (run 55). Slots move once the demand has settled; a later rise (a
            # workload that grows) is priced on a batch measured, and moves them freely.
            keep, why = True, (f"KV demand still rising: no layer gives up expert slots while the batch first "
                               f"fills (the new split takes {shrunk}, and leaves a layer fewer than a step needs "
                               "at the busiest batch its KV share runs)")
        elif keep:
            why = decision.reason if decision.action is Action.KEEP else \
                f"saves {decision.gain_ms:.3g} ms/step, under {floor_ms:.3g} ms ({cfg.hysteresis:.0%} of the step)"
        if keep and cur is not None:
            reason = explain(cur, cur, now.forecast, fc, val, sol, cur_ms, kv_demand) + self._shadow_note()
            # The split holds; the plan is re-issued for its KV retention, or to withhold or restore the table.
            if self._retention_moved(retention) or self._table_moved(fc):
                return self._issue(cur, fc, f"kept split ({why}): {reason}", val, retention, choice)
            now.held_in_row += 1
            now.history.append(Decision(Outcome.HELD, now.plan.version if now.plan else 0, fc.num_windows,
                                        fc.batch_tokens, kv_demand, cur, cur_ms or 0.0, f"kept ({why}): {reason}",
                                        val.predicted_step_ms(choice), val.shares))
            return None
        reason = explain(cur, new, now.forecast, fc, val, sol, cur_ms, kv_demand,
                         val.kv_blocks[choice[-1]]) + self._shadow_note()
        if spare:
            reason += f"; {spare} more KV blocks from HBM no option valued"
        if cur is not None:
            reason += f"; {decision.reason}"
        return self._issue(new, fc, reason, val, retention, choice)

    def _quiet(self) -> bool:
        """Whether this window need not be planned (`QUIET_AFTER_HELD`'s comment): the split held at the last
        decisions, fewer than `quiet_windows` windows in a row went unplanned, the KV demand is not rising, and
        the window is like the one last planned."""
        now, cfg = self._now, self.config
        return (cfg.quiet_windows > 0 and now.quiet_in_row < cfg.quiet_windows
                and now.held_in_row >= QUIET_AFTER_HELD and now.window is not None and now.planned is not None
                and not self.demand.kv_rising() and now.window.like(now.planned))

    def _keeps_the_union(self, cur: Split, new: Split, fc: DemandForecast) -> bool:
        """Whether every layer `new` takes slots from keeps at least the experts a step needs (the union, on the
        high side) at the busiest batch `new`'s KV share runs. Such a move cannot leave the grown batch's steps
        short of slots, which is what the first-fill hold guards against (its comment in step_next); H100 phase
        run 62, b8 1K 40 GiB: a plan pricing 134 -> 306 KV blocks at 8.49 -> 2.64 ms/step of deferral took 4 of
        623 slots and was held for three windows, the run ending on the start's 2.5 sequences a step against
        static_lru's 4.8. Without routing seen (no union to read) it cannot tell: False."""
        if not fc.union_per_step:
            return False
        space, top_k = self.config.space, self.config.shape.top_k
        unions = unions_high(fc, busiest_batch(fc, new.kv_blocks, space.max_running_seqs), top_k)
        return all(b >= math.ceil(float(u)) for a, b, u in zip(cur.slots, new.slots, unions, strict=True) if b < a)

    def _issue(self, split: Split, fc: DemandForecast, reason: str, val: Valuation, retention: Retention,
               choice: tuple[int, ...]) -> Plan:
        st, now = self.state, self._now
        if st.last_issued_rejected():
            reason = (f"replaces plan {st.issued_version}, rejected by an agent "
                      f"({st.rejected[st.issued_version].value}); {reason}")
        withheld = "" if self._prefetch_pays(fc) else (
            f"prefetch table withheld: {fc.prefetch_precision:.0%} of the agent's prefetches used "
            f"(< {self.config.min_prefetch_precision:.0%})")
        note = "; ".join(n for n in (withheld, retention.describe()) if n)
        if note:  # these clauses are kept whole: a long reason gives way before them
            reason = f"{reason[:MAX_REASON_CHARS - len(note) - 2]}; {note}"
        cost_ms, _, link_bytes = evaluate(val.problem, choice)
        plan = self._plan(split, fc, reason, val, link_bytes, retention.hashes)
        self.state.record_issued(plan)
        now.forecast, now.held_in_row = fc, 0
        now.history.append(Decision(Outcome.ISSUED, plan.version, fc.num_windows, fc.batch_tokens,
                                    fc.kv_live_blocks, split, cost_ms, plan.reason, val.predicted_step_ms(choice),
                                    val.shares))
        return plan

    def _retention_bound(self) -> int:
        """A plan lists at most what its CPU and NVMe tiers could hold (more could never be kept)."""
        cfg = self.config
        return max(0, min(cfg.kv_retention_max, MAX_RETENTION, cfg.kv_cpu_blocks + cfg.kv_nvme_blocks))

    def _retention_moved(self, retention: Retention) -> bool:
        """Whether the keep-first list changed enough since the current plan's to be worth a plan of its own."""
        old = set(self._now.plan.kv_retention) if self._now.plan is not None else set()
        new = set(retention.hashes)
        if not new and not old:
            return False
        return len(old ^ new) >= self.config.kv_retention_refresh * max(len(old), len(new))

    def _shadow_note(self) -> str:
        return "" if self.shadow is None else f"; {self.shadow.describe()}"

    def _choice_of(self, val: Valuation, split: Split) -> tuple[int, ...] | None:
        choice = []
        for m, s in enumerate(split.slots):
            if s not in val.slot_counts[m]:
                return None
            choice.append(val.slot_counts[m].index(s))
        if split.kv_blocks not in val.kv_blocks:
            return None
        return (*choice, val.kv_blocks.index(split.kv_blocks))

    def _prefetch_pays(self, fc: DemandForecast) -> bool:
        return fc.prefetch_precision is None or fc.prefetch_precision >= self.config.min_prefetch_precision

    def _table_moved(self, fc: DemandForecast) -> bool:
        """The plan in force withheld its table and the precision now pays, or the other way round."""
        plan = self._now.plan
        return plan is not None and (plan.local_predictor is None) == self._prefetch_pays(fc) and \
            bool(self.demand.transition_rows(self.config.top_m, self.config.min_prob))

    def _plan(self, split: Split, fc: DemandForecast, reason: str, val: Valuation, link_bytes: int,
              kv_retention: tuple[str, ...] = ()) -> Plan:
        """The plan of `split` (`link_bytes`: what it streams a step at the batch it was valued at)."""
        cfg, shape, space = self.config, self.config.shape, self.config.space
        version = self.state.issued_version + 1
        per_layer = dict(zip(shape.moe_layers, split.slots, strict=True))
        expert_bytes = tuple(per_layer.get(layer, 0) * space.slot_bytes for layer in range(shape.num_layers))
        pinned, evictions = [], []
        # Pins leave room for the union of the busiest step the split may run, not the forecast's batch: sized at
        # a filling batch's 1 token a step, 12 of 25 slots were pinned and 81 of 112 decode steps at 3 tokens ran
        # chunked, where resident's split, no pins, ran none (H100 phase run 54, b8 16K 24 GiB: 62.3 vs 96.6 tok/s).
        unions = unions_high(fc, busiest_batch(fc, split.kv_blocks, space.max_running_seqs), shape.top_k) \
            if fc.union_per_step else ()
        for m, layer in enumerate(shape.moe_layers):
            hot, extra = fc.hot_order[m], self.pins.get(layer, ())
            union = float(unions[m]) if m < len(unions) else 0.0
            num_pin = num_pins(split.slots[m], union, shape.top_k, cfg.pin_frac, len(extra))
            chosen = [*extra, *(e for e in hot if e not in extra)][:num_pin]
            pinned += [ExpertKey(layer=layer, expert=e) for e in chosen]
            evictions.append(LayerEviction(layer=layer, order=tuple(reversed(hot))))  # coldest first
        rows = self.demand.transition_rows(cfg.top_m, cfg.min_prob) if self._prefetch_pays(fc) else []
        predictor = (LocalPredictor(version=max(1, self.demand.table_version), top_m=cfg.top_m,
                                    min_score=cfg.min_score, rows=tuple(rows)) if rows else None)
        # `link_bytes`: its demand loads at the batch it was valued at (a coupled valuation's, not the observed one).
        # No cap (no split leaves the link room, valuation.assemble): the demand loads already take it, nothing is
        # left to stream ahead.
        link_left = 0 if val.link_budget_bytes is None else max(0, val.link_budget_bytes - link_bytes)
        budget = int(min(link_left, 2 * link_bytes)) if predictor is not None else 0
        return Plan(plan_id=f"plan-{version}", version=version, base_version=self.state.applied_version(),
                    created_s=self._created_s, hbm_budget_bytes=space.capacity_bytes,
                    expert_bytes_per_layer=expert_bytes,
                    kv_blocks_per_tier={Tier.GPU: split.kv_blocks, Tier.CPU: cfg.kv_cpu_blocks,
                                        Tier.NVME: cfg.kv_nvme_blocks},
                    pinned_experts=tuple(pinned), eviction_priority=tuple(evictions), reason=reason[:MAX_REASON_CHARS],
                    local_predictor=predictor, prefetch_budget_bytes_per_step=budget, kv_retention=kv_retention)
