"""The split's options and what each is worth: a `DemandForecast` through the `CostModel` into a `SplitProblem`.

Runs in the controller process. One group per MoE layer (resident slot counts; each valued by the stall time
its misses cost at the predicted batch: demand loads in full, plus the part of the prefetched share that does
not fit behind the previous layer's compute, `CostModel.layer_stall_ms`) and one KV group (GPU block counts;
each valued by the sequences it cannot hold: a step that must defer a fraction f of its sequences costs
f / (1 - f) of a step per step served, the throughput it loses; plus the prefix reuses it loses, each a
block of prefill recomputed, under LRU's characteristic time). Capacity is the HBM budget less the dense
weights and the activation workspace; the link budget is a share of what the host->device link moves in one
predicted step; moving from the current placement costs the bytes to load, amortised over the plan's horizon.
An operator's knobs shape the space (a cap and per-layer floors on slots) and weigh the objective (stall vs KV).
Pure arithmetic: it decides nothing (the solver does) and never imports torch, runtime or agent.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy.special import ndtr

from tierplan.controller.costmodel import CostModel
from tierplan.controller.demand import DemandForecast, decode_share, union_sd, with_large_steps
from tierplan.controller.optimizer import least_link_bytes
from tierplan.controller.optimizer.problem import (
    Group,
    GroupKind,
    InfeasibleError,
    Option,
    SplitProblem,
    capacity_units_of,
    units_for_bytes,
)
from tierplan.controller.protocol import Link

if TYPE_CHECKING:  # chunk_whole reads this module's chances; coupling builds on this module
    from tierplan.controller.chunk_whole import ChunkPrice
    from tierplan.controller.coupling import ShareTerms

MAX_DEFERRED = 0.9  # a KV share that defers more than this of the sequences is priced as if it deferred this
LINK_CAP_ROOM = 0.5  # the link caps a plan only where some split streams at most this share of the cap
CLEAR_SDS = 2.0  # a layer holds a decode step's union clear at its mean plus this many spreads (~2 % over)


@dataclass(frozen=True)
class SplitSpace:
    """What the split is made of, in bytes (all known at the composition root)."""

    hbm_budget_bytes: int  # the whole HBM budget of this rank
    dense_bytes: int  # always-resident weights
    workspace_bytes: int  # activations, graphs, allocator slack
    slot_bytes: int  # one expert slot (the slot pool's stride)
    kv_block_bytes: int
    kv_gpu_blocks_max: int  # the GPU KV tier's capacity
    kv_gpu_blocks_min: int  # below this one sequence can no longer run
    max_running_seqs: int | None = None  # the most sequences a step runs (vLLM's max_num_seqs; None: unknown)
    min_slots_per_layer: int = 1
    kv_block_tokens: int = 16
    kv_options: int = 64  # at most this many KV block counts are offered (evenly spaced)
    link_share: float = 0.8  # of the host->device link in one step, the most a plan may stream
    prefetch_recall: float = 0.0  # prior share of a layer's misses the local predictor streams ahead (until measured)
    max_slots_per_layer: int | None = None  # an operator's cap on any layer's resident slots (None: all experts)
    layer_min_slots: tuple[int, ...] = ()  # per MoE layer, a floor above min_slots_per_layer (pinned experts)
    stall_weight: float = 1.0  # objective weight of the predicted expert stall (ms/step)
    kv_weight: float = 1.0  # objective weight of the predicted KV cost (deferral and lost prefix reuse)

    max_units: int = 4096  # capacity states of the knapsack: the unit grows when the budget is large

    @property
    def unit_bytes(self) -> int:
        """gcd(slot, KV block), coarsened so the capacity is at most `max_units` (options round UP to units,
        so a coarse unit only leaves bytes unused, never overspends)."""
        unit = math.gcd(self.slot_bytes, self.kv_block_bytes)
        return max(unit, -(-self.capacity_bytes // self.max_units))

    @property
    def capacity_bytes(self) -> int:
        """Bytes for expert slots and GPU KV blocks together (what a plan's hbm_budget_bytes promises)."""
        return self.hbm_budget_bytes - self.dense_bytes - self.workspace_bytes

    @property
    def capacity_units(self) -> int:
        """`capacity_bytes` in whole `unit_bytes`: the knapsack's capacity."""
        return capacity_units_of(self.hbm_budget_bytes, self.dense_bytes, self.workspace_bytes, self.unit_bytes)


@dataclass(frozen=True)
class Valuation:
    problem: SplitProblem
    slot_counts: tuple[tuple[int, ...], ...]  # [M][options] resident slots of each layer option
    kv_blocks: tuple[int, ...]  # GPU KV blocks of each KV option
    step_ms: float  # the step's compute at the predicted batch (no stall)
    stall_ms: tuple[tuple[float, ...], ...] = ()  # [M][options] unweighted predicted stall of each layer option
    # A coupled valuation (coupling.py), per KV option: the running batch it lets through, and the step it
    # predicts there (compute ms with any flat chunked step, stalls [M][options]); empty for the separable one
    # (step_ms / chunk_flat_step_ms / stall_ms hold).
    kv_batch: tuple[float, ...] = ()
    kv_steps: tuple[tuple[float, tuple[tuple[float, ...], ...]], ...] = ()
    plan_link_budget_bytes: int | None = None  # the winner's own link budget, where the merged problem's differs
    # The price of a decode step run chunked off its graphs (`chunk_pricing`): charged per layer option as its
    # chance (the experts' costs hold it), or flat on the KV share (weighted ms/step; none charged per layer).
    chunk_charged_per_layer: bool = False
    chunk_flat_ms: float = 0.0
    chunk_flat_step_ms: float = 0.0  # that flat price in the step itself (unweighted, per decode-weighted step)
    chunk_price: ChunkPrice | None = None  # a coupled share's: how a chosen split's chunked step is mended
    kv_chunk_mend_ms: tuple[float, ...] = ()  # a merged coupled valuation's, per KV option: the mend it carries
    shares: tuple[ShareTerms, ...] = ()  # a coupled valuation's: every share solved exactly (coupling.ShareTerms)

    @property
    def link_budget_bytes(self) -> int | None:
        """What the chosen split may stream a step (what a plan's prefetch budget is left from)."""
        if self.plan_link_budget_bytes is not None:
            return self.plan_link_budget_bytes
        return self.problem.link_budget_bytes_per_step

    def predicted_step_ms(self, choice: tuple[int, ...]) -> float:
        """The cost model's step time of a split: compute at its batch (with the chunked step where its share
        leaves no room to clear the decode unions) plus the layers' unweighted stalls (each layer's chance of
        chunking the step included)."""
        if self.kv_steps:
            step, stalls = self.kv_steps[choice[-1]]
        else:
            step, stalls = self.step_ms + self.chunk_flat_step_ms, self.stall_ms
        return step + sum(stalls[m][j] for m, j in enumerate(choice[:-1]))


def slot_range(space: SplitSpace, m: int, num_experts: int) -> tuple[int, int]:
    """The slot counts MoE layer `m` may take, inclusive: the floor (global, or the layer's pins) up to the cap."""
    floor = max(space.min_slots_per_layer, space.layer_min_slots[m] if m < len(space.layer_min_slots) else 0)
    lo = min(floor, num_experts)
    cap = num_experts if space.max_slots_per_layer is None else min(num_experts, space.max_slots_per_layer)
    return lo, max(lo, cap)


def _evenly(lo: int, hi: int, num: int) -> set[int]:
    if hi - lo + 1 <= num:
        return set(range(lo, hi + 1))
    step = (hi - lo) / (num - 1)
    return {lo + round(i * step) for i in range(num)} | {hi}


def kv_grid(space: SplitSpace, demand_blocks: float = 0.0, current: int | None = None) -> list[int]:
    """The GPU KV block counts offered: `kv_options` evenly over the tier's range, as many again up to twice the
    demand (where each block runs or defers a sequence: a budget of 14K blocks and a demand of 500 would
    otherwise leave 220 blocks between options), and the current share (hysteresis prices the split in force)."""
    lo, hi = space.kv_gpu_blocks_min, space.kv_gpu_blocks_max
    out = _evenly(lo, hi, space.kv_options)
    top = min(hi, math.ceil(2 * demand_blocks))
    if top > lo:
        out |= _evenly(lo, top, space.kv_options)
    if current is not None and lo <= current <= hi:
        out.add(current)
    return sorted(out)


def kv_cost_ms(live_blocks: float, gpu_blocks: int, step_ms: float) -> float:
    """Throughput lost per step when `gpu_blocks` cannot hold the `live_blocks` the sequences want."""
    if live_blocks <= 0 or gpu_blocks >= live_blocks:
        return 0.0
    deferred = min(MAX_DEFERRED, (live_blocks - gpu_blocks) / live_blocks)
    return step_ms * deferred / (1.0 - deferred)


def layer_stall_ms(cost: CostModel, num_missed: np.ndarray, num_streamed: np.ndarray, batch_tokens: float,
                   step_ms: float) -> np.ndarray:
    """`CostModel.layer_stall_ms` over arrays of options (one compute estimate for all of them): demand loads
    in full (their transfer and the host's `moe_ms_per_miss`), plus the streamed part that does not fit behind
    one layer's compute."""
    window_ms = step_ms / cost.shape.num_layers
    one_ms = cost.transfer_ms(Link.H2D, cost.shape.expert_bytes, 1)  # linear in records and bytes
    return (np.maximum(0.0, num_streamed * one_ms - window_ms)
            + num_missed * (one_ms + cost.compute.moe_ms_per_miss))


def over_slots_prob(counts: np.ndarray, union: np.ndarray | float, sd: np.ndarray | float, num_experts: int
                    ) -> np.ndarray:
    """P(a decode step's union of experts exceeds the slots) per option: the union normal around its mean `union`
    with spread `sd` (a step function where sd is 0), with continuity; 0 with every expert resident."""
    counts = np.asarray(counts, dtype=float)
    gap = counts + 0.5 - np.asarray(union, dtype=float)
    sd = np.asarray(sd, dtype=float)
    z = np.where(sd > 0, gap / np.maximum(sd, 1e-9), np.where(gap > 0, np.inf, -np.inf))
    return np.where(counts >= num_experts, 0.0, ndtr(-z))


def option_stall_ms(cost: CostModel, misses: np.ndarray, union: np.ndarray | float, counts: np.ndarray,
                    recall: float, step_ms: float, decode_union: np.ndarray | float | None = None,
                    union_sd: np.ndarray | float = 0.0, decode_share: float = 1.0, num_experts: int = 0
                    ) -> np.ndarray:
    """Each option's unweighted stall: `layer_stall_ms` of its `misses` (the prefetched `recall` share streamed),
    plus, where its slot count s is below the `union` u of experts a step needs, the share 1 - s/u of those loads
    once more. The engine then computes the layer in chunks of s, one after another: each chunk after the first
    makes room by evicting what the one before it read, so the host waits for that compute before it issues the
    chunk's loads, and nothing overlaps them. A miss curve below the union is nearly flat, so without this the
    solver starves whole layers to pay for the rest. H200 phase run 06's diagnostic (`bench/results/
    phase_h200.md`): three layers at 8 slots against a ~22-expert union cost ~2.6 ms a layer-step beyond the same
    misses at 34-48 slots; this prices it at 0.64 of their ~3.8 ms of loads, 2.4 ms. And the step leaves its
    graphs (`CostModel`'s `chunked_step_ms`, once a step, for the `decode_share` of steps that are decodes): each
    layer adds that times the chance a decode step's union, `decode_union` give or take `union_sd`, outruns its
    slots (none where `decode_union` is None; `num_experts`: the layer's, none over them)."""
    stall = layer_stall_ms(cost, (1 - recall) * misses, recall * misses, 0.0, step_ms)
    chunked = layer_stall_ms(cost, misses, np.zeros_like(misses), 0.0, step_ms)
    u = np.maximum(np.asarray(union, dtype=float), 1e-9)
    out = stall + chunked * np.clip(1.0 - counts / u, 0.0, 1.0)
    if cost.compute.chunked_step_ms > 0 and decode_union is not None:
        # The step pays `chunked_step_ms` once where any layer's union outruns its slots: each layer is charged
        # its own chance of it (a union bound, tight where the split keeps every chance small, which is where
        # the choice is whether to; where chunking is near certain, each layer's charge is flat in its slots).
        out = out + cost.compute.chunked_step_ms * decode_share * over_slots_prob(counts, decode_union, union_sd,
                                                                                 num_experts)
    return out


def prefix_hit_share(forecast: DemandForecast, gpu_blocks: int) -> float:
    """Share of the prefix reuses an LRU GPU share of `gpu_blocks` keeps: a block reused after `age` hits while
    fewer than `gpu_blocks` others were touched since (characteristic time gpu_blocks / touch rate)."""
    ages = forecast.reuse_ages_s
    if not ages or forecast.touch_blocks_per_s <= 0:
        return 0.0
    horizon_s = gpu_blocks / forecast.touch_blocks_per_s
    return bisect.bisect_right(ages, horizon_s) / len(ages)


@dataclass(frozen=True)
class Decode:
    """A decode step at the running batch, what the price of leaving the graphs reads: each MoE layer's union
    and its spread [M], and the share of steps that are decodes (`decode_step`)."""

    union: tuple[float, ...]
    union_sd: tuple[float, ...]
    share: float

    def of_layer(self, m: int) -> dict[str, float]:
        """`layer_options`' arguments for MoE layer `m`."""
        return {"decode_union": self.union[m], "union_sd": self.union_sd[m], "decode_share": self.share}

    def of_layers(self) -> dict[str, Any]:
        """`option_stall_ms`' arguments for one option of every MoE layer ([M] arrays)."""
        return {"decode_union": np.asarray(self.union), "union_sd": np.asarray(self.union_sd),
                "decode_share": self.share}


def decode_step(fc: DemandForecast, batch: float, curves: tuple[tuple[float, ...], ...] | np.ndarray,
                share_batch: float | None = None) -> Decode:
    """The decode step at `batch` tokens whose per-layer loads with no slot, `curves[m][0]`, are its unions (the
    decode curves, before `with_large_steps` mixes the prefills in); its share of the steps at `share_batch`
    (default: `batch`)."""
    return Decode(tuple(float(c[0]) for c in curves), tuple(float(x) for x in union_sd(fc, batch)),
                  decode_share(fc, batch if share_batch is None else share_batch))


def chunk_pricing(decode: Decode, cost: CostModel, space: SplitSpace, num_experts: int, expert_units: int
                  ) -> tuple[Decode | None, float]:
    """How the chunked step is priced where the experts have `expert_units` of HBM: (the decode step each layer is
    charged its chance against, the flat ms a step). Where every layer can hold its decode union clear (its union
    plus CLEAR_SDS spreads) within them, each layer is charged its own chance (a union bound, tight near a split
    that clears them all); where they cannot, the step chunks whatever the split, so it pays once, flat, and no
    layer is charged for slots that would not spare it (the per-layer sum would price it once a layer)."""
    if cost.compute.chunked_step_ms <= 0:
        return None, 0.0
    unavoidable = None, cost.compute.chunked_step_ms * decode.share
    need = 0
    for m, (u, sd) in enumerate(zip(decode.union, decode.union_sd, strict=True)):
        lo, hi = slot_range(space, m, num_experts)
        clear = min(num_experts, math.ceil(u + CLEAR_SDS * sd))
        if clear > hi:  # an operator's cap keeps this layer under its union
            return unavoidable
        need += units_for_bytes(max(lo, clear) * space.slot_bytes, space.unit_bytes)
    return (decode, 0.0) if need <= expert_units else unavoidable


def layer_options(curve: tuple[float, ...] | np.ndarray, cost: CostModel, space: SplitSpace, m: int, step_ms: float,
                  recall: float, union: float | None = None, decode_union: float | None = None,
                  union_sd: float = 0.0, decode_share: float = 1.0
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MoE layer `m`'s options from its miss curve [E + 1]: (slot counts, their HBM units, loads per step, the
    unweighted stall each costs), each [J]: what the exact problem's groups and the coupled screen both price.
    `union`: the step's union the chunking price reads (default: the curve's loads with no slot, curve[0]);
    `decode_union`, `union_sd` and `decode_share`: a decode step's union, its spread and the decode steps' share,
    for the price of leaving the graphs (`option_stall_ms`)."""
    num_experts = len(curve) - 1
    lo, hi = slot_range(space, m, num_experts)
    counts = np.arange(lo, hi + 1)
    units = -(-(counts * space.slot_bytes) // space.unit_bytes)  # units_for_bytes, vectorised
    misses = np.asarray(curve)[counts]
    u = float(curve[0]) if union is None else union
    return counts, units, misses, option_stall_ms(cost, misses, u, counts, recall, step_ms, decode_union, union_sd,
                                                  decode_share, num_experts)


def expert_groups(misses_per_step: tuple[tuple[float, ...], ...] | np.ndarray, cost: CostModel, space: SplitSpace,
                  current_slots: tuple[int, ...] | None, step_ms: float, recall: float, scale: float = 1.0,
                  decode: Decode | None = None) -> tuple[list[Group], list[tuple[int, ...]], list[tuple[float, ...]]]:
    """One group per MoE layer from its miss curve: (groups, slot counts [M][J], unweighted stalls [M][J]).
    `scale` multiplies the groups' costs (a coupled valuation's steps per token served), not the stalls;
    `decode`: the decode steps the price of leaving the graphs reads (none: not priced)."""
    groups, slot_counts, stalls = [], [], []
    for m, curve in enumerate(misses_per_step):
        counts, units, misses, stall = layer_options(curve, cost, space, m, step_ms, recall,
                                                     **(decode.of_layer(m) if decode is not None else {}))
        labels = [f"{s} slots" for s in counts]
        cur = (int(np.flatnonzero(counts == current_slots[m])[0])
               if current_slots is not None and current_slots[m] in counts else None)
        groups.append(Group.from_arrays(f"MoE layer {m}", units, space.stall_weight * scale * stall, np.rint(
            misses * space.slot_bytes).astype(np.int64), labels, cur, GroupKind.EXPERTS))
        slot_counts.append(tuple(int(s) for s in counts))
        stalls.append(tuple(float(x) for x in stall))
    return groups, slot_counts, stalls


def recompute_ms(cost: CostModel, space: SplitSpace, batch: float, context_tokens: float, step_ms: float) -> float:
    """A prefix reuse the share loses is recomputed: one block of prefill per lost reuse."""
    return max(0.0, cost.compute_ms(batch + space.kv_block_tokens, context_tokens) - step_ms)


def landing_blocks(fc: DemandForecast) -> float:
    """The GPU KV blocks the running sequences hold when a plan made now lands (`DemandForecast`)."""
    return fc.kv_gpu_used_blocks if fc.kv_gpu_landing_blocks is None else fc.kv_gpu_landing_blocks


def swap_ms(cost: CostModel, space: SplitSpace, used_blocks: float, gpu_blocks: int, horizon_steps: int) -> float:
    """A GPU KV share below the `used_blocks` the running sequences hold there swaps the excess out (HBM -> host)
    and, as their sequences run again, back in: both transfers once, block by block, amortised over the steps a
    plan is expected to hold (as migration is), whether or not a plan is in force yet. What such a cut costs: in
    H200 run 37 (b32 16K 56 GiB) six decode steps fetching 512-3,457 blocks back took 3.2 s of the 10.2 s
    measured, 0.14-0.7 ms a block; the start's larger share had kept admitting sequences until the first plan
    landed, so the blocks to read are those held then (`landing_blocks`)."""
    n = math.ceil(max(0.0, used_blocks - gpu_blocks))
    if n == 0:
        return 0.0
    num_bytes = n * space.kv_block_bytes
    return (cost.transfer_ms(Link.D2H, num_bytes, n) + cost.transfer_ms(Link.H2D, num_bytes, n)) / max(1, horizon_steps)


def migration_ms_per_unit(cost: CostModel, space: SplitSpace, horizon_steps: int) -> float:
    """Loading one unit of HBM over the host link, amortised over the steps a plan is expected to hold."""
    unit = space.unit_bytes
    return cost.transfer_ms(Link.H2D, unit, unit / space.slot_bytes) / max(1, horizon_steps)


def assemble(groups: list[Group], cost: CostModel, space: SplitSpace, step_ms: float,
             horizon_steps: int) -> SplitProblem:
    """The problem over `groups` (the KV group last): the HBM capacity, the link budget of one predicted step
    (none where no split within the capacity streams within LINK_CAP_ROOM of it), migration amortised over the
    horizon."""
    unit = space.unit_bytes
    capacity = space.capacity_units
    bytes_per_s = cost.link_bytes_per_s(Link.H2D)  # inf when the fit finds no per-byte cost: no link budget
    link_budget = (int(space.link_share * bytes_per_s * max(step_ms, 1e-3) / 1e3) if math.isfinite(bytes_per_s)
                   else None)
    problem = SplitProblem(tuple(groups), capacity, unit,
                           migration_ms_per_unit=migration_ms_per_unit(cost, space, horizon_steps))
    if link_budget is not None:
        # The link caps what a plan streams where the cap leaves splits to choose among: some split within the
        # HBM capacity streams at most LINK_CAP_ROOM of it. The least is over whole splits: each group's own
        # least (all its slots) need not fit together. Elsewhere the cap is left off and flagged
        # (`link_budget_is_floor`): the stalls the objective prices rank the splits. A cap at or near that least
        # admits only the splits streaming least, and where a prefill needs every expert a layer has, those pile
        # slots on some layers and starve the rest (H100 phase run 35, b8 1K 24 GiB: 66 slots in five layers,
        # 8 in two, "host link budget binding", its decode steps chunked; reproduced on the CPU at its sizes,
        # where the objective preferred 49 a layer; a review found the pile at caps up to 1.3x the least, an
        # even split from 1.45x).
        try:
            floor = least_link_bytes(problem)
        except InfeasibleError:  # no split fits the capacity at all: the solver says so, naming the cause
            floor = 0
        unmet = floor > LINK_CAP_ROOM * link_budget
        problem = dataclasses.replace(problem, link_budget_bytes_per_step=None if unmet else link_budget,
                                      link_budget_is_floor=unmet)
    return problem


def build_problem(forecast: DemandForecast, cost: CostModel, space: SplitSpace,
                  current_slots: tuple[int, ...] | None, current_kv: int | None, horizon_steps: int,
                  kv_demand_blocks: float) -> Valuation:
    """The separable split: every layer priced at the observed batch, KV by the sequences it defers (the
    baselines' allocators solve this; coupling.py ties the batch to the KV share)."""
    unit = space.unit_bytes
    batch = forecast.batch_tokens
    context_tokens = forecast.kv_gpu_used_blocks * space.kv_block_tokens  # what the step's attention reads
    step_ms = cost.compute_ms(batch, context_tokens)
    r = space.prefetch_recall if forecast.prefetch_recall is None else forecast.prefetch_recall
    # The curve describes its bucket's batch where measured: the union's spread at that batch.
    decode = decode_step(forecast, forecast.curve_batch or batch, forecast.misses_per_step, batch)
    # Judged where the experts have the most room: beside the least KV share.
    room = space.capacity_units - units_for_bytes(space.kv_gpu_blocks_min * space.kv_block_bytes, unit)
    charged, flat_ms = chunk_pricing(decode, cost, space, len(forecast.misses_per_step[0]) - 1, room)
    groups, slot_counts, stalls = expert_groups(with_large_steps(forecast.misses_per_step, forecast), cost, space,
                                                current_slots, step_ms, r, decode=charged)
    grid = kv_grid(space, kv_demand_blocks, current_kv)
    redo_ms = recompute_ms(cost, space, batch, context_tokens, step_ms)
    best_hits = prefix_hit_share(forecast, grid[-1])
    kv_opts = tuple(Option(units=units_for_bytes(g * space.kv_block_bytes, unit),
                           cost_ms=space.kv_weight * (kv_cost_ms(kv_demand_blocks, g, step_ms) + forecast.reuse_per_step
                                                      * redo_ms * (best_hits - prefix_hit_share(forecast, g))
                                                      + swap_ms(cost, space, landing_blocks(forecast), g,
                                                                horizon_steps))
                           + space.stall_weight * flat_ms,
                           label=f"{g} KV blocks") for g in grid)
    groups.append(Group("GPU KV", kv_opts, grid.index(current_kv) if current_kv in grid else None, GroupKind.KV))
    problem = assemble(groups, cost, space, step_ms, horizon_steps)
    return Valuation(problem, tuple(slot_counts), tuple(grid), step_ms, tuple(stalls),
                     chunk_charged_per_layer=charged is not None, chunk_flat_ms=space.stall_weight * flat_ms,
                     chunk_flat_step_ms=flat_ms)
