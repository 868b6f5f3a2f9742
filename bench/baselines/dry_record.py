"""The oracle's access stream without an engine: the runner's step loop replayed on the CPU over block counts.

Bench driver code (the `tierplan bench phase` process). Which sequences run at each step is decided by the
scheduler (runtime/engine/scheduler.py) over block counts and the virtual step clock alone, and each token's
experts come from the forced routing table by (sequence, position); neither looks at a token's value or at
where an expert sits. So `dry_record` replays `Runner.run` (runtime/engine/runner.py) as the phase runner builds
and bounds it (bench/phase_run.py `measure`: a SWAP scheduler over the engine's GPU KV tier with max_batch and
max_prefill_tokens from the point, clamped every step to the applied plan's GPU KV blocks, the split's as
`clamp_split` leaves them; the clock at `steps * virtual_step_s` plus the jumps over idle gaps) and asks the
router for each step's trace rows exactly as `ReferenceEngine.step` does, through the same `FutureRecorder`
the engine recording uses. Every step the runner counts (warm-up ones included: the record counts engine
steps) is recorded. The result equals, step for step, what `oracle.RecordingPass` records on an engine; the
phase runner checks it against one with `OracleRecording.ENGINE`. It must never build an engine, move bytes,
or read a clock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierplan.bench.baselines.base import ExpertFuture, FutureRecorder, PointContext, Split
from tierplan.bench.oracle_estimate import DryStep
from tierplan.runtime.engine.scheduler import PreemptMode, Scheduler, Sequence
from tierplan.runtime.errors import ConfigError

if TYPE_CHECKING:
    from tierplan.bench.phase_grid import RunStop
    from tierplan.runtime.engine.hooks import ForcedRoutes


def point_scheduler(ctx: PointContext, gpu_blocks: int) -> Scheduler:
    """The scheduler of a point's run over an engine GPU KV tier of `gpu_blocks` (bench/phase_run.py `measure`
    and the replay here build it alike): the point's batch, a prefill-token limit that admits its longest
    context, preemption by SWAP."""
    return Scheduler(gpu_blocks, ctx.block_tokens, max_batch=ctx.batch,
                     max_prefill_tokens=max(2048, ctx.context_tokens + 1), preempt=PreemptMode.SWAP)


def dry_record(ctx: PointContext, split: Split, router: ForcedRoutes, *, engine_gpu_blocks: int,
               virtual_step_s: float, stop: RunStop | None = None, steps_out: list[DryStep] | None = None
               ) -> ExpertFuture:
    """The access stream a run of `ctx.requests` at `split` takes (module docstring), recorded under
    `split.kv_gpu_blocks`. `engine_gpu_blocks`: the run's engine GPU KV tier (EngineConfig.kv_gpu_blocks, the
    scheduler's own budget: `point_scheduler`); `stop`: where the run stops (a fresh `RunStop`, the runner's).
    ConfigError where the runner would refuse the run (a request that can never fit the GPU KV share, no CPU
    tier to swap to, a bad size); RuntimeError where its scheduler would make no progress. `steps_out`: each
    step's tokens, context and swapped blocks are appended to it (bench/oracle_estimate.py prices them)."""
    if engine_gpu_blocks < 1:
        raise ConfigError(f"dry_record: engine_gpu_blocks must be >= 1, got {engine_gpu_blocks}")
    if not virtual_step_s > 0:  # a wall clock makes the schedule depend on host speed: no replay can know it
        raise ConfigError(f"dry_record: virtual_step_s must be > 0, got {virtual_step_s}")
    if ctx.kv_cpu_blocks < 1:
        raise ConfigError(f"dry_record: the run's Runner would refuse it: preemption by SWAP needs CPU KV blocks, "
                          f"got ctx.kv_cpu_blocks={ctx.kv_cpu_blocks}")
    sched = point_scheduler(ctx, engine_gpu_blocks)
    # The applied plan's GPU KV limit: the split's blocks within the engine's tier, 1 at least (clamp_split).
    limit = max(1, min(split.kv_gpu_blocks, engine_gpu_blocks))
    sched_blocks = sched.gpu_blocks
    sched.gpu_blocks = min(sched_blocks, limit)
    for r in ctx.requests:  # only a prompt's length reaches the scheduler and the router, never its tokens
        sched.add(Sequence(r.request_id, r.arrival_s, [0] * r.prompt_len, r.output_len))
    rec = FutureRecorder(router)
    steps, offset = 0, 0.0
    while not sched.idle and not (stop is not None and stop.reached):
        sched.gpu_blocks = min(sched_blocks, limit)
        t_sched = steps * virtual_step_s + offset
        batch = sched.schedule(t_sched)  # SWAP: the preempted park their blocks, nothing the stream sees
        if batch.empty:
            offset += sched.idle_gap_s(t_sched)  # as the runner: raises at a dead end
            continue
        run = batch.prefills + batch.decodes
        # The swaps move the blocks of the tokens a sequence has computed (read before the step adds one); the
        # context is read after the step, as the runner records a step once its sequences have their new tokens.
        moved = (sum(-(-s.num_computed // ctx.block_tokens) for s in batch.swapped_in + batch.preempted)
                 if steps_out is not None else 0)
        rec.trace_rows([s.seq_id for s in run], [s.num_computed for s in run],
                       [s.num_tokens - s.num_computed for s in run])
        for s in run:
            sched.complete(s, 0, t_sched)
        if steps_out is not None:
            tokens = sum(len(s.prompt) for s in batch.prefills) + len(batch.decodes)
            steps_out.append(DryStep(len(batch.prefills), len(batch.decodes), tokens, sum(s.num_tokens for s in run),
                                     moved))
        steps += 1
        if stop is not None:
            stop.after_step(len(batch.prefills))
    return rec.future(split.kv_gpu_blocks)


def difference(a: ExpertFuture, b: ExpertFuture) -> str | None:
    """Where two records first differ, in words (a step's expert set at a layer, their lengths, the GPU KV
    blocks they were recorded under); None where they are equal step for step."""
    if a.kv_gpu_blocks != b.kv_gpu_blocks:
        return f"recorded under {a.kv_gpu_blocks} vs {b.kv_gpu_blocks} GPU KV blocks"
    for t, (x, y) in enumerate(zip(a.steps, b.steps, strict=False)):
        for m, (ex, ey) in enumerate(zip(x, y, strict=True)):
            if ex != ey:
                return f"step {t}, MoE layer {m}: experts {sorted(ex)} vs {sorted(ey)}"
    if a.num_steps != b.num_steps:
        return f"{a.num_steps} vs {b.num_steps} steps (equal over the first {min(a.num_steps, b.num_steps)})"
    return None
