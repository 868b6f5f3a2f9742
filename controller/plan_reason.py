"""A plan's reason in words a user understands: what changed in the workload, what the split did about it,
what each change is predicted to save, and which limit binds.

Runs in the controller process; pure string building over the valuation (never imports torch, runtime or
agent). Factors are ranked by their predicted effect in ms per step under the new forecast, largest first.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierplan.controller.demand import LARGE_STEP_FACTOR, DemandForecast
from tierplan.controller.optimizer.problem import Constraint, SplitSolution
from tierplan.controller.valuation import Valuation, prefix_hit_share

TOP_FACTORS = 3


@dataclass(frozen=True)
class Split:
    slots: tuple[int, ...]  # resident expert slots per MoE layer
    kv_blocks: int  # GPU KV blocks

    def describe(self) -> str:
        lo, hi = min(self.slots), max(self.slots)
        per = f"{lo}" if lo == hi else f"{lo}-{hi}"
        return f"{sum(self.slots)} expert slots ({per}/layer) + {self.kv_blocks} KV blocks"


def _kv_index(val: Valuation, blocks: int) -> int | None:
    """The KV option a split of `blocks` GPU blocks stands on: its own, else the largest below it (a plan's spare
    HBM goes to KV beyond the option the solve chose, `with_spare_kv`); None below every option."""
    if blocks in val.kv_blocks:
        return val.kv_blocks.index(blocks)
    below = [i for i, k in enumerate(val.kv_blocks) if k < blocks]
    return max(below, key=lambda i: val.kv_blocks[i]) if below else None


def _cost(val: Valuation, group: int, value: int) -> float | None:
    """The predicted ms/step of option `value` (slots, or KV blocks for the last group) under this valuation."""
    if group == len(val.problem.groups) - 1:
        i = _kv_index(val, value)
        return None if i is None else val.problem.groups[group].options[i].cost_ms
    counts = val.slot_counts[group]
    if value not in counts:
        return None
    return val.problem.groups[group].options[counts.index(value)].cost_ms


def _batch(val: Valuation, before: int, after: int) -> str:
    """A coupled valuation's running batch under each share ("" for the separable one)."""
    i, j = _kv_index(val, before), _kv_index(val, after)
    if not val.kv_batch or i is None or j is None:
        return ""
    return f"runs {val.kv_batch[i]:.1f} -> {val.kv_batch[j]:.1f} tokens/step; "


def _chunk_part(val: Valuation, before: int, after: int) -> str:
    """The part of a KV move's effect that is the chunked decode step priced on each whole split (a coupled
    valuation's mends, coupling.py): "" where none is kept or it is nil."""
    i, j = _kv_index(val, before), _kv_index(val, after)
    if not val.kv_chunk_mend_ms or i is None or j is None:
        return ""
    part = val.kv_chunk_mend_ms[i] - val.kv_chunk_mend_ms[j]
    if abs(part) < 0.005:
        return ""
    verb = "saving" if part > 0 else "costing"
    return f", {verb} {abs(part):.2f} of it in decode steps run chunked (each split priced whole)"


def _workload(prev: DemandForecast | None, fc: DemandForecast, kv_demand: float) -> str:
    union = sum(fc.union_per_step) / len(fc.union_per_step)
    num_experts = len(fc.misses_per_step[0]) - 1
    large = (f"; {fc.large_step_share:.0%} of steps over {LARGE_STEP_FACTOR:g}x the batch (prefills), their "
             "loads priced at their size" if fc.large_step_share > 0 else "")
    rising = (f"; KV demand still rising: priced at no less than the {fc.kv_filling_blocks} blocks the agent "
              "started with" if fc.kv_filling_blocks else "")
    if prev is None:
        return (f"batch {fc.batch_tokens:.1f} tokens/step needs {union:.1f} of {num_experts} experts per layer "
                f"per step{large}; KV demand {kv_demand:.0f} blocks{rising}")
    prev_union = sum(prev.union_per_step) / len(prev.union_per_step)
    return (f"batch {prev.batch_tokens:.1f} -> {fc.batch_tokens:.1f} tokens/step (experts needed per layer "
            f"{prev_union:.1f} -> {union:.1f} of {num_experts}){large}; KV demand {prev.kv_live_blocks:.0f} -> "
            f"{kv_demand:.0f} blocks{' (GPU KV was full)' if fc.kv_saturated else ''}{rising}")


