"""Decode steps run chunked off their graphs: how often they were, against how often the union model says.

Runs in the bench process (`tierplan bench phase --steps-report DIR` adds it to phase_steps_report.md); pure
Python + numpy over the saved per-step records (bench/phase_steps.py), no torch and no device. The engine runs a
decode step eagerly, in chunks, where some layer's union of experts outruns its slots (`eager/layer_over_slots`);
the valuation prices that chance per layer with the union normal around its mean at the observed batch
(`controller.valuation.over_slots_prob`, the spread of independent tokens, `controller.demand.union_sd`; its
union is the measured curve's at the batch's bucket, here the router's frequencies' at the plan's mean batch). Per run
and plan, decode steps under one split: the share measured chunked, and P(some layer's union over its slots)
three ways from the routing table the runs were forced by: at the steps' mean batch (about as the valuation
prices it), averaged over each step's own batch (the batch's swing between prefills, known here, not to a
controller), and at the mean batch with the union's spread widened by the batch's (its coefficient of
variation through the union's slope: what a controller could learn from the decode tokens of each step). Its
use is to try a change to that price on real steps away from the device (bench/results/phase_h200.md, session
30: at b8 16K 24 GiB a 22-slot split ran 52 of 128 decode steps chunked at 75.7 ms against 16.4). It never edits
a row.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from tierplan.controller.chunk_whole import swing_of
from tierplan.controller.demand import swing_ratios
from tierplan.controller.valuation import over_slots_prob

MIN_DECODE_STEPS = 20  # a plan's decode steps fewer than this tell no share
CHUNKED_REASON = "layer_over_slots"


def token_probs(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """[M, E] P(a token routes to each expert) from a routing table [T, M, k]."""
    t, m, _k = routes.shape
    out = np.zeros((m, num_experts))
    for layer in range(m):
        out[layer] = np.bincount(routes[:, layer, :].ravel(), minlength=num_experts)[:num_experts] / max(1, t)
    return np.clip(out, 0.0, 1.0)


def union_moments(probs: np.ndarray, batch: float, batch_cv: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """[M] mean and spread of one step's union at `batch` independent tokens; `batch_cv` > 0 widens the spread
    by the batch's own (its sd, cv x batch, through the union's slope in the batch)."""
    b = max(1.0, batch)
    miss = (1.0 - probs) ** b  # [M, E] P(no token of the step routes there)
    q = 1.0 - miss
    var = (q * (1.0 - q)).sum(axis=1)
    if batch_cv > 0:
        slope = (-miss * np.log(np.maximum(1.0 - probs, 1e-12))).sum(axis=1)  # d union / d batch
        var = var + (slope * batch_cv * b) ** 2
    return q.sum(axis=1), np.sqrt(var)


def p_chunked(probs: np.ndarray, slots: list[int], batch: float, batch_cv: float = 0.0) -> float:
    """P(some layer's union outruns its slots) at `batch`, layers taken as independent."""
    mean, sd = union_moments(probs, batch, batch_cv)
    per_layer = [float(over_slots_prob(np.array([s]), mu, s_d, probs.shape[1])[0])
                 for s, mu, s_d in zip(slots, mean, sd, strict=True)]
    return 1.0 - float(np.prod([1.0 - p for p in per_layer]))


def p_swing(probs: np.ndarray, slots: list[int], batch: np.ndarray) -> float:
    """P(some layer's union outruns its slots) as the controller prices a split now (controller/chunk_whole.py):
    over `swing_ratios` quantiles of the steps' batch over its median, at the median."""
    median = float(np.median(batch))
    ratios = swing_ratios(list(batch / median)) or (1.0,)
    return swing_of(probs, ratios, median, union_moments(probs, median)[0], 1.0).p_any(slots, probs.shape[1])


def chunk_rows(lines: list[dict[str, Any]], probs: np.ndarray, moe_layers: tuple[int, ...] | None = None
               ) -> list[dict[str, Any]]:
    """Per run and plan with `MIN_DECODE_STEPS` decode steps or more: the measured share chunked and the three
    predictions (module docstring). `moe_layers`: the model layers `probs`' rows are (a plan's bytes are per model
    layer; None: every layer is one). Lines without plans or executors per step are skipped."""
    out = []
    for line in lines:
        cols, plans = line.get("steps") or {}, line.get("plans") or {}
        if not plans or "executors" not in cols or "plan_version" not in cols or not line.get("slot_bytes"):
            continue
        by_plan: dict[int, list[int]] = defaultdict(list)
        for i in range(int(line.get("warm_steps") or 0), len(cols["step_s"])):
            if not cols["num_prefills"][i] and cols["batch_tokens"][i] > 0:
                by_plan[int(cols["plan_version"][i])].append(i)
        for version, steps in sorted(by_plan.items()):
            plan = plans.get(str(version))
            if plan is None or len(steps) < MIN_DECODE_STEPS:
                continue
            per_layer = plan["expert_bytes_per_layer"]
            layers = moe_layers if moe_layers is not None else tuple(range(len(per_layer)))
            if max(layers, default=-1) >= len(per_layer):
                continue
            slots = [int(per_layer[layer]) // int(line["slot_bytes"]) for layer in layers]
            if len(slots) != probs.shape[0]:
                continue
            batch = np.array([cols["batch_tokens"][i] for i in steps], dtype=float)
            chunked = [any(CHUNKED_REASON in str(k) for k in cols["executors"][i]) for i in steps]
            mean, cv = float(batch.mean()), float(batch.std() / batch.mean())
            out.append({"point": line.get("point"), "policy": line.get("policy"), "run_id": line.get("run_id"),
                        "plan": version, "steps": len(steps), "batch": mean, "batch_cv": cv, "min_slots": min(slots),
                        "measured": float(np.mean(chunked)), "at_mean": p_chunked(probs, slots, mean),
                        "per_step": float(np.mean([p_chunked(probs, slots, b) for b in batch])),
                        "with_cv": p_chunked(probs, slots, mean, cv), "swing": p_swing(probs, slots, batch)})
    return out


def section(rows: list[dict[str, Any]]) -> list[str]:
    """The report's Markdown lines: each prediction's mean absolute error on the measured share, over every
    plan and over the plans where some prediction or the measurement is neither ~0 nor ~1, then those plans."""
    lines = ["## Decode steps run chunked off their graphs", "",
             "Per run and plan (decode steps under one split, after the warm-up): the share the engine ran chunked "
             "(`eager/layer_over_slots`) against P(some layer's union over its slots) from the forced router's "
             "table: at the mean batch (as the knapsack's per-layer charge prices it), over each step's batch, at "
             "the mean batch with the union's spread widened by the batch's, and over eight quantiles of the steps' "
             "batch over their median, as the coupled search prices a whole split (controller/chunk_whole.py; "
             "bench/phase_chunking.py).", ""]
    if not rows:
        return [*lines, "No plan with enough decode steps and per-step executors here."]
    keys = ("at_mean", "per_step", "with_cv", "swing")
    mixed = [r for r in rows if any(0.02 < r[k] < 0.98 for k in ("measured", *keys))]
    for name, group in (("every plan", rows), ("plans neither all nor none chunked", mixed)):
        if group:
            errs = ", ".join(f"{k} {np.mean([abs(r[k] - r['measured']) for r in group]):.3f}" for k in keys)
            lines.append(f"Mean absolute error, {name} ({len(group)}): {errs}.")
    lines += ["", "| point | policy | run | plan | decode steps | batch | batch cv | least slots | measured | at mean "
              "| per step | with cv | swing |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['point']} | {r['policy']} | {r['run_id']} | {r['plan']} | {r['steps']} | {r['batch']:.1f} | "
              f"{r['batch_cv']:.2f} | {r['min_slots']} | {r['measured']:.2f} | {r['at_mean']:.2f} | "
              f"{r['per_step']:.2f} | {r['with_cv']:.2f} | {r['swing']:.2f} |" for r in mixed]
    return lines
