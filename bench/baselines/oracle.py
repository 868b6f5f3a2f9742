"""`oracle`: the best static split in hindsight plus Belady eviction, the limit tierplan's gap is measured to.

Bench driver code. The runner tries `candidate_splits(ctx)` (static splits from the KV the batch needs, experts
taking the rest, up to every expert resident) and keeps the best measured one; where the pool holds more than it
measures, it runs only the best priced (bench/oracle_estimate.py). For each run it first records the point's
access stream under that split's GPU KV blocks (`ExpertFuture`; the schedule follows the KV split, base.py says
why), by replaying the runner's scheduler on the CPU (dry_record.py; an engine run with `RecordingPass` records
the same stream, the check), and hands it in as `ctx.future`. On the run, victims are ranked by Belady's rule: the
resident whose next use is farthest in the future goes first (never used again: first of all), so the expert used
soonest is evicted last. Next uses are counted in steps: an expert an earlier layer of the current step used
counts as used now (kept), a conservative tie the step-level record cannot split. A run whose steps stop matching
the record (`diverged_steps`) ranks those keys as never used again, and says so in its notes. It must never move
bytes itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierplan.bench.baselines.base import (
    ExpertFuture,
    FutureRecorder,
    PointContext,
    PolicyRun,
    Split,
    StepExperts,
    clamp_split,
    fits,
    kv_first_expert_bytes,
    make_plan,
    observe_routes,
    split_for,
)
from tierplan.bench.baselines.static import all_experts_bytes, expert_room_bytes

if TYPE_CHECKING:
    from tierplan.runtime.engine.engine import ReferenceEngine
    from tierplan.runtime.engine.victims import Key


def candidate_splits(ctx: PointContext, max_splits: int = 5) -> list[Split]:
    """At most `max_splits` distinct static splits, evenly spaced in expert bytes from the one that gives KV the
    batch's whole demand (at least a slot per layer) to the most experts beside the KV floor (every expert, if
    they fit); each fits the budget."""
    if max_splits < 1:
        raise ValueError(f"max_splits must be >= 1, got {max_splits}")
    hi = min(all_experts_bytes(ctx), expert_room_bytes(ctx))
    lo = min(hi, kv_first_expert_bytes(ctx, 1))
    n = max_splits
    out: list[Split] = []
    for i in range(n):
        b = hi if n == 1 else lo + (hi - lo) * i // (n - 1)
        s = split_for(ctx, b)
        if fits(ctx, s) and s not in out:
            out.append(s)
    return out


class BeladyOrder:
    """The victim order (module docstring) over a recorded future; `observe` advances the step clock."""

    def __init__(self, future: ExpertFuture) -> None:
        self.future = future
        self.step = -1  # the step running now (observe runs before it)
        self.diverged_steps = 0
        self.rankings = 0

    def observe(self, used: StepExperts) -> None:
        self.step += 1
        if self.step >= self.future.num_steps or self.future.steps[self.step] != used:
            self.diverged_steps += 1

    def next_use(self, key: Key) -> float:
        return self.future.next_use(key[0], key[1], max(self.step, 0))

    def __call__(self, candidates: list[Key]) -> list[Key]:
        """Farthest next use first (stable: least recently used first among equals)."""
        self.rankings += 1
        return sorted(candidates, key=lambda k: -self.next_use(k))


class RecordingPass:
    """The recording run for one candidate split: the split with LRU victims, every step's experts kept
    (`future()` after the run). Any expert policy would record the same stream: placement never changes which
    sequences run, only the GPU KV blocks do; so does `dry_record.dry_record` without an engine (the phase
    runner's default; this pass is what it is checked against)."""

    name = "oracle_recording"
    needs_future = False

    def __init__(self, split: Split) -> None:
        self.split = split
        self.recorder: FutureRecorder | None = None

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        return {}

    def start(self, engine: ReferenceEngine, ctx: PointContext) -> PolicyRun:
        self.recorder = observe_routes(engine, lambda used: None)
        return PolicyRun(make_plan(ctx, clamp_split(ctx, self.split, engine), self.name, "recording the access "
                                   "stream for the oracle"), split=self.split)

    def future(self) -> ExpertFuture:
        if self.recorder is None:
            raise ValueError("oracle recording: future() before the run (start was not called)")
        return self.recorder.future(self.split.kv_gpu_blocks)


class Oracle:
    name = "oracle"
    needs_future = True
    order: BeladyOrder | None = None  # the run's victim order after start (its diverged_steps, rankings)

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        return {}

    def start(self, engine: ReferenceEngine, ctx: PointContext) -> PolicyRun:
        if ctx.future is None:
            raise ValueError("oracle: ctx.future is None; the runner must record the point's access stream first "
                             "(FutureRecorder) under the split's kv_gpu_blocks")
        split = ctx.split or candidate_splits(ctx, 1)[0]
        if ctx.future.kv_gpu_blocks != split.kv_gpu_blocks:
            raise ValueError(f"oracle: the future was recorded under {ctx.future.kv_gpu_blocks} GPU KV blocks, the "
                             f"split has {split.kv_gpu_blocks}: the schedule differs, record it under the split")
        clamped = clamp_split(ctx, split, engine)
        if clamped != split:
            raise ValueError(f"oracle: split {split} does not fit this engine (pool {engine.pool.num_slots} slots, "
                             f"GPU KV capacity): build the engine with room for it")
        order = self.order = BeladyOrder(ctx.future)
        observe_routes(engine, order.observe)
        why = (f"static split in hindsight: {split.expert_slots_per_layer} expert slots per layer, "
               f"{split.kv_gpu_blocks} GPU KV blocks; Belady eviction from a {ctx.future.num_steps}-step record")
        return PolicyRun(make_plan(ctx, split, self.name, why), victim_order=order, split=split,
                         notes="Belady at step granularity; best of the runner's candidate splits")
