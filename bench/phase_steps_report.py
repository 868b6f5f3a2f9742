"""What the saved per-step records say about run-to-run spread: a few slow steps, or a whole run slower.

Runs in the bench process (`tierplan bench phase --steps-report DIR`); pure Python + numpy over the lines
`--save-steps` wrote (bench/phase_steps.py). Per run, the decode cycles after the warm-up (steps with no
prefill): their mean, median, 90th percentile and slowest, the collector's pauses, and how much of the decode
time the slowest 5 % of them took. Per point and policy with two runs or more (repeats, or calls that measured
it again): how far apart their means and their medians lie. Means apart with medians together: a few slow
steps (host, collector); medians apart too: the whole run was slower (device clock, placement). Then the cost
model replayed over the same steps (bench/phase_cost_replay.py), the runs that spent a tenth of their wall or
more between steps, with what each plan change cost there, the decode forwards' GPU time against their host time
(where the steps carry `graph_gpu_ms`; also by their place in the telemetry window), and how often decode steps
ran chunked off their graphs against the union model (bench/phase_chunking.py), and tierplan's steady throughput
restated per prompt token against the best static baseline's (bench/phase_steady.py). It never edits a row's
figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tierplan.bench.phase_chunking import chunk_rows, token_probs
from tierplan.bench.phase_chunking import section as chunk_section
from tierplan.bench.phase_cost_replay import replay_file, router_table, shape_of, step_records
from tierplan.bench.phase_cost_replay import section as cost_section
from tierplan.bench.phase_predictor import plan_evictions
from tierplan.bench.phase_spread import apart
from tierplan.bench.phase_steady import section as steady_section
from tierplan.bench.phase_steps import load_steps, measured_lines

TAIL_SHARE = 0.05  # the slowest steps whose share of the decode time is reported
BETWEEN_SHARE = 0.1  # runs whose time between steps is at least this share of their measured wall are listed


def run_summary(line: dict[str, Any]) -> dict[str, Any] | None:
    """One run's decode cycles after its warm-up (None: the run has none)."""
    cols = line["steps"]
    warm = int(line.get("warm_steps") or 0)
    cycles, prefills = cols.get("cycle_s", [])[warm:], cols.get("num_prefills", [])[warm:]
    gc = cols.get("gc_ms", [])[warm:]
    decode = np.array([c * 1e3 for c, n in zip(cycles, prefills, strict=True) if n == 0])
    if decode.size == 0:
        return None
    tail = np.sort(decode)[::-1][: max(1, int(np.ceil(TAIL_SHARE * decode.size)))]
    return {"point": line["point"], "policy": line["policy"], "run_id": line.get("run_id"),
            "repeat": line.get("repeat"), "decode_steps": int(decode.size),
            "mean_ms": float(decode.mean()), "p50_ms": float(np.median(decode)),
            "p90_ms": float(np.percentile(decode, 90)), "max_ms": float(decode.max()),
            "tail_share": float(tail.sum() / decode.sum()), "gc_ms": float(sum(gc))}


def between_summary(line: dict[str, Any]) -> dict[str, Any] | None:
    """A run's time between steps after its warm-up (the wall outside the forward: plan changes' and
    preemptions' KV moves, solves, hooks), and at each plan change in it the gap before the step the plan ran
    first, with the GPU KV blocks spilled for it (the plan's own, `plan_evictions`, and those of its first step)
    and fetched back at it. None where that time is under BETWEEN_SHARE of the measured wall."""
    if "step_s" not in line["steps"]:  # lines without the forward's own time
        return None
    steps, warm = step_records(line), int(line.get("warm_steps") or 0)
    block = int(line.get("kv_block_bytes") or 0) or 1
    gaps = [(s.cycle_s - s.step_s) * 1e3 for s in steps]
    wall, between = sum(s.cycle_s for s in steps[warm:]) * 1e3, sum(gaps[warm:])
    if wall <= 0 or between < BETWEEN_SHARE * wall:
        return None
    changes = []
    for i in range(max(1, warm), len(steps)):
        s, prev = steps[i], steps[i - 1]
        if getattr(s, "plan_version", None) != getattr(prev, "plan_version", None):
            spilled = plan_evictions(s, prev, block) + (getattr(s, "link_bytes", None) or {}).get("d2h", 0) // block
            changes.append((gaps[i], spilled, sum((getattr(s, "kv_fetch", None) or {}).values())))
    return {"point": line["point"], "policy": line["policy"], "run_id": line.get("run_id"), "wall_ms": wall,
            "between_ms": between, "changes": changes}


