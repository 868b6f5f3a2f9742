"""A phase-diagram row from one run's measurements, and the cost model's prediction of its step time.

Runs in the bench process; pure Python over the runner's records (no torch). Every figure is over the steps
after warm-up: decode tok/s (tokens the measured steps produced over their wall time), TPOT p50/p99 and TTFT
p50 over the run's requests (wall time, from the `Runner`), expert hit rate, stall ms per measured step by
cause (a step that waited on both expert loads and KV fetches counts all of its stall as "both", as the
agent's telemetry does), KV hits per tier, bytes per link, plan changes. `predicted_step_ms` is the controller's
cost model (`tierplan.controller.costmodel`) for the loads the policy's split caused (each measured step's
tokens, context, expert misses and KV fetches), calibrated only on windows it has not to predict: the earlier
runs of the model in this process and this run's warm-up windows. It never asserts on a figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierplan.controller.costmodel import CostModel, HardwareSpec, StepLoad
from tierplan.controller.model_shape import ModelShape
from tierplan.controller.protocol import AckStatus, Link

# The row, in its order: every row carries these (the rest are extra columns).
ROW_FIELDS = ("model", "layers", "batch", "context", "hbm_budget_gib", "policy", "decode_tok_s", "tpot_p50_ms",
              "tpot_p99_ms", "ttft_p50_ms", "expert_hit_rate", "stall_ms_expert", "stall_ms_kv", "stall_ms_both",
              "predicted_step_ms", "measured_step_ms", "device")
TRANSFER_OVERHEAD_PRIOR_S = 1e-4  # per record, before calibration (the cost model fits it from the windows)


@dataclass
class Predictor:
    """One cost model per model in this process, calibrated as the runs go."""

    cost: CostModel
    kv_block_bytes: int

    @classmethod
    def for_model(cls, h: Any) -> Predictor:
        spec = h.spec
        shape = ModelShape(name=spec.name, num_layers=spec.num_layers, moe_layers=tuple(spec.moe_layers),
                           num_experts=spec.num_experts, top_k=spec.top_k, expert_bytes=h.stride_bytes, dense_bytes=0,
                           kv_bytes_per_token=max(1, h.kv_block_bytes // h.block_tokens), block_tokens=h.block_tokens)
        hw = HardwareSpec(link_bytes_per_s=dict.fromkeys(Link, h.link_bytes_per_s),
                          transfer_overhead_s=TRANSFER_OVERHEAD_PRIOR_S, hbm_bytes=0, name=str(h.dev.torch_device))
        return cls(CostModel(shape, hw), h.kv_block_bytes)

    def calibrate(self, windows: list[Any]) -> None:
        for tel in windows:
            self.cost.calibrate(tel)

    def step_ms(self, steps: list[Any]) -> float:
        """Mean predicted step time over `steps` (StepRecords), each from its own load."""
        m = self.cost.shape.num_moe_layers
        total = 0.0
        for s in steps:
            per, extra = divmod(s.expert_misses, m)
            misses = tuple(per + (1 if j < extra else 0) for j in range(m))
            cpu, nvme = s.kv_fetch.get("cpu", 0), s.kv_fetch.get("nvme", 0)
            load = StepLoad(batch_tokens=max(1, s.batch_tokens), context_tokens=s.context_tokens, miss_count=misses,
                            kv_fetch_bytes=cpu * self.kv_block_bytes, kv_fetch_count=cpu,
                            kv_disk_read_bytes=nvme * self.kv_block_bytes, kv_disk_read_count=nvme)
            total += self.cost.step_time_ms(load).total_ms
        return total / len(steps) if steps else 0.0


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


def measured_row(base: dict[str, Any], outcome: Any, warm_steps: int, predictor: Predictor) -> dict[str, Any]:
    """The row of a run that ran: `base` (model, layers, ... policy, device) plus its figures. Folds the run's
    windows into `predictor` (warm-up ones before predicting, the rest after)."""
    steps = outcome.steps
    warm = min(warm_steps, max(0, len(steps) - 1))  # a run shorter than the warm-up still measures its last step
    timed = steps[warm:]
    wall_s = sum(s.step_s for s in timed)
    hits, misses = sum(s.expert_hits for s in timed), sum(s.expert_misses for s in timed)
    n_warm_windows = warm // outcome.window_steps
    predictor.calibrate(outcome.telemetry[:n_warm_windows])
    predicted = predictor.step_ms(timed)
    predictor.calibrate(outcome.telemetry[n_warm_windows:])
    rep = outcome.report
    stalls = _stalls(timed)
    applied = sum(a.status is AckStatus.APPLIED for a in outcome.acks)
    fetch = _sum(timed, "kv_fetch")
    plan = outcome.initial_plan
    measured = wall_s / len(timed) * 1e3 if timed else 0.0
    notes, status = outcome.notes, "ok"
    errors = outcome.extra.get("planner_errors") or []
    if errors:  # the live planner failed some windows: the plan held there, so this is not the policy's result
        status = "degraded"
        notes = f"{len(errors)} window(s) the planner failed, first: {errors[0]}" + (f" | {notes}" if notes else "")
    return {
        **base,
        "decode_tok_s": sum(s.tokens_out for s in timed) / wall_s if wall_s else 0.0,
        "tpot_p50_ms": rep.pct("tpot_s", 0.5) * 1e3, "tpot_p99_ms": rep.pct("tpot_s", 0.99) * 1e3,
        "ttft_p50_ms": rep.pct("ttft_s", 0.5) * 1e3,
        "expert_hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        "stall_ms_expert": stalls["expert"], "stall_ms_kv": stalls["kv"], "stall_ms_both": stalls["both"],
        "predicted_step_ms": predicted, "measured_step_ms": measured,
        "predicted_over_measured": predicted / measured if measured else None,
        "status": status, "measured_steps": len(timed), "warm_steps": warm, "requests": len(rep.requests),
        "kv_hits": {"gpu": sum(s.kv_gpu_hits for s in timed), **fetch},
        "link_bytes": _sum(timed, "link_bytes"),
        "plan_changes": max(0, applied - 1), "plans_rejected": len(outcome.acks) - applied,
        "planner_errors": outcome.loop_stats.get("planner_errors", 0),
        "peak_hbm_bytes": outcome.extra.get("peak_hbm_bytes"),
        "over_budget_steps": outcome.extra.get("over_budget_steps"),
        "initial_expert_bytes": sum(plan.expert_bytes_per_layer),
        "initial_kv_gpu_blocks": int(plan.kv_blocks_per_tier.get("gpu", 0)),
        "preemptions": sum(r.preemptions for r in rep.requests),
        "notes": notes,
    }


def refused_row(base: dict[str, Any], reason: str) -> dict[str, Any]:
    """A run that could not run (its plan refused, a missing solver, a point its split cannot serve): every
    field present, the figures None, the reason in `notes` (never dropped from the table)."""
    figures = {k: None for k in ROW_FIELDS if k not in base}
    return {**base, **figures, "status": "refused", "notes": reason}
