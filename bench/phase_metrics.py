"""A phase-diagram row from one run's measurements, and the cost model's prediction of its step time.

Runs in the bench process; pure Python + numpy over the runner's records (no torch). Every figure is over the
measured steps (those after warm-up):
- `decode_tok_s`: output tokens of the measured steps over their wall time, from the end of the last warm-up
  step to the end of the last step: every step's cycle (the forward, and everything between two steps:
  preemption spills, the planner's solve, prefetch issue, the agent's hooks). `measured_step_ms` is that wall
  time over the measured steps; `ms_per_token` its inverse per output token: the figure to compare policies
  by (runs of one point differ in how many sequences share a step). `decode_step_ms`: the mean cycle of the
  `decode_steps` measured steps with no prefill (`prefill_step_ms`: of those with one); `engine_step_ms`: the
  forward alone; `mean_running_batch`: sequences per measured step. `decode_step_ms_p50` / `_max`: the median and the
  slowest of those decode cycles, and `gc_ms` the collector's pauses in the measured steps: whether a gap
  between two runs that did the same work (phase_spread.py) is a few slow steps or every step a little slower.
- `steady_tok_s`: `decode_tok_s` with the measured steps charged for the prefills their output implies, as a
  long stream of the point's requests would charge them: output tokens over the point's mean output per request
  give the requests, each with the point's mean prompt, priced per prompt token at this run's own prefill cost
  (`prefill_ms_per_token`), less the prompt tokens the measured steps computed. A run stopped early
  (`Sizes.stop_decode_steps`) under a small KV share ran few sequences, and its prefills fell mostly before its
  measured steps or never ran: H200 phase run 26, qwen3 b128 1K 40 GiB, resident served 6 of 160 requests at
  470 tok/s; tierplan all 160 at 325 (its first prefills fell in the warm-up). And a run that admits more
  sequences reaches further down the request list in the same steps: at the 16K points the Mooncake prompts
  run 3K-32K tokens, so which prefills a window holds swings its tok/s (H100 phase run 84, b8 16K 56 GiB:
  kv_tiering's window prefilled 53K prompt tokens, tierplan's 125K). Priced a request at a time (rows
  before session 43, `steady_per` "request"), the run's few prefills set the price too, its long prompts
  with them (kv_tiering 255 against tierplan 200 tok/s there; per prompt token 226 against 217). Where the
  measured steps hold the prefills of what they output, steady and `decode_tok_s` agree.
- TPOT p50/p99 and TTFT p50 over the run's finished requests (wall time, from the `Runner`; `requests` counts
  them and `requests_unfinished`, those left when the run stopped: `Sizes.stop_decode_steps`), expert hit
  rate, stall ms per measured step by cause (a step that waited on both expert loads and KV fetches counts all
  of its stall as "both", as the agent's telemetry does), KV hits per tier, bytes per link, plan changes.
- `predicted_step_ms`: the cost model's step time for what the policy planned, never for what it measured:
  the cost model (`tierplan.controller.costmodel`, calibrated step by step on the earlier runs of the model in
  this process, the point's discarded warm-up run, this run's warm-up steps and its telemetry windows before the
  step's: `Predictor.calibrate`, each window priced before it is folded in, the controller's horizon:
  bench/phase_pricing.py; `predicted_ahead_steps` says how many steps; rows before session 39 priced the whole
  run from the fit before it) over
  each measured step's tokens, context and KV fetches with the expert misses the engine's LRU residency makes
  at the slots per layer of the plan the step ran under, replayed over the run's step shapes on the forced
  router's table (bench/phase_residency.py; rows before session 41: the trace's LRU stack-distance curves at
  the step's batch, `predicted_from` says which), the share of them the step's loads show issued ahead of their
  layer
  (`StepRecord.expert_prefetch_hits`) priced as streamed; a decode step that opens a telemetry window also pays
  the window's excess (`Predictor.window_open_ms`). One rule for every policy: a live one's steps are
  priced at each split it applied, from the step it took effect; that step also pays the GPU KV blocks its
  plan's share evicts, at the time a block took at the plan changes measured before
  (`Predictor.evict_ms_per_block`: 0.17-0.50 ms a block on the H100/H200, against ~5 us of link; such steps
  held 6-26 % of some live runs' measured time in phase runs 29-45).
  `controller_step_ms`: a live policy's own figure, the controller's `Decision.step_ms` of the split in force.
  It is a typical step at the batch the controller saw, not the run's mix of decodes and prefills: on the H200
  it was 0.1-8.6x the measured step (phase runs 17-25, bench/results/phase_h200.md).
  `predicted_step_ms_measured_misses` prices the measured misses instead (time per byte, no miss prediction);
  `predicted_decode_step_ms_measured_misses` / `predicted_prefill_step_ms_measured_misses` the same over the
  steps without / with a prefill (against `decode_step_ms` / `prefill_step_ms`).
It never asserts on a figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tierplan.bench.phase_predictor import Predictor, mean_of, plan_source
from tierplan.bench.phase_pricing import price_ahead
from tierplan.controller.protocol import AckStatus

# The row, in its order: every row carries these (the rest are extra columns).
ROW_FIELDS = ("model", "layers", "batch", "context", "hbm_budget_gib", "policy", "decode_tok_s", "tpot_p50_ms",
              "tpot_p99_ms", "ttft_p50_ms", "expert_hit_rate", "stall_ms_expert", "stall_ms_kv", "stall_ms_both",
              "predicted_step_ms", "measured_step_ms", "device")


def _mean_ms(seconds: list[float]) -> float | None:
    return None if not seconds else sum(seconds) / len(seconds) * 1e3


def timing(steps: list[Any]) -> dict[str, float | None]:
    """The measured steps' wall-time figures (module docstring); zeros / None without steps."""
    wall_s = sum(s.cycle_s for s in steps)
    tokens = sum(s.tokens_out for s in steps)
    decode = [s.cycle_s for s in steps if s.num_prefills == 0]
    prefill = [s.cycle_s for s in steps if s.num_prefills > 0]
    n = len(steps)
    return {"decode_tok_s": tokens / wall_s if wall_s else 0.0,
            "measured_step_ms": wall_s / n * 1e3 if n else 0.0,
            "ms_per_token": wall_s / tokens * 1e3 if tokens else None,
            "decode_step_ms": _mean_ms(decode),
            "prefill_step_ms": _mean_ms(prefill),
            "engine_step_ms": sum(s.step_s for s in steps) / n * 1e3 if n else None,
            "mean_running_batch": sum(s.num_prefills + s.num_decodes for s in steps) / n if n else None,
            "measured_wall_s": wall_s,
            "decode_steps": len(decode),
            "decode_step_ms_p50": float(np.median(decode)) * 1e3 if decode else None,
            "decode_step_ms_max": max(decode) * 1e3 if decode else None,
            "gc_ms": sum(s.gc_ms for s in steps),
            # CUDA-graph captures of new buckets, left out of the wall time above (phase_run.server_clock)
            "graph_capture_ms": sum(getattr(s, "capture_ms", 0.0) for s in steps)}