def explain(cur: Split | None, new: Split, prev_fc: DemandForecast | None, fc: DemandForecast, val: Valuation,
            sol: SplitSolution, cur_ms: float | None, kv_demand: float) -> str:
    parts = [_workload(prev_fc, fc, kv_demand)]
    if fc.reuse_per_step > 0:
        parts.append(f"prefix reuse {fc.reuse_per_step:.1f} blocks/step, "
                     f"{prefix_hit_share(fc, new.kv_blocks):.0%} of it kept on the GPU")
    factors: list[tuple[float, str]] = []
    if cur is None:
        parts.append(f"first split: {new.describe()}")
    else:
        kv_group = len(val.problem.groups) - 1
        if new.kv_blocks != cur.kv_blocks:
            before, after = _cost(val, kv_group, cur.kv_blocks), _cost(val, kv_group, new.kv_blocks)
            gain = (before or 0.0) - (after or 0.0)
            if abs(gain) < 0.005:
                effect = "no predicted cost: the demand fits" if new.kv_blocks < cur.kv_blocks else "no predicted gain"
            elif gain > 0:
                effect = f"saves {gain:.2f} ms/step of sequences deferred or swapped out for want of KV"
            else:
                effect = f"costs {-gain:.2f} ms/step of sequences deferred or swapped out for want of KV"
            effect += _chunk_part(val, cur.kv_blocks, new.kv_blocks)
            batch = _batch(val, cur.kv_blocks, new.kv_blocks)
            factors.append((abs(gain), f"KV GPU blocks {cur.kv_blocks} -> {new.kv_blocks} ({batch}{effect})"))
        grown = [m for m, (a, b) in enumerate(zip(cur.slots, new.slots, strict=True)) if b > a]
        shrunk = [m for m, (a, b) in enumerate(zip(cur.slots, new.slots, strict=True)) if b < a]
        for layers, verb in ((grown, "more"), (shrunk, "fewer")):
            if not layers:
                continue
            gain = sum((_cost(val, m, cur.slots[m]) or 0.0) - (_cost(val, m, new.slots[m]) or 0.0) for m in layers)
            delta = sum(abs(new.slots[m] - cur.slots[m]) for m in layers)
            what = "expert loads and decode steps run chunked" if val.chunk_charged_per_layer else "expert loads"
            if abs(gain) < 0.005:
                effect = "no predicted cost" if verb == "fewer" else "no predicted gain"
            elif gain > 0:
                effect = f"saves {gain:.2f} ms/step of {what}"
            else:
                effect = f"costs {-gain:.2f} ms/step of {what}"
            factors.append((abs(gain), f"{delta} {verb} expert slots over {len(layers)} layer(s) ({effect})"))
    factors.sort(key=lambda f: -f[0])
    parts += [text for _, text in factors[:TOP_FACTORS]]
    # The flat price is the winner's share's (a coupled valuation's option 0; the separable one's, every share's).
    if val.chunk_flat_ms > 0 and (not val.kv_steps or new.kv_blocks == val.kv_blocks[0]):
        parts.append(f"at this KV share some layer cannot hold its decode union clear (the experts' room, or a "
                     f"slot cap): decode steps run chunked off their graphs whatever the expert split "
                     f"({val.chunk_flat_ms:.2f} ms/step, priced on the KV share)")
    if Constraint.CAPACITY in sol.binding:
        parts.append("HBM budget binding")
    if Constraint.LINK in sol.binding:
        parts.append("host link budget binding")
    tail = f"predicted {sol.objective_ms:.2f} ms/step of stalls and deferral"
    if cur_ms is not None:
        tail += f" (current split: {cur_ms:.2f})"
    parts.append(f"{tail}; curves: {fc.curve_source}")
    return "; ".join(parts)
