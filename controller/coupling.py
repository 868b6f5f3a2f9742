"""The split with the running batch tied to the KV share: the experts solved per candidate GPU KV share.

Runs in the controller process; pure arithmetic over the forecast and the cost model (never imports torch,
runtime or agent; decides nothing itself: `solve_fn` does). The separable split (valuation.build_problem)
prices every layer's misses at the batch it observed, while the KV share decides how many sequences run: a
share that defers sequences shrinks the batch and with it the union of experts a step loads, one that admits
more grows both. Neither is priced right without the other, so each candidate share g is valued on its own:
- the share of the sequences that want to run (held, swapped and queued KV) that g holds, `served(g)`, and the
  running batch it lets through: the observed tokens per step scaled by the blocks g holds over those in use;
- the layers' miss curves at that batch, linear in log(batch) between the two nearest anchors: the measured
  LRU curves of the tracked batch buckets with enough steps, the forecast's own curves at the batch they
  describe, and elsewhere the activation-frequency curves corrected per slot count by measured / frequency
  there (the cache's temporal locality, which the frequency model lacks);
- the objective, in ms per step of the whole demand: the step at that batch (compute + stalls) / served(g),
  less the compute at the full batch (a share that defers nothing costs its stalls, as in the separable split),
  plus the prefix reuses the share loses and the KV blocks it must move. Inside a share the knapsack charges each
  layer its own chance of running a decode step chunked off the graphs; across shares a solved split pays it once,
  on the whole split over the batch's swing (chunk_whole.py).
Which shares: a screen prices every share of the grid from one capacity table of the experts per band (the
batches between two anchors): the split best at the band's middle share, at the capacity a share leaves,
priced at that share's own batch (a split that fits; an estimate, not a bound: the split is the knapsack's, then
priced whole). The objective jumps where a layer's slot count changes, so no local search is safe. Then the
best-screened share of each of the best `SCREEN_BANDS` bands and the current share are solved exactly, each with
its link budget. The winner is handed on as one `Valuation` whose KV group holds the winning share and the
current one, priced so that `evaluate` of either whole split gives its own objective (and the current split its own
link verdict): hysteresis and the plan's reason compare the two.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tierplan.controller.chunk_whole import ChunkPrice, swing_at, whole_chunk_ms
from tierplan.controller.costmodel import CostModel
from tierplan.controller.demand import BATCH_BUCKETS, DemandForecast, decode_share, frequency_curve, with_large_steps
from tierplan.controller.optimizer.problem import (
    Constraint,
    Group,
    GroupArrays,
    GroupKind,
    InfeasibleError,
    Option,
    SplitSolution,
    evaluate,
    make_solution,
    migration_ms,
    units_for_bytes,
)
from tierplan.controller.optimizer.tables import Layout, at_capacity, backtrack, tables_of
from tierplan.controller.valuation import (
    MAX_DEFERRED,
    Decode,
    SplitSpace,
    Valuation,
    assemble,
    chunk_pricing,
    decode_step,
    expert_groups,
    kv_grid,
    landing_blocks,
    layer_options,
    migration_ms_per_unit,
    option_stall_ms,
    prefix_hit_share,
    recompute_ms,
    slot_range,
    swap_ms,
)

SCREEN_BANDS = 2  # bands whose best-screened share is solved exactly after the screen (besides the current one)
RATIO_CLIP = (0.25, 4.0)  # measured / frequency correction of a rescaled curve, per slot count


@dataclass(frozen=True)
class ShareTerms:
    """One KV share the coupled search solved exactly, term by term (ms per step of the whole demand, weighted as
    the objective weighs them, unless named a step): what a plan's record keeps of every share it weighed, so that
    a move between shares can be traced offline to the term that made it (H100 phase run 54, b8 16K 24 GiB: a plan
    moved from 2,115 to 3,517 KV blocks and no row said which term paid for it)."""

    kv_blocks: int
    batch_tokens: float  # the running batch the share lets through
    served: float  # the share of the wanted KV it holds and runs
    compute_ms: float  # the step's compute at that batch (unweighted)
    expert_slots: int  # the solved split's slots, all layers (0: no split fits)
    experts_ms: float  # the solved split's expert options: stalls / served, per-layer chunk charges, migration
    kv_ms: float  # the KV option: sequences deferred or swapped, reuse lost, a flat chunked step
    kv_move_ms: float  # moving the GPU KV share there
    chunk_mend_ms: float  # the chunked step priced whole on the solved split, less the knapsack's charges
    objective_ms: float  # the sum: what the shares are ranked by
    screened_ms: float  # the screen's estimate of the objective, which picked the share to solve
    step_ms: float  # the predicted step at that batch (compute, stalls, chunked step priced whole; unweighted)

    def as_row(self) -> dict[str, float | int | None]:
        """The terms as a JSON row: floats to 3 decimals, None where not finite (no split fits, not screened)."""
        return {k: (round(v, 3) if math.isfinite(v) else None) if isinstance(v, float) else v
                for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class AtShare:
    """One KV share's valuation: its problem (the KV group one option), batch, served share, solution."""

    kv_blocks: int
    batch_tokens: float
    served: float
    val: Valuation
    sol: SplitSolution | None  # None: no split fits with this share
    kv_move_ms: float  # migrating the KV group to this share, per step (the single-option group has no current)
    why_not: str = ""
    chunk_mend_ms: float = 0.0  # the solved split's chunked step priced whole, less the knapsack's charge (weighted)
    screened_ms: float = float("nan")  # the screen's estimate (nan: not screened)

    @property
    def objective_ms(self) -> float:
        return float("inf") if self.sol is None else self.sol.objective_ms + self.kv_move_ms + self.chunk_mend_ms

    def terms(self) -> ShareTerms:
        """What this share's objective is made of, for the plan's record (`ShareTerms`)."""
        if self.sol is None:
            return ShareTerms(self.kv_blocks, self.batch_tokens, self.served, self.val.step_ms, 0, 0.0, 0.0,
                              self.kv_move_ms, 0.0, float("inf"), self.screened_ms, 0.0)
        kv_ms = self.val.problem.groups[-1].options[0].cost_ms
        slots = slots_of(self.val, self.sol.choice)
        return ShareTerms(self.kv_blocks, self.batch_tokens, self.served, self.val.step_ms, sum(slots),
                          self.sol.objective_ms - kv_ms, kv_ms, self.kv_move_ms, self.chunk_mend_ms,
                          self.objective_ms, self.screened_ms,
                          self.val.predicted_step_ms(self.sol.choice) + chunk_mend_ms(self.val, slots))