def _pct_ms(seconds: list[float] | None, q: float) -> float | None:
    """The q-quantile of `seconds`, in ms (q = 1: the most); None without any."""
    if not seconds:
        return None
    xs = sorted(seconds)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def controller_step_ms(outcome: Any, warm: int, num_timed: int) -> float | None:
    """A live policy's own prediction: the controller's `Decision.step_ms` of the split in force, averaged over
    the measured steps (steps before its first decision left out; None: no decision). It prices one typical step
    at the batch the controller saw, not the measured mix of decodes and prefills, so it is no estimate of
    `measured_step_ms` where prefills are in the mix (H200 phase rows: 0.1-8.6x it); the row carries it beside
    `predicted_step_ms` to show what the controller believed."""
    decisions = sorted(outcome.extra.get("decisions") or [])
    ws = max(1, outcome.window_steps)
    in_force = [active[-1] for i in range(warm, warm + num_timed)
                if (active := [ms for w, ms in decisions if w * ws <= i])]
    return mean_of(in_force)


def _stalls(steps: list[Any]) -> dict[str, float]:
    out = {"expert": 0.0, "kv": 0.0, "both": 0.0}
    for s in steps:
        if s.expert_stall_ms > 0 and s.kv_stall_ms > 0:
            out["both"] += s.expert_stall_ms + s.kv_stall_ms
        elif s.expert_stall_ms > 0:
            out["expert"] += s.expert_stall_ms
        elif s.kv_stall_ms > 0:
            out["kv"] += s.kv_stall_ms
    n = max(1, len(steps))
    return {k: v / n for k, v in out.items()}