def _replayed_at(line: dict[str, Any]) -> list[int]:
    """Indices of a run's decode steps after its warm-up that replayed graphs (none saved without `graph_gpu_ms`)."""
    cols, warm = line["steps"], int(line.get("warm_steps") or 0)
    if "graph_gpu_ms" not in cols:
        return []
    return [i for i in range(warm, len(cols["step_s"]))
            if cols["num_prefills"][i] == 0 and cols["graph_gpu_ms"][i] is not None]


def _replayed(line: dict[str, Any]) -> list[tuple[float, float, int, float, int, bool]]:
    """A run's decode forwards after its warm-up that replayed graphs: (forward ms, GPU ms, expert reads, context
    tokens, sequences, clean: no expert miss and no KV fetch in the step)."""
    cols, at = line["steps"], _replayed_at(line)
    if not at:  # also a line saved without graph times (nor, then, every column read below)
        return []
    n = len(cols["step_s"])
    ctx = cols.get("context_tokens") or [0] * n
    seqs = cols.get("num_decodes") or [0] * n
    fetch = cols.get("kv_fetch") or [{}] * n
    return [(cols["step_s"][i] * 1e3, cols["graph_gpu_ms"][i], cols["expert_hits"][i] + cols["expert_misses"][i],
             float(ctx[i]), seqs[i], not cols["expert_misses"][i] and not sum(fetch[i].values()))
            for i in at]


def forward_split(line: dict[str, Any]) -> dict[str, Any] | None:
    """A run's decode forwards after its warm-up, split into the GPU time of their graph replays (`graph_gpu_ms`,
    CUDA events) and the rest (host work between pieces, launches, waits): medians over the steps that replayed,
    with the host time per expert read and per 1,000 tokens of context. None for runs saved without it or with
    no replayed decode step."""
    steps = _replayed(line)
    if not steps:
        return None
    fwd, gpu, rd, ctx = np.array([s[:4] for s in steps], dtype=float).T  # [steps] each
    host = fwd - gpu
    cols, kept = line["steps"], _replayed_at(line)

    def mean_of(name: str) -> float | None:  # a column saved since session 37; None before
        return float(np.mean([cols[name][i] for i in kept])) if name in cols else None

    solve_ms, solve_cpu_ms = mean_of("planner_ms"), mean_of("planner_cpu_ms")
    return {"point": line["point"], "policy": line["policy"], "run_id": line.get("run_id"), "steps": len(steps),
            "forward_ms": float(np.median(fwd)), "gpu_ms": float(np.median(gpu)),
            "host_ms": float(np.median(host)), "reads": float(np.median(rd)), "context_tokens": float(np.median(ctx)),
            "host_us_per_read": float(np.median(host / np.maximum(rd, 1.0))) * 1e3,
            "host_us_per_kctx": float(np.median(host / np.maximum(ctx / 1e3, 1e-3))) * 1e3,
            "outbox_ms": mean_of("outbox_ms"), "planner_ms": solve_ms,
            "planner_cores": solve_cpu_ms / solve_ms if solve_ms and solve_cpu_ms is not None else None}


def window_places(line: dict[str, Any]) -> dict[str, Any] | None:
    """A run's replayed decode forwards after its warm-up by their place in the telemetry window (place 0: the
    first step after a window closed, when the engine thread has just snapshotted the taps and a live planner
    starts on that window): the median forward ms at each place, and the mean `outbox_ms` / `planner_ms` there
    where the steps carry them. None for runs without `graph_gpu_ms` or a window, or with an empty place."""
    cols, ws = line["steps"], int(line.get("window_steps") or 0)
    if ws < 2:
        return None
    at: list[list[int]] = [[] for _ in range(ws)]
    for i in _replayed_at(line):
        at[i % ws].append(i)
    if not all(at):
        return None

    def per_place(name: str) -> list[float] | None:
        return [float(np.mean([cols[name][i] for i in idx])) for idx in at] if name in cols else None

    return {"point": line["point"], "policy": line["policy"], "run_id": line.get("run_id"),
            "forward_ms": [float(np.median([cols["step_s"][i] for i in idx])) * 1e3 for idx in at],
            "outbox_ms": per_place("outbox_ms"), "planner_ms": per_place("planner_ms")}


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def host_fit(lines: list[dict[str, Any]], min_steps: int = 50) -> dict[str, float] | None:
    """Least squares of the host rest of the replayed decode forwards with no miss and no KV fetch (after each
    run's warm-up) on a constant, the (layer, expert) reads, the context in 1,000 tokens and the sequences:
    ms each, with R^2. None below `min_steps` such steps."""
    rows = [(1.0, rd, ctx / 1e3, n, f - g) for line in lines for f, g, rd, ctx, n, clean in _replayed(line) if clean]
    if len(rows) < min_steps:
        return None
    a = np.array(rows, dtype=float)
    x, y = a[:, :4], a[:, 4]
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    r2 = 1.0 - float(np.var(y - x @ coef)) / float(np.var(y)) if np.var(y) > 0 else 1.0
    return {"steps": len(rows), "const_ms": float(coef[0]), "per_read_ms": float(coef[1]),
            "per_kctx_ms": float(coef[2]), "per_seq_ms": float(coef[3]), "r2": r2}