def runnable_blocks(fc: DemandForecast, max_running_seqs: int | None) -> float:
    """The GPU KV blocks the most sequences the engine runs at once (`max_running_seqs`, vLLM's max_num_seqs)
    hold, at the blocks per running sequence seen; inf where that is unknown. Blocks past it run no more
    sequences: the queue behind a full batch waits for a sequence to finish, not for KV. Without the cap a share
    three times the one in force read as three times the batch, past the engine's batch of 8 (H100 phase run
    49, b8 16K 24 GiB: 16.6 tokens a step priced at 8 expert slots a layer, measured 5-7 at 12-20 ms a token),
    and the plans swung between that share and a third of it six times in 134 steps."""
    if max_running_seqs is None or fc.kv_gpu_used_blocks <= 0 or fc.batch_tokens <= 0:
        return float("inf")
    # Never below the blocks in use: a batch over the cap is not sequences (prompt chunks in an older agent's
    # step tokens, several tokens a sequence), and the share in force must not read as deferring its own demand.
    return fc.kv_gpu_used_blocks * max(1.0, max_running_seqs / fc.batch_tokens)


def served_share(fc: DemandForecast, gpu_blocks: float, max_running_seqs: int | None = None) -> float:
    """Share of the KV the sequences want (held in every tier plus queued) that `gpu_blocks` hold and run:
    no more than `runnable_blocks` count."""
    want = max(fc.kv_live_blocks, fc.kv_gpu_used_blocks)
    if want <= 0:
        return 1.0
    return max(1.0 - MAX_DEFERRED, min(1.0, min(gpu_blocks, runnable_blocks(fc, max_running_seqs)) / want))


