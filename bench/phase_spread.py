"""Run-to-run spread of the phase sweep: how far apart two runs of one point land when they did the same work.

Runs in the bench process (the report); pure Python. Each policy runs once per point, so a ratio between two
policies carries the run-to-run variation of the device and host with it. Runs whose decisions came out the
same (the same measured steps, output tokens and executors, the same bytes moved and expert hits, within
`BYTES_TOLERANCE` / `HIT_TOLERANCE`) did the same work: whatever separates their throughput is not a policy's
doing. The report prints the spread of those pairs next to the targets, and names "same work" as the cause
where tierplan trails a baseline it matched step for step (H200 phase runs 17-25: tierplan and mv_wsa issued
the same plans at 13 of 18 qwen3 points, and tierplan's tok/s over mv_wsa's ranged 0.83-1.28x there). It never
edits a figure.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Any

BYTES_TOLERANCE = 0.01  # bytes per link may differ this much (relative) between same-work runs
HIT_TOLERANCE = 0.005  # expert hit rates may differ this much (absolute)
# A same-work gap is named by its step kind where one kind holds this share of it and its steps ran this much
# slower (H100 runs 71, 74, 75, b256 4K 56 GiB: three runs in a row tierplan did mv_wsa's work at 0.72-0.79x, decode
# steps alike, 12.8 vs 12.9 ms, its 225 prefill steps 85.8 vs 60.0 ms: not spread but one kind of step, every run;
# runs 78-79 found it the first run's place at the point, whichever policy ran first).
KIND_SHARE = 0.8
KIND_SLOWER = 0.10


def same_work(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether runs `a` and `b` (rows of one point that produced a throughput) did the same work. Rows written
    before the sweep kept `executor_steps` never qualify (too little to tell)."""
    if a.get("point") != b.get("point") or not a.get("decode_tok_s") or not b.get("decode_tok_s"):
        return False
    if a.get("executor_steps") is None or a.get("executor_steps") != b.get("executor_steps"):
        return False
    if (a.get("measured_steps"), a.get("output_tokens"), a.get("preemptions")) != (
            b.get("measured_steps"), b.get("output_tokens"), b.get("preemptions")):
        return False
    if abs((a.get("expert_hit_rate") or 0.0) - (b.get("expert_hit_rate") or 0.0)) > HIT_TOLERANCE:
        return False
    for key in ("link_bytes", "kv_hits"):
        x, y = a.get(key) or {}, b.get(key) or {}
        if not all(math.isclose(x.get(k, 0), y.get(k, 0), rel_tol=BYTES_TOLERANCE, abs_tol=BYTES_TOLERANCE)
                   for k in set(x) | set(y)):
            return False
    return True


def gap_by_kind(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """Where same-work run `a` lost its time to `b`: the step kind (decode or prefill) holding at least KIND_SHARE
    of the gap in measured step time, its steps at least KIND_SLOWER slower; None where neither does (a gap spread
    over both kinds: run-to-run spread), `a` was not slower, or a row lacks the per-kind step times (rows before
    session 30)."""
    n_dec = a.get("decode_steps")
    n_all = a.get("measured_steps")
    times = [a.get("decode_step_ms"), b.get("decode_step_ms"), a.get("prefill_step_ms"), b.get("prefill_step_ms")]
    if n_dec is None or n_all is None or n_dec != b.get("decode_steps"):
        return None
    kinds = {"decode": (n_dec, times[0], times[1]), "prefill": (n_all - n_dec, times[2], times[3])}
    gaps = {k: n * (x - y) if n and x is not None and y is not None else 0.0 for k, (n, x, y) in kinds.items()}
    total = sum(max(0.0, g) for g in gaps.values())  # of the time lost (a kind that ran faster gives none back)
    if sum(gaps.values()) <= 0:
        return None
    kind = max(gaps, key=gaps.__getitem__)
    n, x, y = kinds[kind]
    if gaps[kind] < KIND_SHARE * total or not y or x < (1 + KIND_SLOWER) * y:
        return None
    other = "prefill" if kind == "decode" else "decode"
    return {"kind": kind, "steps": n, "ms": x, "other_ms": y, "share": gaps[kind] / total, "other": other,
            "other_pair": kinds[other][1:] if kinds[other][0] else None}


def apart(values: list[float]) -> float:
    """How far apart `values` (> 0) lie: the largest over the smallest, minus one (0.10: 10 % apart)."""
    return max(values) / min(values) - 1.0


def deviation(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The faster run's tok/s over the slower's, minus one (0.10: 10 % apart)."""
    return apart([a["decode_tok_s"], b["decode_tok_s"]])


def same_work_pairs(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every pair of rows at one point that did the same work (oracle candidates included: they are runs)."""
    by_point: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("decode_tok_s"):
            by_point.setdefault(r["point"], []).append(r)
    return [(a, b) for runs in by_point.values() for a, b in itertools.combinations(runs, 2) if same_work(a, b)]


def spread(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The same-work pairs' deviations: count, median, 90th percentile, max and the widest pair (None: no pair)."""
    pairs = same_work_pairs(rows)
    if not pairs:
        return None
    devs = sorted(deviation(a, b) for a, b in pairs)
    wide = max(pairs, key=lambda p: deviation(*p))
    p90 = devs[min(len(devs) - 1, int(0.9 * len(devs)))]
    return {"pairs": len(devs), "points": len({a["point"] for a, _ in pairs}), "median": statistics.median(devs),
            "p90": p90, "max": devs[-1], "widest": (wide[0]["point"], wide[0]["policy"], wide[1]["policy"])}


def repeat_line(rows: list[dict[str, Any]]) -> str:
    """The report's paragraph on repeated runs (`--repeats`: each policy's runs at a point, `repeat_tok_s` in the
    report's rows); "" where no policy ran more than once."""
    repeated = [r for r in rows if len(r.get("repeat_tok_s") or ()) > 1]
    if not repeated:
        return ""
    runs = [r["repeat_tok_s"] for r in repeated]
    devs = sorted(apart(t) for t in runs)
    counts = sorted({len(t) for t in runs})
    return (f"Repeats: {len(runs)} policy runs at {len({r['point'] for r in repeated})} "
            f"points ran {'/'.join(map(str, counts))} times each (rounds of alternating policy order); each row "
            f"shows its median run. The fastest and slowest run of one policy differ by {statistics.median(devs):.1%}"
            f" at the median, {devs[-1]:.1%} at most (live policies may not repeat their plans exactly).")


def spread_line(s: dict[str, Any] | None) -> str:
    """The report's paragraph on the spread."""
    if s is None:
        return ("Run-to-run spread: no two runs of one point did the same work here (same steps, executors, bytes "
                "moved and hits), so the sweep has no measure of it.")
    point, a, b = s["widest"]
    return (f"Run-to-run spread: {s['pairs']} pairs of runs at {s['points']} points did the same work (same measured "
            f"steps, output tokens and executors, bytes moved and KV hits within {BYTES_TOLERANCE:.0%}, expert hit "
            f"rate within {HIT_TOLERANCE}); their tok/s differ by {s['median']:.1%} at the median, {s['p90']:.1%} "
            f"at the 90th percentile, {s['max']:.1%} at most ({a} and {b} at {point}). One run per policy cannot "
            "tell a gap smaller than that from noise.")