def _sum(steps: list[Any], attr: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in steps:
        for k, v in getattr(s, attr).items():
            out[k] = out.get(k, 0) + v
    return out


def request_mean(requests: Sequence[Any]) -> tuple[float, float]:
    """A point's mean output and prompt tokens per request (`steady_tok_s`'s `output_per_request`,
    `prompt_per_request`)."""
    n = max(1, len(requests))
    return sum(r.output_len for r in requests) / n, sum(r.prompt_len for r in requests) / n


def prefill_ms_per_token(steps: list[Any]) -> float:
    """A prompt token's cycle time over `steps` (a run's, warm-up included): each step with prefills less its
    decodes at the decode-only steps' median time per sequence, over the prompt tokens those steps computed
    (their tokens less one a decode; 0.0 without a prefill)."""
    per_seq = [s.cycle_s / s.num_decodes for s in steps if s.num_prefills == 0 and s.num_decodes]
    d = float(np.median(per_seq)) if per_seq else 0.0
    pre = [s for s in steps if s.num_prefills]
    prompt = sum(s.batch_tokens - s.num_decodes for s in pre)
    return max(0.0, sum(s.cycle_s - s.num_decodes * d for s in pre)) / prompt * 1e3 if prompt > 0 else 0.0


def steady_tok_s(steps: list[Any], timed: list[Any], output_per_request: float,
                 prompt_per_request: float) -> float | None:
    """`steady_tok_s` (module docstring): the measured steps' output over their wall time plus the prompt tokens
    that output implies (requests at `output_per_request` tokens out, `prompt_per_request` in) beyond (or short
    of) those they computed, each at `prefill_ms_per_token(steps)`."""
    tokens, wall_s = sum(s.tokens_out for s in timed), sum(s.cycle_s for s in timed)
    if not tokens or not wall_s or output_per_request <= 0 or prompt_per_request <= 0:
        return None
    computed = sum(s.batch_tokens - s.num_decodes for s in timed if s.num_prefills)
    implied = tokens / output_per_request * prompt_per_request - computed
    charged = wall_s + implied * prefill_ms_per_token(steps) / 1e3
    return tokens / charged if charged > 0 else tokens / wall_s


def measured_row(base: dict[str, Any], outcome: Any, warm_steps: int, predictor: Predictor,
                 request_mean: tuple[float, float] = (0.0, 0.0)) -> dict[str, Any]:
    """The row of a run that ran: `base` (model, layers, ... policy, device) plus its figures. Folds the run's
    windows into `predictor` (warm-up ones before predicting, the rest after). `request_mean`: the point's
    mean output and prompt tokens per request (`steady_tok_s`; 0: none)."""
    steps = outcome.steps
    warm = min(warm_steps, max(0, len(steps) - 1))  # a run shorter than the warm-up still measures its last step
    timed = steps[warm:]
    hits, misses = sum(s.expert_hits for s in timed), sum(s.expert_misses for s in timed)
    run = price_ahead(predictor, steps, warm, outcome.window_steps, outcome.extra.get("plans_applied") or {},
                      outcome.initial_plan)
    prices = run.measured_misses
    predicted, source = mean_of(run.predicted or []) or 0.0, plan_source(timed, run.evicted_blocks)
    priced = mean_of(prices) or 0.0
    # The same pricing over decode and prefill steps apart (a prefill needs every expert: where the cost model
    # errs is told apart by step kind; compare with decode_step_ms / prefill_step_ms).
    priced_decode = mean_of([p for p, s in zip(prices, timed, strict=True) if s.num_prefills == 0])
    priced_prefill = mean_of([p for p, s in zip(prices, timed, strict=True) if s.num_prefills > 0])
    rep = outcome.report
    stalls = _stalls(timed)
    applied = sum(a.status is AckStatus.APPLIED for a in outcome.acks)
    fetch = _sum(timed, "kv_fetch")
    plan = outcome.initial_plan
    tm = timing(timed)
    measured = tm["measured_step_ms"]
    notes, status = outcome.notes, "ok"
    errors = outcome.extra.get("planner_errors") or []
    if errors:  # the live planner failed some windows: the plan held there, so this is not the policy's result
        status = "degraded"
        notes = f"{len(errors)} window(s) the planner failed, first: {errors[0]}" + (f" | {notes}" if notes else "")
    diverged = outcome.extra.get("diverged_steps")
    if diverged is not None:
        notes += f" | diverged_steps {diverged} (steps whose experts differed from the recording)"
    return {
        **base,
        **tm,
        "steady_tok_s": steady_tok_s(steps, timed, *request_mean), "steady_per": "prompt token",
        "tpot_p50_ms": rep.pct("tpot_s", 0.5) * 1e3, "tpot_p99_ms": rep.pct("tpot_s", 0.99) * 1e3,
        "ttft_p50_ms": rep.pct("ttft_s", 0.5) * 1e3,
        "expert_hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        "stall_ms_expert": stalls["expert"], "stall_ms_kv": stalls["kv"], "stall_ms_both": stalls["both"],
        "predicted_step_ms": predicted, "predicted_from": source, "predicted_ahead_steps": run.ahead_steps,
        "controller_step_ms": controller_step_ms(outcome, warm, len(timed)),
        "predicted_step_ms_measured_misses": priced,
        "predicted_decode_step_ms_measured_misses": priced_decode,
        "predicted_prefill_step_ms_measured_misses": priced_prefill,
        "predicted_over_measured": predicted / measured if measured else None,
        "status": status, "measured_steps": len(timed), "warm_steps": warm,
        "requests": len(rep.requests) + rep.unfinished, "requests_unfinished": rep.unfinished,
        "output_tokens": sum(s.tokens_out for s in timed),
        "kv_hits": {"gpu": sum(s.kv_gpu_hits for s in timed), **fetch},
        "link_bytes": _sum(timed, "link_bytes"),
        "executor_steps": _sum(timed, "executors"),  # "executor/reason": measured steps (graph, piecewise, eager)
        "plan_changes": max(0, applied - 1), "plans_rejected": len(outcome.acks) - applied,
        "planner_errors": outcome.loop_stats.get("planner_errors", 0),
        # How far the live planner ran behind decode (closed_loop.InProcessLoop): its time a window, the windows
        # queued behind the one it took, and each applied plan's steps from its window's end.
        "planner_ms_p50": _pct_ms(outcome.loop_stats.get("planner_s"), 0.5),
        "planner_ms_max": _pct_ms(outcome.loop_stats.get("planner_s"), 1.0),
        "windows_queued_max": max(outcome.loop_stats.get("windows_queued") or [0]),
        "windows_unplanned": outcome.loop_stats.get("windows_unplanned", 0),
        "plan_lag_steps": list(outcome.loop_stats.get("plan_lag_steps") or []),
        "peak_hbm_bytes": outcome.extra.get("peak_hbm_bytes"),
        "over_budget_steps": outcome.extra.get("over_budget_steps"),
        "diverged_steps": diverged, "local_predictor": outcome.extra.get("local_predictor"),
        "initial_expert_bytes": sum(plan.expert_bytes_per_layer),
        "initial_kv_gpu_blocks": int(plan.kv_blocks_per_tier.get("gpu", 0)),
        "preemptions": sum(r.preemptions for r in rep.requests),
        "plans_issued": outcome.extra.get("plans_issued") or [],  # a live controller's: when, split, batch, why
        "plans_held": outcome.extra.get("plans_held"),  # a live controller's kept splits: how often, the last why
        # windows a live controller held its split without planning (controller/loop.py `Quiet`); None: no count
        "windows_quiet": (outcome.extra.get("controller_stats") or {}).get("windows_quiet"),
        "notes": notes.lstrip(" |"),
    }


def refused_row(base: dict[str, Any], reason: str) -> dict[str, Any]:
    """A run that could not run (its plan refused, a missing solver, a point its split cannot serve): every
    field present, the figures None, the reason in `notes` (never dropped from the table)."""
    figures = {k: None for k in ROW_FIELDS if k not in base}
    return {**base, **figures, "status": "refused", "notes": reason}