def running_batch(fc: DemandForecast, gpu_blocks: float, max_running_seqs: int | None = None) -> float:
    """Tokens per step with `gpu_blocks` of GPU KV: the observed batch per block in use, times the blocks held
    (those `runnable_blocks` count)."""
    used = fc.kv_gpu_used_blocks
    if used <= 0:  # nothing in use to scale from: the batch stays as observed
        return fc.batch_tokens
    return max(1.0, fc.batch_tokens / served_share(fc, used, max_running_seqs)
               * served_share(fc, gpu_blocks, max_running_seqs))


def _observed_at(fc: DemandForecast) -> float:
    """The batch the forecast's own curves describe (a measured bucket's size, else the observed batch)."""
    return fc.curve_batch if fc.curve_batch > 0 else fc.batch_tokens


def _rescaled(fc: DemandForecast, batch: float) -> tuple[tuple[float, ...], ...]:
    """The activation-frequency curves at `batch`, corrected per slot count by measured / frequency at the
    batch the forecast's curves describe (the cache's temporal locality, which independent tokens lack)."""
    out = []
    for observed, probs in zip(fc.misses_per_step, fc.token_probs, strict=True):
        p = np.asarray(probs)
        at_obs, union_obs = frequency_curve(p, _observed_at(fc))
        at_b, union_b = frequency_curve(p, batch)
        obs = np.asarray(observed)
        ratio = np.clip(obs / np.maximum(at_obs, 1e-9), *RATIO_CLIP)
        # Where the frequencies see no miss at all (experts never routed yet), scale by the union's growth.
        grown = obs * union_b / max(union_obs, 1e-9)
        out.append(tuple(float(x) for x in np.where(at_obs > 1e-9, at_b * ratio, grown)))
    return tuple(out)


def _anchor(fc: DemandForecast, batch: float) -> tuple[tuple[tuple[float, ...], ...], str]:
    if batch == _observed_at(fc) or (not fc.token_probs and not fc.bucket_curves):
        return fc.misses_per_step, fc.curve_source
    for bc in fc.bucket_curves:
        if bc.bucket == batch:
            return bc.misses_per_step, f"measured LRU curves at B~{bc.bucket}"
    if not fc.token_probs:
        return fc.misses_per_step, fc.curve_source
    return _rescaled(fc, batch), f"frequency curves at B~{batch:g} corrected by {fc.curve_source}"


def _band(fc: DemandForecast, batch: float) -> tuple[float, float]:
    """The two curve anchors (the tracked buckets and the batch the forecast's curves describe) `batch` lies
    between."""
    points = sorted({*BATCH_BUCKETS, _observed_at(fc)})
    return (max((p for p in points if p <= batch), default=points[0]),
            min((p for p in points if p >= batch), default=points[-1]))


def _log_weight(batch: float, lo: float, hi: float) -> float:
    """Where `batch` lies between the anchors `lo` and `hi`, linear in log(batch): 0 at or below `lo`, 1 at `hi`."""
    return 0.0 if hi == lo or batch <= lo else math.log(batch / lo) / math.log(hi / lo)


def curves_at(fc: DemandForecast, batch: float) -> tuple[tuple[tuple[float, ...], ...], str]:
    """[M][E + 1] expected loads per step at `batch` tokens per step, and where they come from: between the two
    nearest anchors (`_band`), linear in log(batch). A bucket's curve holds for
    steps up to 1.4x off its size, so reading it whole would price a batch at the top of one bucket as one at
    its middle (with the trace's curves: 40 % cheaper than the next bucket), a bias toward those edges."""
    lo, hi = _band(fc, batch)
    low, why_low = _anchor(fc, lo)
    if lo == hi or batch <= lo:
        return low, why_low
    high, why_high = _anchor(fc, hi)
    w = _log_weight(batch, lo, hi)
    mixed = tuple(tuple(float((1 - w) * x + w * y) for x, y in zip(a, b, strict=True))
                  for a, b in zip(low, high, strict=True))
    return mixed, f"{why_low} and {why_high}, at B={batch:.1f} between them"


