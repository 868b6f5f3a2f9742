"""`tierplan bench phase`: every policy on the same engine, traces and HBM budget, over batch x context x budget.

Runs in one process on one device (`--quick`: the CPU smoke sizes of bench/phase_grid.py, no figure to quote).
Per model: the pinned store, router and sizes are built once (bench/phase_run.py `open_model`) and shared by
every run's engine; per point, each policy runs once on a fresh engine (the oracle: one recording pass and one
run per candidate split, the best kept); after every run the model's JSON is rewritten (atomic rename), so a
sweep killed midway keeps what it measured and a rerun skips it (bench/phase_store.py). At the end of each
model: the Markdown table and the plots (bench/phase_report.py). A policy that cannot run (a plan refused, a
solver missing) gets a row with its reason; a policy that fails gets an "error" row and the sweep goes on.
It never asserts on a figure or hard-codes one.
"""

from __future__ import annotations

import dataclasses
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierplan.bench.baselines import BASELINES, make, oracle_splits
from tierplan.bench.baselines.base import FutureRecorder, PointContext, PolicyRun, Split, clamp_split, make_plan
from tierplan.bench.phase_grid import FULL, GIB, QUICK, Point, Sizes, points, select_points
from tierplan.bench.phase_metrics import Predictor, measured_row, refused_row
from tierplan.bench.phase_report import write_report
from tierplan.bench.phase_run import ModelHandle, Outcome, RunRefused, measure, open_model, point_context
from tierplan.bench.phase_store import code_id, latest, load_rows, run_key, write_rows
from tierplan.runtime.errors import ConfigError


class _Recording:
    """The oracle's recording pass at one split: its KV blocks (they set the schedule), experts as they come."""

    name, needs_future = "oracle-recording", False

    def __init__(self, split: Split) -> None:
        self.split = split

    def engine_options(self, ctx: PointContext) -> dict[str, Any]:
        return {}

    def start(self, engine: Any, ctx: PointContext) -> PolicyRun:
        split = clamp_split(ctx, self.split, engine)
        return PolicyRun(make_plan(ctx, split, "record", "the oracle's recording pass"), split=split)


def _tok_s(outcome: Outcome, warm_steps: int) -> float:
    timed = outcome.steps[min(warm_steps, max(0, len(outcome.steps) - 1)):]
    wall = sum(s.step_s for s in timed)
    return sum(s.tokens_out for s in timed) / wall if wall else 0.0


def _oracle(h: ModelHandle, ctx: PointContext, sizes: Sizes, workdir: Path, prefix_tokens: int) -> Outcome:
    """Each candidate split recorded once and run with Belady eviction from its own future; the best tok/s."""
    best: tuple[float, Outcome] | None = None
    tried: list[str] = []
    for split in oracle_splits(ctx, sizes.oracle_max_splits):
        rec = FutureRecorder(h.router)
        label = f"{split.expert_slots} slots/{split.kv_gpu_blocks} KV"
        try:
            measure(h, ctx, _Recording(split), sizes, workdir, prefix_tokens, router=rec)
            out = measure(h, dataclasses.replace(ctx, future=rec.future(split.kv_gpu_blocks), split=split),
                          make("oracle"), sizes, workdir, prefix_tokens)
        except RunRefused as exc:
            tried.append(f"{label}: refused ({exc})")
            continue
        tok_s = _tok_s(out, sizes.warm_steps)
        tried.append(f"{label}: {tok_s:.1f} tok/s")
        if best is None or tok_s > best[0]:
            best = (tok_s, out)
    if best is None:
        raise RunRefused("no candidate split could run: " + "; ".join(tried))
    out = best[1]
    out.notes = (out.notes + " | " if out.notes else "") + "splits tried: " + "; ".join(tried)
    return out


def _device_name(dev: Any) -> str:
    import torch

    return torch.cuda.get_device_name() if dev.is_cuda else f"cpu ({platform.processor() or platform.machine()})"


