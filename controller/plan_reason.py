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


def _cost(val: Valuation, group: int, value: int) -> float | None:
    """The predicted ms/step of option `value` (slots, or KV blocks for the last group) under this valuation."""
    counts = val.kv_blocks if group == len(val.problem.groups) - 1 else val.slot_counts[group]
    if value not in counts:
        return None
    return val.problem.groups[group].options[counts.index(value)].cost_ms


def _batch(val: Valuation, before: int, after: int) -> str:
    """A coupled valuation's running batch under each share ("" for the separable one)."""
    if not val.kv_batch or before not in val.kv_blocks or after not in val.kv_blocks:
        return ""
    b0, b1 = (val.kv_batch[val.kv_blocks.index(k)] for k in (before, after))
    return f"runs {b0:.1f} -> {b1:.1f} tokens/step; "


def _chunk_part(val: Valuation, before: int, after: int) -> str:
    """The part of a KV move's effect that comes from pricing the chunked decode step on each whole split instead
    of per layer (a coupled valuation's mends, coupling.py): "" where none is kept or it is nil."""
    if not val.kv_chunk_mend_ms or before not in val.kv_blocks or after not in val.kv_blocks:
        return ""
    part = val.kv_chunk_mend_ms[val.kv_blocks.index(before)] - val.kv_chunk_mend_ms[val.kv_blocks.index(after)]
    if abs(part) < 0.005:
        return ""
    return (f", {part:+.2f} of it from pricing the decode steps run chunked on each whole split rather than per "
            "layer")


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
            sol: SplitSolution, cur_ms: float | None, kv_demand: float, new_kv_option: int | None = None) -> str:
    """`new_kv_option`: the KV option `new` stands on where its share is more (a plan's spare HBM goes to KV past
    the option the solve chose, `with_spare_kv`); None: its own."""
    option = new.kv_blocks if new_kv_option is None else new_kv_option
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
            before, after = _cost(val, kv_group, cur.kv_blocks), _cost(val, kv_group, option)
            gain = (before or 0.0) - (after or 0.0)
            if abs(gain) < 0.005:
                effect = "no predicted cost: the demand fits" if new.kv_blocks < cur.kv_blocks else "no predicted gain"
            elif gain > 0:
                effect = f"saves {gain:.2f} ms/step of sequences deferred or swapped out for want of KV"
            else:
                effect = f"costs {-gain:.2f} ms/step of sequences deferred or swapped out for want of KV"
            effect += _chunk_part(val, cur.kv_blocks, option)
            batch = _batch(val, cur.kv_blocks, option)
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
    # The flat price is the winner's share's (a coupled valuation's option 0; the separable one's, every share's),
    # with the winner's whole-split mend where the coupled search priced its split whole.
    if val.chunk_flat_ms > 0 and (not val.kv_steps or option == val.kv_blocks[0]):
        flat_ms = val.chunk_flat_ms + (val.kv_chunk_mend_ms[0] if val.kv_chunk_mend_ms else 0.0)
        parts.append(f"at this KV share some layer cannot hold its decode union clear (the experts' room, or a "
                     f"slot cap): decode steps run chunked off their graphs whatever the expert split "
                     f"({flat_ms:.2f} ms/step, priced on the KV share)")
    if Constraint.CAPACITY in sol.binding:
        parts.append("HBM budget binding")
    if Constraint.LINK in sol.binding:
        parts.append("host link budget binding")
    tail = f"predicted {sol.objective_ms:.2f} ms/step of stalls and deferral"
    if cur_ms is not None:
        tail += f" (current split: {cur_ms:.2f})"
    parts.append(f"{tail}; curves: {fc.curve_source}")
    return "; ".join(parts)