def busiest_batch(fc: DemandForecast, gpu_blocks: float, max_running_seqs: int | None = None) -> float:
    """The most decode tokens a step may carry under a share of `gpu_blocks`: the engine's cap on running
    sequences where it is known (a share that holds fewer now may hold more once short sequences replace long
    ones), else the share's running batch at the top of the decode steps' swing; never below the batch seen."""
    if max_running_seqs is not None:
        return float(max(max_running_seqs, fc.batch_tokens))
    top = max(fc.decode_batch_ratios, default=1.0)
    return max(fc.batch_tokens, running_batch(fc, gpu_blocks) * max(1.0, top))


@dataclass(frozen=True)
class _Terms:
    """What a KV share does to the step, before any expert split: served share, batch, compute, KV cost."""

    served: float
    batch_tokens: float
    step_ms: float
    kv_ms: float


def _terms(fc: DemandForecast, cost: CostModel, space: SplitSpace, gpu_blocks: int, best_hits: float,
           horizon_steps: int) -> _Terms:
    cap = space.max_running_seqs
    served = served_share(fc, gpu_blocks, cap)
    batch = running_batch(fc, gpu_blocks, cap)
    full = running_batch(fc, max(fc.kv_live_blocks, fc.kv_gpu_used_blocks, gpu_blocks), cap)
    per_token_ctx = fc.kv_gpu_used_blocks * space.kv_block_tokens / max(fc.batch_tokens, 1e-9)
    step_ms = cost.compute_ms(batch, per_token_ctx * batch)
    full_ms = cost.compute_ms(full, per_token_ctx * full)
    lost_reuse = fc.reuse_per_step * recompute_ms(cost, space, batch, per_token_ctx * batch, step_ms) * (
        best_hits - prefix_hit_share(fc, gpu_blocks))
    swapped = swap_ms(cost, space, landing_blocks(fc), gpu_blocks, horizon_steps)
    return _Terms(served, batch, step_ms,
                  space.kv_weight * (max(0.0, step_ms / served - full_ms) + lost_reuse + swapped))


def value_share(fc: DemandForecast, cost: CostModel, space: SplitSpace, current_slots: tuple[int, ...] | None,
                current_kv: int | None, horizon_steps: int, gpu_blocks: int) -> tuple[Valuation, float, float, float]:
    """The problem with the GPU KV share fixed at `gpu_blocks`: (valuation, batch, served share, KV move ms)."""
    unit = space.unit_bytes
    t = _terms(fc, cost, space, gpu_blocks, prefix_hit_share(fc, space.kv_gpu_blocks_max), horizon_steps)
    decodes = curves_at(fc, t.batch_tokens)[0]
    misses = with_large_steps(decodes, fc, t.batch_tokens)
    r = space.prefetch_recall if fc.prefetch_recall is None else fc.prefetch_recall
    kv_units = units_for_bytes(gpu_blocks * space.kv_block_bytes, unit)
    charged, flat_ms = chunk_pricing(decode_step(fc, t.batch_tokens, decodes), cost, space, len(decodes[0]) - 1,
                                     space.capacity_units - kv_units)
    groups, slot_counts, stalls = expert_groups(misses, cost, space, current_slots, t.step_ms, r,
                                                scale=1.0 / t.served, decode=charged)
    # A share that leaves the experts no room to clear the decode unions runs every decode step chunked: its
    # cost, per step served, rides on the share.
    groups.append(Group("GPU KV", (Option(kv_units, t.kv_ms + space.stall_weight * flat_ms / t.served,
                                          label=f"{gpu_blocks} KV blocks"),), None, GroupKind.KV))
    problem = assemble(groups, cost, space, t.step_ms, horizon_steps)
    move_ms = _kv_move_ms(space, problem.migration_ms_per_unit, gpu_blocks, current_kv)
    # No chunked step learned: nothing to mend (the knapsack charged none either).
    price = None if cost.compute.chunked_step_ms <= 0 else ChunkPrice(
        cost.compute.chunked_step_ms, charged, flat_ms,
        swing_at(fc, t.batch_tokens, np.asarray(decodes)[:, 0], decode_share(fc, t.batch_tokens)), len(decodes[0]) - 1)
    val = Valuation(problem, tuple(slot_counts), (gpu_blocks,), t.step_ms, tuple(stalls), (t.batch_tokens,),
                    ((t.step_ms + flat_ms, tuple(stalls)),), chunk_charged_per_layer=charged is not None,
                    chunk_flat_ms=space.stall_weight * flat_ms / t.served, chunk_flat_step_ms=flat_ms,
                    chunk_price=price)
    return val, t.batch_tokens, t.served, move_ms