def _base_row(point: Point, ctx: PointContext | None, policy: str, device: str, code: str, sizes: Sizes) -> dict:
    gib = point.budget_label_gib if point.budget_frac is None else (ctx.hbm_budget_bytes / GIB if ctx else 0.0)
    return {"model": point.model, "layers": point.layers, "batch": point.batch, "context": point.context,
            "hbm_budget_gib": gib, "policy": policy, "device": device, "point": point.key, "code": code,
            "full_layers": point.full_layers, "budget_frac": point.budget_frac,
            "hbm_budget_bytes": ctx.hbm_budget_bytes if ctx else None, "quick": sizes.quick,
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def _one(h: ModelHandle, ctx: PointContext, prefix_tokens: int, policy: str, sizes: Sizes, predictor: Predictor,
         base: dict[str, Any], say: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tierplan-phase-") as tmp:
        try:
            baseline = make(policy)
            out = (_oracle(h, ctx, sizes, Path(tmp), prefix_tokens) if baseline.needs_future
                   else measure(h, ctx, baseline, sizes, Path(tmp), prefix_tokens))
        except RunRefused as exc:
            return refused_row(base, str(exc))
        except ImportError as exc:  # e.g. the controller's solver stack absent on the device image
            return refused_row(base, f"cannot run here: {type(exc).__name__}: {exc}")
        except Exception as exc:  # a failing policy must not end a scarce sweep; its row says what happened
            say(traceback.format_exc())
            return {**refused_row(base, f"{type(exc).__name__}: {exc}"), "status": "error"}
    return measured_row(base, out, sizes.warm_steps, predictor)


def run_phase_bench(out_dir: Path, device: str = "cpu", quick: bool = False, point_spec: str = "",
                    policies: tuple[str, ...] = (), models: tuple[str, ...] = (), fresh: bool = False,
                    console: Any = None, progress: Callable[[int], None] | None = None,
                    on_total: Callable[[int], None] | None = None,
                    requests_per_batch: float | None = None) -> dict[str, Path]:
    """Run the sweep (module docstring); returns {model: its JSON path}. ValueError for an unknown policy,
    model or point (nothing run). `on_total(n)` is told the number of runs still to do before the first.
    `requests_per_batch` overrides the sizes' (fewer requests: shorter runs at large batches); rows measured at
    other sizes are not reused (the sizes are part of a row's code id)."""
    from tierplan.runtime.device import Device

    sizes = QUICK if quick else FULL
    if requests_per_batch is not None:
        if not requests_per_batch > 0:
            raise ValueError(f"--requests-per-batch must be > 0, got {requests_per_batch}")
        sizes = dataclasses.replace(sizes, requests_per_batch=requests_per_batch)
    say = console.print if console is not None else print
    bad = [p for p in policies if p not in BASELINES]
    if bad:
        raise ValueError(f"unknown policy {bad}; expected some of {', '.join(BASELINES)}")
    known = tuple(m.name for m in sizes.models)
    if [m for m in models if m not in known]:
        raise ValueError(f"unknown model {[m for m in models if m not in known]} for this sweep; expected some of "
                         f"{', '.join(known)}" + ("" if quick else " (--quick runs 'tiny')"))
    grid = points(sizes, models)
    if point_spec:
        grid = select_points(grid, point_spec)
    pols = policies or BASELINES
    dev = Device(device)
    dev_name, code, day = _device_name(dev), code_id(repr(sizes)), time.strftime("%Y%m%d")
    plan: dict[str, tuple[Path, list[dict[str, Any]], list[Point]]] = {}
    todo = 0
    for m in dict.fromkeys(p.model for p in grid):
        path = out_dir / f"phase_{m}_{day}.json"
        rows = [] if fresh else load_rows(path)
        if not rows and not fresh:  # carry an earlier day's rows over (the sweep may span days)
            older = sorted(out_dir.glob(f"phase_{m}_*.json"))
            rows = load_rows(older[-1]) if older else []
        pts = [p for p in grid if p.model == m]
        done = {run_key(r) for r in rows}
        todo += sum((p.key, pol, dev_name, code) not in done for p in pts for pol in pols)
        plan[m] = (path, rows, pts)
    if on_total is not None:
        on_total(todo)
    import torch

    threads = torch.get_num_threads()
    if not dev.is_cuda:  # a tiny model's ops are too small to share: one thread keeps a busy CPU from stalling them
        torch.set_num_threads(1)
    try:
        _sweep(plan, pols, sizes, dev, dev_name, code, say, progress)
    finally:
        torch.set_num_threads(threads)
    return {m: v[0] for m, v in plan.items()}


def _sweep(plan: dict[str, tuple[Path, list[dict[str, Any]], list[Point]]], pols: tuple[str, ...], sizes: Sizes,
           dev: Any, dev_name: str, code: str, say: Any, progress: Callable[[int], None] | None) -> None:
    for m, (path, rows, pts) in plan.items():
        done = {run_key(r) for r in rows}
        if any((p.key, pol, dev_name, code) not in done for p in pts for pol in pols):
            _sweep_model(m, pts, pols, sizes, dev, dev_name, code, path, rows, done, say, progress)
        write_report(latest(rows, dev_name), path.with_suffix(""), sizes, dev_name)
        say(f"{m}: {len(rows)} rows in {path}")


def _calibrate(h: ModelHandle, point: Point, sizes: Sizes, predictor: Predictor, say: Any) -> None:
    """One `resident` pass at the model's first point, its windows folded into the cost model (no row): the
    first runs' predictions start from this machine's step times rather than the priors."""
    try:
        with tempfile.TemporaryDirectory(prefix="tierplan-phase-") as tmp:
            ctx, prefix_tokens = point_context(h, point, sizes)
            out = measure(h, ctx, make("resident"), sizes, Path(tmp), prefix_tokens)
    except Exception as exc:  # the sweep still runs: its first predictions then lean on the priors
        say(f"{h.spec.name}: no calibration pass ({type(exc).__name__}: {exc}); the cost model starts from its "
            "priors")
        return
    predictor.calibrate(out.telemetry)


def _sweep_model(m: str, pts: list[Point], pols: tuple[str, ...], sizes: Sizes, dev: Any, dev_name: str, code: str,
                 path: Path, rows: list[dict[str, Any]], done: set, say: Any,
                 progress: Callable[[int], None] | None) -> None:
    sweep = next(s for s in sizes.models if s.name == m)
    h = open_model(m, sweep.layers, sweep.full_layers, dev, say)
    predictor = Predictor.for_model(h)
    try:
        _calibrate(h, pts[0], sizes, predictor, say)
        for p in pts:
            left = [pol for pol in pols if (p.key, pol, dev_name, code) not in done]
            if not left:
                continue
            ctx: PointContext | None = None
            prefix_tokens, why = 0, ""
            try:
                ctx, prefix_tokens = point_context(h, p, sizes)
            except ConfigError as exc:
                why = str(exc)
            for pol in left:
                t0 = time.perf_counter()
                base = _base_row(p, ctx, pol, dev_name, code, sizes)
                row = (refused_row(base, why) if ctx is None
                       else _one(h, ctx, prefix_tokens, pol, sizes, predictor, base, say))
                row["run_s"] = time.perf_counter() - t0
                rows.append(row)
                write_rows(path, rows)
                if progress is not None:
                    progress(1)
                tok = f"{row['decode_tok_s']:.1f} tok/s" if row["decode_tok_s"] is not None else row["status"]
                say(f"{p.key} {pol}: {tok} ({row['run_s']:.1f} s) {row['notes'][:120] if row['notes'] else ''}")
    finally:
        h.close()