def spread_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point and policy with >= 2 runs: how far apart their mean and median decode cycles lie, and the
    verdict (the module docstring's)."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["point"], r["policy"]), []).append(r)
    out = []
    for (point, policy), rs in by.items():
        if len(rs) < 2:
            continue
        means, medians = apart([r["mean_ms"] for r in rs]), apart([r["p50_ms"] for r in rs])
        verdict = ("alike" if means <= 0.05 else "a few slow steps" if medians <= 0.5 * means
                   else "the whole run slower")
        out.append({"point": point, "policy": policy, "runs": len(rs), "means_apart": means,
                    "medians_apart": medians, "verdict": verdict})
    return out


def steps_files(folder: Path) -> list[Path]:
    """Every steps file under `folder` (its subfolders too: one per device call), in name order."""
    return sorted(folder.rglob("phase_*_steps_*.jsonl.gz"))


def report(paths: list[Path]) -> str:
    """The Markdown report over the steps files `paths` (ValueError naming a file that is not one)."""
    every = {p: load_steps(p) for p in paths}  # the cost model's replay folds the discarded runs in too
    per_file = {p: measured_lines(lines) for p, lines in every.items()}
    runs = [s for lines in per_file.values() for line in lines if (s := run_summary(line)) is not None]
    lines = ["# Per-step records: where the run-to-run spread comes from", "",
             f"{len(runs)} runs with decode steps, from {len(paths)} file(s).", ""]
    pairs = spread_rows(runs)
    if pairs:
        counts = {v: sum(p["verdict"] == v for p in pairs) for v in ("alike", "a few slow steps",
                                                                    "the whole run slower")}
        lines += [f"Policies run twice or more at a point: {len(pairs)}; means within 5 %: {counts['alike']}, "
                  f"apart by a few slow steps: {counts['a few slow steps']}, whole runs slower: "
                  f"{counts['the whole run slower']}.", "",
                  "| point | policy | runs | means apart | medians apart | verdict |", "|---|---|---|---|---|---|"]
        lines += [f"| {p['point']} | {p['policy']} | {p['runs']} | {p['means_apart']:.1%} | "
                  f"{p['medians_apart']:.1%} | {p['verdict']} |" for p in pairs]
    else:
        lines.append("No policy ran twice at one point here (`--repeats`, or another call of the same code).")
    lines += ["", "| point | policy | run | decode steps | mean ms | p50 ms | p90 ms | max ms | slowest 5 % share "
              "| gc ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['point']} | {r['policy']} | {r['run_id']}/{r['repeat']} | {r['decode_steps']} | "
              f"{r['mean_ms']:.2f} | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | {r['max_ms']:.2f} | "
              f"{r['tail_share']:.1%} | {r['gc_ms']:.1f} |" for r in runs]
    betweens = [b for lines_ in per_file.values() for line in lines_ if (b := between_summary(line)) is not None]
    lines += ["", "## Time between steps", "",
              f"Runs whose wall outside the forward (after the warm-up) is {BETWEEN_SHARE:.0%} of their measured wall "
              "or more, and at each plan change in it: the gap before the plan's first step, the GPU KV blocks "
              "spilled for it (the step before and that step) and fetched back at it.", ""]
    lines += ["| point | policy | run | measured wall ms | between steps ms | at plan changes: gap ms / spilled / "
              "fetched |", "|---|---|---|---|---|---|"]
    lines += [f"| {b['point']} | {b['policy']} | {b['run_id']} | {b['wall_ms']:.0f} | {b['between_ms']:.0f} "
              f"({b['between_ms'] / b['wall_ms']:.0%}) | "
              f"{'; '.join(f'{g:.0f} / {s_} / {f}' for g, s_, f in b['changes']) or 'none'} |" for b in betweens]
    splits = [f for lines_ in per_file.values() for line in lines_ if (f := forward_split(line)) is not None]
    if splits:
        fit = host_fit([line for lines_ in per_file.values() for line in lines_])
        said = (f"over their {fit['steps']:,} replayed decode steps with no miss and no KV fetch, the host rest is "
                f"{fit['const_ms']:.2f} ms + {fit['per_read_ms'] * 1e3:.1f} us a read + {fit['per_kctx_ms'] * 1e3:.1f} "
                f"us per 1,000 context tokens + {fit['per_seq_ms'] * 1e3:.1f} us a sequence (least squares, R^2 "
                f"{fit['r2']:.2f})" if fit is not None else "too few clean steps for a fit")
        lines += ["", "## Decode forward: GPU against host", "",
                  "Decode steps that replayed CUDA graphs, after the warm-up (medians): the forward's wall, the GPU "
                  "time of its replays (CUDA events around each), and the rest (host work before and between the "
                  "pieces, launches, waits); the (layer, expert) reads a step made (hits and misses over the MoE "
                  f"layers), its context, and the host rest per read and per 1,000 context tokens: {said}.", "",
                  "The last columns: the mean time a cycle shared the GIL with the telemetry's builds and a "
                  "child-process planner's messages (`outbox_ms`), and the mean time a planner's process worked "
                  "during a cycle with the cores it kept busy meanwhile (`planner_ms`, `planner_cpu_ms`; steps "
                  "saved before session 37: -).", "",
                  "| point | policy | run | steps | forward ms | GPU ms | host ms | expert reads | context tokens "
                  "| host us / read | host us / 1K context | outbox ms | planner ms (cores) |", "|---" * 13 + "|"]
        lines += [f"| {f['point']} | {f['policy']} | {f['run_id']} | {f['steps']} | {f['forward_ms']:.2f} | "
                  f"{f['gpu_ms']:.2f} | {f['host_ms']:.2f} | {f['reads']:.0f} | {f['context_tokens']:.0f} | "
                  f"{f['host_us_per_read']:.1f} | {f['host_us_per_kctx']:.1f} | "
                  f"{_fmt(f['outbox_ms'])} | {_fmt(f['planner_ms'])} ({_fmt(f['planner_cores'], '.1f')}) |"
                  for f in splits]
    places = [w for lines_ in per_file.values() for line in lines_ if (w := window_places(line)) is not None]
    if places:
        def row(xs: list[float] | None, spec: str) -> str:
            return "-" if xs is None else " / ".join(format(x, spec) for x in xs)

        lines += ["", "## Decode forward by place in the window", "",
                  "The replayed decode forwards after the warm-up by their place in the telemetry window (place 0: "
                  "the first step after a window closed; a live planner then works on that window): median forward "
                  "ms at each place, and the mean ms each place shared with the telemetry's builds and planner "
                  "messages (`outbox_ms`) and with the planner's process at work (`planner_ms`); -: saved before "
                  "session 37.", "",
                  "| point | policy | run | forward ms by place | outbox ms by place | planner ms by place |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {w['point']} | {w['policy']} | {w['run_id']} | {row(w['forward_ms'], '.1f')} | "
                  f"{row(w['outbox_ms'], '.1f')} | {row(w['planner_ms'], '.0f')} |" for w in places]
    replayed, chunking, skipped = [], [], []
    tables: dict[tuple[int, int, int], np.ndarray] = {}  # the router's table per (MoE layers, top-k, experts)
    probs: dict[tuple[int, int, int], np.ndarray] = {}  # its per-token routing probabilities
    for p, file_lines in every.items():
        try:
            shape = shape_of(file_lines[0]) if file_lines else None
            key = (shape.num_moe_layers, shape.top_k, shape.num_experts) if shape is not None else None
            if key is not None and key not in tables:
                tables[key] = router_table(shape)
                probs[key] = token_probs(tables[key], key[2])
            replayed += replay_file(p, file_lines, tables.get(key) if key is not None else None)
            if key is not None:
                chunking += chunk_rows(per_file[p], probs[key], tuple(shape.moe_layers))
        except ValueError as exc:  # a model without a built-in shape: named, the rest replayed
            skipped.append(f"{p.name}: {exc}")
    lines += ["", *cost_section(replayed), *(["", "Not replayed: " + "; ".join(skipped)] if skipped else [])]
    lines += ["", *chunk_section(chunking)]
    lines += steady_section([line for file_lines in per_file.values() for line in file_lines])
    return "\n".join(lines) + "\n"