def chunk_mend_ms(val: Valuation, slots: tuple[int, ...]) -> float:
    """A coupled share's split `slots` [M]: its chunked step priced on the whole split (chunk_whole.py) less what
    its knapsack charged, per step (unweighted); 0 for a valuation without the price."""
    if val.chunk_price is None:
        return 0.0
    return val.chunk_price.mend_ms(slots)


def _expert_arrays(misses: np.ndarray, cost: CostModel, space: SplitSpace, current_slots: tuple[int, ...] | None,
                   step_ms: float, recall: float, move_ms_per_unit: float, served: float, union: np.ndarray,
                   decode: Decode | None) -> tuple[list[GroupArrays], list[Layout]]:
    """Every MoE layer's options as arrays straight from the curves `misses` [M, E + 1] (no Group objects, no
    link bytes): stall + `served` x migration, so that read / served the stall is per token served and the
    migration stays what it is, as in the exact problem. `union` [M]: the unions the chunking price reads;
    `decode`: the decode step each layer is charged its chance of leaving the graphs against (None: not)."""
    arrs, lays = [], []
    for m, curve in enumerate(misses):
        counts, units, _, stall = layer_options(curve, cost, space, m, step_ms, recall, float(union[m]),
                                                **(decode.of_layer(m) if decode is not None else {}))
        cost_ms = space.stall_weight * stall
        if current_slots is not None and counts[0] <= current_slots[m] <= counts[-1]:
            cost_ms = cost_ms + served * move_ms_per_unit * np.abs(units - units[current_slots[m] - counts[0]])
        index = np.arange(units.size)
        arrs.append(GroupArrays(units, cost_ms, np.zeros(units.size)))
        lays.append(Layout(units, index, index, units))
    return arrs, lays


