"""The rows' steady throughput restated per prompt token from the saved steps (`--steps-report`).

Runs in the bench process (`tierplan bench phase --steps-report DIR`); pure Python + numpy over the lines
`--save-steps` wrote (bench/phase_steps.py). Rows measured before session 43 priced the prefills a window's
output implies a request at a time, at the run's own prefills' mean: which prompts a window held (Mooncake's
run 3K-32K tokens at the 16K points) set that price, and a run that admits more sequences reaches further down
the request list in the same steps. `steady_tok_s` now prices them per prompt token at the point's mean prompt
(bench/phase_metrics.py); the steps hold all it needs, so this section restates every saved run at each point
by it, the newest run of each policy per device and point, against the best static baseline's: the same rule
the report's steady column applies to rows from session 43 on. Each point's request mix is the full sweep's
(`FULL`: the device calls run it). It never edits a row's figure.
"""

from __future__ import annotations

from typing import Any

from tierplan.bench.phase_cost_replay import step_records
from tierplan.bench.phase_grid import FULL, Sizes, point_requests, points
from tierplan.bench.phase_metrics import request_mean, steady_tok_s
from tierplan.bench.phase_report import STATIC_BASELINES

_STEP_COLUMNS = ("cycle_s", "num_prefills", "num_decodes", "tokens_out", "batch_tokens")


def request_means(sizes: Sizes = FULL) -> dict[str, tuple[float, float]]:
    """Each point's mean output and prompt tokens per request, by its key (`Point.key`)."""
    return {p.key: request_mean(point_requests(p, sizes)[0]) for p in points(sizes)}


def run_figures(line: dict[str, Any], mean: tuple[float, float]) -> tuple[float, float] | None:
    """A saved run's tok/s over its measured steps and its `steady_tok_s` at the point's `mean` (None: the
    steps lack a column it needs, or the run made no token)."""
    if any(c not in line["steps"] for c in _STEP_COLUMNS):
        return None
    steps = step_records(line)
    timed = steps[min(int(line.get("warm_steps") or 0), max(0, len(steps) - 1)):]
    wall_s, tokens = sum(s.cycle_s for s in timed), sum(s.tokens_out for s in timed)
    steady = steady_tok_s(steps, timed, *mean)
    return (tokens / wall_s, steady) if wall_s and tokens and steady else None


def restated(lines: list[dict[str, Any]], means: dict[str, tuple[float, float]]) -> list[dict[str, Any]]:
    """Per (device, point) where tierplan and a static baseline ran ok: tierplan's tok/s and steady tok/s over
    the best static baseline's by each (the newest run of each policy: `lines` in file order)."""
    newest: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for line in lines:
        if line.get("status") == "ok" and line["point"] in means:
            newest.setdefault((line.get("device", "?"), line["point"]), {})[line["policy"]] = line
    out = []
    for (device, point), runs in sorted(newest.items()):
        figs = {p: f for p, line in runs.items() if (f := run_figures(line, means[point])) is not None}
        static = [p for p in STATIC_BASELINES if p in figs]
        if "tierplan" not in figs or not static:
            continue
        by_tok = max(static, key=lambda p: figs[p][0])
        by_steady = max(static, key=lambda p: figs[p][1])
        tp = figs["tierplan"]
        out.append({"device": device, "point": point, "run_id": runs["tierplan"].get("run_id", "?"),
                    "tok_s": tp[0], "vs_tok_s": tp[0] / figs[by_tok][0], "best_tok_s": by_tok,
                    "steady_tok_s": tp[1], "vs_steady": tp[1] / figs[by_steady][1], "best_steady": by_steady})
    return out


def section(lines: list[dict[str, Any]], means: dict[str, tuple[float, float]] | None = None) -> list[str]:
    """The report's section (Markdown lines) over the measured runs' `lines`."""
    rows = restated(lines, request_means() if means is None else means)
    out = ["", "## Steady throughput per prompt token", "",
           "tierplan at each point its saved steps cover (the newest run of each policy per device): its tok/s "
           "over the best static baseline's, and its steady tok/s (each run charged the point's mean prompt for "
           "every request its output implies, at its own cost a prompt token, less the prompt tokens its "
           "measured steps computed) over the best static one's by that.", ""]
    if not rows:
        return [*out, "No point here where tierplan and a static baseline both have saved steps."]
    below = [r for r in rows if r["vs_steady"] < 0.95]
    out += [f"{len(rows)} points; below 0.95x the best static by tok/s: "
            f"{sum(r['vs_tok_s'] < 0.95 for r in rows)}, by steady tok/s: {len(below)}.", "",
            "| device | point | tierplan run | tok/s | / best static | steady tok/s | / best static (steady) |",
            "|---|---|---|---|---|---|---|"]
    out += [f"| {r['device']} | {r['point']} | {r['run_id']} | {r['tok_s']:.1f} | {r['vs_tok_s']:.2f} "
            f"({r['best_tok_s']}) | {r['steady_tok_s']:.1f} | {r['vs_steady']:.2f} ({r['best_steady']}) |"
            for r in rows]
    return out