def _slot_move_ms(space: SplitSpace, move_ms_per_unit: float, slots: np.ndarray, ranges: np.ndarray,
                  current_slots: tuple[int, ...] | None) -> float:
    """Moving each MoE layer from its current slot count to `slots` [M], per step. `ranges` [M, 2] holds each
    layer's slot range: a layer whose current count is outside it pays nothing, as in the exact problem."""
    if current_slots is None:
        return 0.0
    cur = np.asarray(current_slots)
    ok = (cur >= ranges[:, 0]) & (cur <= ranges[:, 1])
    unit = space.unit_bytes
    moved = np.abs(-(-(slots * space.slot_bytes) // unit) - -(-(cur * space.slot_bytes) // unit))
    return move_ms_per_unit * float(moved[ok].sum())


def _kv_move_ms(space: SplitSpace, move_ms_per_unit: float, gpu_blocks: int, current_kv: int | None) -> float:
    """Moving the GPU KV share from the current one to `gpu_blocks`, per step of the plan's horizon."""
    if current_kv is None:
        return 0.0
    unit = space.unit_bytes
    return move_ms_per_unit * abs(units_for_bytes(gpu_blocks * space.kv_block_bytes, unit) -
                                  units_for_bytes(current_kv * space.kv_block_bytes, unit))


def share_grid(fc: DemandForecast, space: SplitSpace, current_kv: int | None) -> list[int]:
    """The KV shares valued: `kv_grid` dense up to twice what the sequences want, the current share on it."""
    return kv_grid(space, max(fc.kv_live_blocks, fc.kv_gpu_used_blocks), current_kv)


def screen(fc: DemandForecast, cost: CostModel, space: SplitSpace, current_slots: tuple[int, ...] | None,
           current_kv: int | None, horizon_steps: int) -> list[float]:
    """Per grid share, an estimate of its objective (module docstring: one table per band, the band's middle
    split re-priced at each share's own batch), plus its KV cost and move; no link budget (the exact solves that
    follow have it). inf where the experts' floor does not fit beside the share."""
    grid = share_grid(fc, space, current_kv)
    unit = space.unit_bytes
    best_hits = prefix_hit_share(fc, grid[-1])
    terms = [_terms(fc, cost, space, g, best_hits, horizon_steps) for g in grid]
    by_band: dict[tuple[float, float], list[int]] = {}
    for i, t in enumerate(terms):
        by_band.setdefault(_band(fc, t.batch_tokens), []).append(i)
    capacity = space.capacity_units
    recall = space.prefetch_recall if fc.prefetch_recall is None else fc.prefetch_recall
    move = migration_ms_per_unit(cost, space, horizon_steps)
    num_experts = len(fc.misses_per_step[0]) - 1
    layers = np.arange(len(fc.misses_per_step))
    ranges = np.array([slot_range(space, int(m), num_experts) for m in layers])  # [M, 2] each layer's slot range
    out = [float("inf")] * len(grid)
    for (lo, hi), members in by_band.items():
        low, high = np.asarray(_anchor(fc, lo)[0]), np.asarray(_anchor(fc, hi)[0])  # [M, E + 1]

        def at(batch: float, low: np.ndarray = low, high: np.ndarray = high, lo: float = lo, hi: float = hi
               ) -> np.ndarray:
            w = _log_weight(batch, lo, hi)
            return (1 - w) * low + w * high

        mid = terms[members[len(members) // 2]]
        # Chunking priced at the band's largest union: the split then holds it at every share of the band, so
        # re-priced at a larger share's batch it does not fall into chunks the middle share did not see.
        largest = max(terms[i].batch_tokens for i in members)
        union = at(largest)[:, 0]
        mid_misses = with_large_steps(at(mid.batch_tokens), fc, mid.batch_tokens)
        # The decode unions at the band's largest batch, as the chunking above; their share at the middle's.
        mid_kv = units_for_bytes(grid[members[len(members) // 2]] * space.kv_block_bytes, unit)
        charged, _ = chunk_pricing(decode_step(fc, largest, at(largest), mid.batch_tokens), cost, space,
                                   num_experts, capacity - mid_kv)
        arrs, lays = _expert_arrays(mid_misses, cost, space, current_slots, mid.step_ms, recall, move, mid.served,
                                    union, charged)
        tables = tables_of(arrs, lays, 0.0, capacity)
        for i in members:
            kv_units = units_for_bytes(grid[i] * space.kv_block_bytes, unit)
            left = capacity - kv_units
            if left < 0 or not math.isfinite(float(at_capacity(tables[0], left))):
                continue
            # The split best at the band's middle share, priced at this share's own batch: a split that fits,
            # close to this share's best where the curves move little (not a bound: the knapsack picks by the
            # per-layer chunk charges, the split is priced whole).
            choice = backtrack(arrs, lays, tables, 0.0, left)
            assert choice is not None
            t, slots = terms[i], ranges[:, 0] + np.asarray(choice)
            decodes = at(t.batch_tokens)
            curves = np.asarray(with_large_steps(decodes, fc, t.batch_tokens))  # [M, E + 1]
            misses = curves[layers, slots]  # [M] each layer's loads at its chosen slot count
            # The chunked step priced on this split as a whole, over the batch's swing (chunk_whole.py); the
            # swing is built only where a chunked step has been learned (a grid share at a time, every solve).
            chunk_ms = 0.0 if cost.compute.chunked_step_ms <= 0 else whole_chunk_ms(
                cost.compute.chunked_step_ms, swing_at(fc, t.batch_tokens, decodes[:, 0],
                                                       decode_share(fc, t.batch_tokens)), slots, num_experts)
            stall_ms = space.stall_weight * (chunk_ms + float(option_stall_ms(
                cost, misses, curves[:, 0], slots, recall, t.step_ms, num_experts=num_experts).sum()))
            out[i] = stall_ms / t.served + _slot_move_ms(space, move, slots, ranges, current_slots) + t.kv_ms + \
                _kv_move_ms(space, move, grid[i], current_kv)
    return out


def search_shares(fc: DemandForecast, cost: CostModel, space: SplitSpace, current_slots: tuple[int, ...] | None,
                  current_kv: int | None, horizon_steps: int,
                  solve_fn: Callable[[Valuation], SplitSolution]) -> dict[int, AtShare]:
    """Every KV share solved exactly, by grid index: the best-screened share of each of the best `SCREEN_BANDS`
    bands, and the current share (module docstring)."""
    grid = share_grid(fc, space, current_kv)
    est = screen(fc, cost, space, current_slots, current_kv, horizon_steps)
    best_in: dict[tuple[float, float], int] = {}  # band -> its best-screened share
    for i in sorted(range(len(grid)), key=lambda i: est[i]):
        if est[i] < float("inf"):
            best_in.setdefault(_band(fc, running_batch(fc, grid[i], space.max_running_seqs)), i)
    picks = set(sorted(best_in.values(), key=lambda i: est[i])[:SCREEN_BANDS])
    if current_kv in grid:
        picks.add(grid.index(current_kv))
    done: dict[int, AtShare] = {}
    for i in sorted(picks):
        val, batch, served, move_ms = value_share(fc, cost, space, current_slots, current_kv, horizon_steps, grid[i])
        try:
            sol = solve_fn(val)
        except InfeasibleError as e:
            done[i] = AtShare(grid[i], batch, served, val, None, move_ms, str(e), screened_ms=float(est[i]))
            continue
        # The shares are ranked with the chunked step priced on each one's solved split, not the knapsack's
        # per-layer charges (chunk_whole.py).
        mend_ms = space.stall_weight * chunk_mend_ms(val, slots_of(val, sol.choice)) / served
        done[i] = AtShare(grid[i], batch, served, val, sol, move_ms, chunk_mend_ms=mend_ms, screened_ms=float(est[i]))
    return done


def slots_of(val: Valuation, choice: tuple[int, ...]) -> tuple[int, ...]:
    """The slot counts [M] of a choice's expert groups."""
    return tuple(counts[j] for counts, j in zip(val.slot_counts, choice[:-1], strict=True))


def solve_coupled(fc: DemandForecast, cost: CostModel, space: SplitSpace, current_slots: tuple[int, ...] | None,
                  current_kv: int | None, horizon_steps: int,
                  solve_fn: Callable[[Valuation], SplitSolution]) -> tuple[Valuation, SplitSolution]:
    """The best split over KV shares, as one valuation holding the winner's share and the current one; raises
    InfeasibleError (the first cause) when no share has a split that fits."""
    t0 = time.perf_counter()
    done = search_shares(fc, cost, space, current_slots, current_kv, horizon_steps, solve_fn)
    if not done:  # no share leaves room for the experts' floor: the smallest one's problem names the cause
        value_share(fc, cost, space, current_slots, current_kv, horizon_steps, space.kv_gpu_blocks_min)[0].problem \
            .check_feasible()
        raise InfeasibleError("no GPU KV share leaves room for the experts' slot floor within the HBM capacity")
    best = done[min(done, key=lambda i: done[i].objective_ms)]
    if best.sol is None:
        raise InfeasibleError(next(a.why_not for a in done.values() if a.why_not))
    grid = share_grid(fc, space, current_kv)
    cur = done.get(grid.index(current_kv)) if current_kv in grid else None
    val = _merged(best, cur if cur is not None and cur.kv_blocks != best.kv_blocks else None, current_slots,
                  space.stall_weight)
    val = dataclasses.replace(val, shares=tuple(done[i].terms() for i in sorted(done)))
    choice = (*best.sol.choice[:-1], 0)
    detail = (f"{best.sol.detail}; best of {len(done)} GPU KV shares, each with the batch it runs "
              f"({best.kv_blocks} blocks: {best.batch_tokens:.1f} tokens/step)")
    stats = {**best.sol.stats, "kv_shares_valued": float(len(done))}
    sol = make_solution(val.problem, choice, best.sol.solver, (time.perf_counter() - t0) * 1e3, detail, stats,
                        link_binds=Constraint.LINK in best.sol.binding)
    return val, sol


def _mended_step(val: Valuation, choice: tuple[int, ...]) -> tuple[float, tuple[tuple[float, ...], ...]]:
    """A share's predicted step (compute, stalls) with `choice`'s chunked step priced whole (none: as charged)."""
    step_ms, stalls = val.kv_steps[0]
    return (step_ms + chunk_mend_ms(val, slots_of(val, choice)) if choice else step_ms), stalls


def _merged(best: AtShare, cur: AtShare | None, current_slots: tuple[int, ...] | None,
            stall_weight: float = 1.0) -> Valuation:
    """The winner's valuation with the current share as a second KV option (module docstring)."""
    problem, val = best.val.problem, best.val
    # Each share's option carries its split's chunked step priced whole (chunk_whole.py): exact for the winner's
    # split and for the current one at its own share, the two that hysteresis and the plan's reason evaluate. At
    # the winner's share the current split reads the winner's mend (one option holds one): the two then differ by
    # the knapsack's per-layer charges, as the knapsack itself ranks splits within a share.
    best_kv = problem.groups[-1].options[0]
    options = [dataclasses.replace(best_kv, cost_ms=best_kv.cost_ms + best.chunk_mend_ms)]
    blocks, current, mends = [best.kv_blocks], None, [best.chunk_mend_ms]
    batches, steps = [best.batch_tokens], [_mended_step(val, best.sol.choice if best.sol else ())]
    budget, is_floor = problem.link_budget_bytes_per_step, problem.link_budget_is_floor
    if cur is not None and current_slots is not None and all(
            s in counts for s, counts in zip(current_slots, val.slot_counts, strict=True)):
        own = cur.val.problem
        own_choice = (*[counts.index(s) for s, counts in zip(current_slots, cur.val.slot_counts, strict=True)], 0)
        own_ms, _, own_link = evaluate(own, own_choice)
        here = [(g, g.options[counts.index(s)]) for g, s, counts in zip(problem.groups[:-1], current_slots,
                                                                        val.slot_counts, strict=True)]
        rest_ms = sum(o.cost_ms + migration_ms(problem, g, o) for g, o in here)
        rest_link = sum(o.link_bytes for _, o in here)
        own_kv = own.groups[-1].options[0]
        own_mend_ms = stall_weight * chunk_mend_ms(cur.val, tuple(current_slots)) / cur.served
        options.append(Option(own_kv.units, own_ms - rest_ms + own_mend_ms, max(0, own_link - rest_link),
                              own_kv.label))
        blocks.append(cur.kv_blocks)
        mends.append(own_mend_ms)
        current = 1
        batches.append(cur.batch_tokens)
        steps.append(_mended_step(cur.val, own_choice))
        # The current split keeps its own share's link verdict: it fits where its share has no cap (none leaves
        # room, `assemble`) or where it streams within the cap; it breaks only a real cap, and then the merged
        # problem carries that cap unflagged, whatever the winner's is (none included), so hysteresis owes the
        # switch.
        own_budget = own.link_budget_bytes_per_step
        if own_budget is None or own_link <= own_budget:
            if budget is not None:
                budget = max(budget, own_link, rest_link)
        else:
            budget = own_budget if budget is None else min(budget, own_budget)
        is_floor = own.link_budget_is_floor
    groups = (*problem.groups[:-1], Group("GPU KV", tuple(options), current, GroupKind.KV))
    merged = dataclasses.replace(problem, groups=groups, link_budget_bytes_per_step=budget,
                                 link_budget_is_floor=is_floor)
    return dataclasses.replace(val, problem=merged, kv_blocks=tuple(blocks), kv_batch=tuple(batches),
                               kv_steps=tuple(steps), plan_link_budget_bytes=problem.link_budget_bytes_per_step,
                               kv_chunk_mend_ms=tuple(mends))
