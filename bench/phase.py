"""`tierplan bench phase`: every policy on the same engine, traces and HBM budget, over batch x context x budget.

Runs in one process on one device (`--quick`: the CPU smoke sizes of bench/phase_grid.py, no figure to quote).
Per model: the pinned store, dense weights, router and sizes are built once (bench/phase_run.py `open_model`)
and shared by every run's engine; per point, each policy runs once on a fresh engine (the oracle: per candidate
split one run, the best kept, on the access stream a CPU replay of the runner's scheduler records for that split,
bench/baselines/dry_record.py; `OracleRecording.ENGINE` records it on an engine instead, and checks the replay
against it in the row's notes). After every run its row is merged into the model's JSON under a
file lock (bench/phase_store.py), the oracle's candidate splits each as they finish, so a sweep killed midway
keeps what it measured and a rerun resumes it, inside the oracle's search too; rows with a result (ok or
degraded) are skipped on a rerun, error and refused rows run again. At the end of each model: the Markdown
table and the plots (bench/phase_report.py). A policy that cannot run (a plan refused, a solver missing, a
point below the least any policy needs) gets a row with its reason; a policy that fails gets an "error" row
and the sweep goes on. Every run's line names its seconds. It never asserts on a figure or hard-codes one.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from enum import Enum
from pathlib import Path
from typing import Any

from tierplan.bench.baselines import BASELINES, POLICIES, make, oracle_splits
from tierplan.bench.baselines.base import (
    ExpertFuture,
    FutureRecorder,
    PointContext,
    PolicyRun,
    Split,
    clamp_split,
    make_plan,
)
from tierplan.bench.baselines.dry_record import difference, dry_record
from tierplan.bench.oracle_estimate import DryStep, estimate_tok_s, measure_order
from tierplan.bench.phase_grid import FULL, GIB, QUICK, Point, RunStop, Sizes, points, select_points
from tierplan.bench.phase_metrics import measured_row, refused_row, request_mean
from tierplan.bench.phase_predictor import Predictor
from tierplan.bench.phase_pricing import fold_settled
from tierplan.bench.phase_report import device_stems, write_report
from tierplan.bench.phase_run import (
    ModelHandle,
    Outcome,
    RunRefused,
    engine_config,
    measure,
    open_model,
    point_context,
)
from tierplan.bench.phase_shards import PointQueue, point_spec
from tierplan.bench.phase_steps import CALIBRATION, WARMUP, append_steps, steps_line, steps_path
from tierplan.bench.phase_store import (
    CANDIDATE,
    append_row,
    code_id,
    done_keys,
    latest,
    load_rows,
    merge_file,
    repeat_of,
)
from tierplan.bench.phase_timing import MODEL_OPEN_S, estimate_point_s
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


class OracleRecording(Enum):
    """How the oracle gets each candidate split's access stream."""

    DRY = "dry"  # replayed on the CPU (bench/baselines/dry_record.py): no engine run
    ENGINE = "engine"  # recorded on an engine run (the check): the replay is compared to it, the notes say how


def _dry(h: ModelHandle, ctx: PointContext, split: Split, sizes: Sizes, workdir: Path,
         steps_out: list[DryStep] | None = None) -> ExpertFuture:
    """The access stream at `split` by the dry replay (its steps to `steps_out`). RunRefused where the run could
    not take place under the split (the runner's ConfigError)."""
    try:
        return dry_record(ctx, split, h.router, virtual_step_s=sizes.virtual_step_s,
                          engine_gpu_blocks=engine_config(h, ctx, {}, workdir).kv_gpu_blocks,
                          stop=RunStop.of(sizes), steps_out=steps_out)
    except ConfigError as exc:
        raise RunRefused(f"the point cannot run under this plan: {exc}") from exc


def _future(h: ModelHandle, ctx: PointContext, split: Split, sizes: Sizes, workdir: Path, prefix_tokens: int,
            how: OracleRecording, dry: ExpertFuture | None = None) -> tuple[ExpertFuture, str]:
    """The access stream at `split` (`dry`: its dry replay, where the search priced it already), and what the
    row's notes say about it (the check's verdict; "" for DRY). RunRefused as `_dry`."""
    dry = dry if dry is not None else _dry(h, ctx, split, sizes, workdir)
    if how is OracleRecording.DRY:
        return dry, ""
    rec = FutureRecorder(h.router)
    measure(h, ctx, _Recording(split), sizes, workdir, prefix_tokens, router=rec)
    recorded = rec.future(split.kv_gpu_blocks)
    diff = difference(dry, recorded)
    return recorded, ("engine recording; the dry replay equals it" if diff is None
                      else f"engine recording; the dry replay DIFFERS: {diff}")


class _Store:
    """One model's JSON as this process sees it: every row is merged into the file under its lock, and the
    file's rows (other writers' included) come back."""

    def __init__(self, path: Path, rows: list[dict[str, Any]], seed: list[dict[str, Any]], fresh: bool,
                 save_steps: bool = False) -> None:
        self.path, self.rows, self.seed, self.save_steps = path, rows, seed, save_steps
        self.done = set() if fresh else done_keys(rows)
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"  # this process's rows
        self.fresh = fresh

    def add(self, row: dict[str, Any]) -> None:
        self.rows = append_row(self.path, {**row, "run_id": self.run_id}, self.seed)

    def add_steps(self, row: dict[str, Any], outcome: Any, ctx: PointContext) -> None:
        """With `save_steps`: the run's steps to this process's steps file (phase_steps.py)."""
        if self.save_steps:
            append_steps(steps_path(self.path, self.run_id),
                         steps_line({**row, "run_id": self.run_id}, outcome, ctx.expert_stride_bytes,
                                    ctx.kv_block_bytes))

    def candidates(self, point: str, device: str, code: str, repeat: int = 0) -> dict[str, dict[str, Any]]:
        """The oracle's finished candidate splits at `point` in `repeat` (by split label; --fresh: this process's
        only)."""
        return {r["oracle_split"]: r for r in self.rows
                if r.get("status") == CANDIDATE and (r["point"], r["device"], r["code"]) == (point, device, code)
                and repeat_of(r) == repeat and (not self.fresh or r.get("run_id") == self.run_id)}

    def todo(self, point: Point, pols: tuple[str, ...], device: str, code: str, repeats: int) -> list[tuple[int, str]]:
        """The (repeat, policy) runs of `point` still to do, in the order they run: round r takes the policies in
        order when r is even, reversed when odd (a drift over a point's runs then falls on every policy alike)."""
        return [(r, pol) for r in range(repeats) for pol in (pols if r % 2 == 0 else pols[::-1])
                if (point.key, pol, device, code, r) not in self.done]


def _split_label(split: Split) -> str:
    return f"{split.expert_slots} slots {list(split.expert_slots_per_layer)}/{split.kv_gpu_blocks} KV"


def _price_pool(h: ModelHandle, ctx: PointContext, pool: list[Split], sizes: Sizes, workdir: Path,
                predictor: Predictor, tried: list[str]) -> tuple[dict[str, float], dict[str, ExpertFuture]]:
    """Each split of the oracle's pool priced (bench/oracle_estimate.py) by label, and its dry replay; a split
    the replay refuses is named in `tried` and left out."""
    estimates: dict[str, float] = {}
    futures: dict[str, ExpertFuture] = {}
    for split in pool:
        label, steps = _split_label(split), []
        try:
            futures[label] = _dry(h, ctx, split, sizes, workdir, steps)
        except RunRefused as exc:
            tried.append(f"{label}: refused ({exc})")
            continue
        estimates[label] = estimate_tok_s(predictor, split, futures[label], steps, sizes.warm_steps)
    return estimates, futures


def _oracle(h: ModelHandle, ctx: PointContext, sizes: Sizes, workdir: Path, prefix_tokens: int,
            predictor: Predictor, base: dict[str, Any], store: _Store, say: Any,
            how: OracleRecording = OracleRecording.DRY) -> dict[str, Any]:
    """The search (oracle.py, bench/oracle_estimate.py): where the pool holds more splits than the oracle may
    measure, each is priced first and only the best priced are run (one the run refuses makes way for the next);
    each run's future recorded (`how`) and run with Belady eviction from it, its row saved as it finishes (a
    candidate already in the file is not run again, and counts among those measured); the row of the best
    tok/s."""
    done = store.candidates(base["point"], base["device"], base["code"], base.get("repeat", 0))
    best: dict[str, Any] | None = None
    tried: list[str] = []
    pool = oracle_splits(ctx, sizes.oracle_pool_splits)
    labels = [_split_label(s) for s in pool]
    by_label = dict(zip(labels, pool, strict=True))
    estimates: dict[str, float] = {}
    futures: dict[str, ExpertFuture] = {}
    order, quota = labels, len(labels)
    if len(pool) > sizes.oracle_max_splits:
        estimates, futures = _price_pool(h, ctx, pool, sizes, workdir, predictor, tried)
        order, quota = measure_order(labels, estimates, set(done)), sizes.oracle_max_splits
        say(f"{base['point']} oracle: {len(pool)} splits priced, best first: " + "; ".join(
            f"{lb} {estimates[lb]:.0f} tok/s" for lb in order if lb in estimates))
    measured: list[str] = []
    for label in order:
        if len(measured) >= quota:
            break
        split = by_label[label]
        row = done.get(label)
        if row is None:
            t0 = time.perf_counter()
            try:
                future, checked = _future(h, ctx, split, sizes, workdir, prefix_tokens, how, futures.get(label))
                out = measure(h, dataclasses.replace(ctx, future=future, split=split), make("oracle"), sizes, workdir,
                              prefix_tokens)
            except RunRefused as exc:  # the next in the order takes its place
                tried.append(f"{label}: refused ({exc})")
                continue
            row = measured_row(base, out, sizes.warm_steps, predictor, request_mean(ctx.requests))
            if checked:
                row["notes"] = (row["notes"] + " | " if row["notes"] else "") + checked
            row = {**row, "candidate_status": row["status"], "status": CANDIDATE, "oracle_split": label,
                   "run_s": time.perf_counter() - t0}
            store.add(row)
            store.add_steps(row, out, ctx)
            say(f"{base['point']} oracle candidate {label}: {row['decode_tok_s']:.1f} tok/s ({row['run_s']:.1f} s)")
            tried.append(f"{label}: {row['decode_tok_s']:.1f} tok/s")
        else:
            tried.append(f"{label}: {row['decode_tok_s']:.1f} tok/s (saved)")
        measured.append(label)
        if best is None or row["decode_tok_s"] > best["decode_tok_s"]:
            best = row
    if best is None:
        raise RunRefused("no candidate split could run: " + "; ".join(tried))
    out_row = {k: v for k, v in best.items() if k not in ("candidate_status", "run_id", "run_s")}
    out_row["status"] = best["candidate_status"]
    out_row["search_s"] = sum(r.get("run_s", 0.0) for r in store.candidates(base["point"], base["device"],
                                                                             base["code"], base.get("repeat", 0)
                                                                             ).values())
    priced = ("; splits priced, not run: " + "; ".join(f"{lb}: {estimates[lb]:.0f} tok/s priced" for lb in labels
                                                        if lb in estimates and lb not in measured)) if estimates else ""
    out_row["notes"] = (best["notes"] + " | " if best["notes"] else "") + "splits tried: " + "; ".join(tried) + priced
    if estimates:
        out_row["oracle_priced"] = {lb: round(v, 1) for lb, v in estimates.items()}
    return out_row


def _device_name(dev: Any) -> str:
    import torch

    return torch.cuda.get_device_name() if dev.is_cuda else f"cpu ({platform.processor() or platform.machine()})"


def _base_row(point: Point, ctx: PointContext | None, policy: str, device: str, code: str, sizes: Sizes,
              repeat: int = 0) -> dict:
    gib = point.budget_label_gib if point.budget_frac is None else (ctx.hbm_budget_bytes / GIB if ctx else 0.0)
    return {"model": point.model, "layers": point.layers, "batch": point.batch, "context": point.context,
            "hbm_budget_gib": gib, "policy": policy, "device": device, "point": point.key, "code": code,
            "repeat": repeat,
            "full_layers": point.full_layers, "budget_frac": point.budget_frac,
            "hbm_budget_bytes": ctx.hbm_budget_bytes if ctx else None, "quick": sizes.quick,
            # The host link as this process measured it when it opened the model, and the GPU it ran on: workers of
            # one host that share a PCIe switch would show it here (a lower figure) and in their link-bound steps.
            "link_gb_s": ctx.link_bytes_per_s / 1e9 if ctx else None,
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}


RUN_LINK_PROBE_BYTES = 64 << 20  # the pinned host->device copy probed before each run (a few ms on a GPU)


def _run_link_gb_s(h: ModelHandle) -> float | None:
    """The host link's bandwidth just before a run (`run_link_gb_s`: the report names a run that met a slower one
    than the run it is set against), None on the CPU, where the link is a nominal figure."""
    if not h.dev.is_cuda:
        return None
    from tierplan.bench.offload import link_gb_s

    return link_gb_s(h.dev, RUN_LINK_PROBE_BYTES, reps=3)


def _one(h: ModelHandle, ctx: PointContext, prefix_tokens: int, policy: str, sizes: Sizes, predictor: Predictor,
         base: dict[str, Any], store: _Store, say: Any, how: OracleRecording) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tierplan-phase-") as tmp:
        try:
            baseline = make(policy)
            if baseline.needs_future:
                return _oracle(h, ctx, sizes, Path(tmp), prefix_tokens, predictor, base, store, say, how)
            out = measure(h, ctx, baseline, sizes, Path(tmp), prefix_tokens)
            row = measured_row(base, out, sizes.warm_steps, predictor, request_mean(ctx.requests))
        except RunRefused as exc:
            return refused_row(base, str(exc))
        except ImportError as exc:  # e.g. the controller's solver stack absent on the device image
            return refused_row(base, f"cannot run here: {type(exc).__name__}: {exc}")
        except Exception as exc:  # a failing policy must not end a scarce sweep; its row says what happened
            say(traceback.format_exc())
            return {**refused_row(base, f"{type(exc).__name__}: {exc}"), "status": "error"}
    store.add_steps(row, out, ctx)
    return row


def run_phase_bench(out_dir: Path, device: str = "cpu", quick: bool = False, point_spec: str = "",
                    policies: tuple[str, ...] = (), models: tuple[str, ...] = (), fresh: bool = False,
                    console: Any = None, progress: Callable[[int], None] | None = None,
                    on_total: Callable[[int], None] | None = None,
                    requests_per_batch: float | None = None,
                    oracle_recording: OracleRecording = OracleRecording.DRY, report: bool = True,
                    save_steps: bool = False, repeats: int | None = None,
                    queue: Path | None = None, deadline_s: float | None = None,
                    planner_cores: int | None = None, unmeasured: bool = False) -> dict[str, Path]:
    """Run the sweep (module docstring); returns {model: its JSON path}. ValueError for an unknown policy,
    model or point (nothing run). `on_total(n)` is told the number of runs still to do before the first.
    `requests_per_batch` overrides the sizes' (fewer requests: shorter runs at large batches); rows measured at
    other sizes are not reused (the sizes are part of a row's code id). `oracle_recording`: how the oracle's
    candidate futures are recorded (`OracleRecording.ENGINE`: on an engine, the dry replay checked against it).
    report=False: rows only (a worker of a sweep over several GPUs, phase_shards.py, whose parent reports).
    save_steps: every run's steps too, beside the JSON (phase_steps.py). `repeats` overrides the sizes' (runs of
    each policy at a point; another measurement, as `requests_per_batch`). `queue`: the points come from this
    queue file (a worker of a sweep over several GPUs), claimed one at a time, instead of `point_spec`.
    `deadline_s`: start no point whose runs would end later than this many seconds from now (`phase_timing`;
    skipped points are named, and a rerun takes them up). `planner_cores` overrides the sizes' (the CPUs a live
    policy's controller process may use; 0: all). `unmeasured`: only the selected points no row of this device
    holds yet, whatever its code or status (a device's coverage first: an H200 lent now and then fills its missing
    points, and a call cut short resumes with those it left)."""
    from tierplan.runtime.device import Device

    if deadline_s is not None and not deadline_s > 0:
        raise ValueError(f"--deadline-s must be > 0, got {deadline_s}")
    deadline = None if deadline_s is None else time.perf_counter() + deadline_s
    claims = PointQueue(queue) if queue is not None else None
    if claims is not None:
        if unmeasured:
            raise ValueError("--unmeasured selects points on one GPU; with a queue of points (--gpus N), list them")
        point_spec = ",".join(claims.specs())
        if not point_spec:
            raise ValueError(f"--queue {queue}: it holds no points")
    sizes, grid = sweep_grid(quick, point_spec, policies, models, requests_per_batch, repeats, planner_cores)
    say = console.print if console is not None else print
    pols = policies or BASELINES
    dev = Device(device)
    dev_name, code, day = _device_name(dev), code_id(repr(sizes)), time.strftime("%Y%m%d")
    plan: dict[str, tuple[_Store, list[Point]]] = {}
    todo = 0
    for m in dict.fromkeys(p.model for p in grid):
        path = out_dir / f"phase_{m}_{day}.json"
        rows, seed = load_rows(path), []
        if not path.exists():  # carry an earlier day's rows over (the sweep may span days)
            older = sorted(out_dir.glob(f"phase_{m}_*.json"))
            rows = seed = load_rows(older[-1]) if older else []
        store = _Store(path, rows, seed, fresh, save_steps)
        pts = [p for p in grid if p.model == m]
        if unmeasured:
            seen = {r.get("point") for r in rows if r.get("device") == dev_name}
            say(f"{m}: --unmeasured: {sum(p.key in seen for p in pts)} of {len(pts)} selected point(s) already have "
                f"rows from {dev_name}; {sum(p.key not in seen for p in pts)} to run")
            pts = [p for p in pts if p.key not in seen]
        todo += sum(len(store.todo(p, pols, dev_name, code, sizes.repeats)) for p in pts)
        plan[m] = (store, pts)
    if on_total is not None:
        on_total(todo)
    import torch

    threads = torch.get_num_threads()
    if not dev.is_cuda:  # a tiny model's ops are too small to share: one thread keeps a busy CPU from stalling them
        torch.set_num_threads(1)
    from tierplan.bench.baselines.plan_process import engine_confined

    try:  # the engine's threads off the CPUs a live policy's planner process runs on (plan_process.py)
        with engine_confined(sizes.planner_cores):
            _sweep(plan, pols, sizes, dev, dev_name, code, say, progress, oracle_recording, report, claims, deadline)
    finally:
        torch.set_num_threads(threads)
    return {m: v[0].path for m, v in plan.items()}


def sweep_grid(quick: bool = False, point_spec: str = "", policies: tuple[str, ...] = (),
               models: tuple[str, ...] = (), requests_per_batch: float | None = None,
               repeats: int | None = None, planner_cores: int | None = None) -> tuple[Sizes, list[Point]]:
    """The sweep's sizes and its points (`--points` / `--models` applied); ValueError for an unknown policy,
    model or point, or a bad `requests_per_batch`, `repeats` or `planner_cores` (nothing run)."""
    sizes = QUICK if quick else FULL
    if requests_per_batch is not None:
        if not requests_per_batch > 0:
            raise ValueError(f"--requests-per-batch must be > 0, got {requests_per_batch}")
        sizes = dataclasses.replace(sizes, requests_per_batch=requests_per_batch)
    if repeats is not None:
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"--repeats must be an integer >= 1, got {repeats!r}")
        sizes = dataclasses.replace(sizes, repeats=repeats)
    if planner_cores is not None:
        if isinstance(planner_cores, bool) or not isinstance(planner_cores, int) or planner_cores < 0:
            raise ValueError(f"--planner-cores must be an integer >= 0 (0: every CPU), got {planner_cores!r}")
        sizes = dataclasses.replace(sizes, planner_cores=planner_cores)
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown policy {bad}; expected some of {', '.join(POLICIES)}")
    known = tuple(m.name for m in sizes.models)
    if [m for m in models if m not in known]:
        raise ValueError(f"unknown model {[m for m in models if m not in known]} for this sweep; expected some of "
                         f"{', '.join(known)}" + ("" if quick else " (--quick runs 'tiny')"))
    grid = points(sizes, models)
    return sizes, select_points(grid, point_spec) if point_spec else grid


def merge_results(out_dir: Path, sources: list[Path]) -> list[tuple[Path, int]]:
    """Each of `sources` (a phase JSON another call wrote, e.g. a device run's copy) merged into the file of the
    same name in `out_dir`, its reports rewritten from the merged rows, one per device (no device needed here:
    an H200's rows report on a CPU box). (target, rows added) per source; ValueError naming a file
    that is missing or not phase rows (nothing of it merged)."""
    out, merged = [], {}
    try:
        for src in sources:
            if not src.is_file():
                raise ValueError(f"--merge {src}: no such file")
            target = out_dir / src.name
            if target.resolve() == src.resolve():
                raise ValueError(f"--merge {src}: that is the file it would merge into; name a copy from another "
                                 "call")
            merged[target], added = merge_file(target, src)
            out.append((target, added))
    finally:  # one report per file, from all its merges (those before a refused source too)
        for target, rows in merged.items():
            if rows:
                write_reports_by_device(rows, target.with_suffix(""), QUICK if rows[-1].get("quick") else FULL)
    return out


def write_reports_by_device(rows: list[dict[str, Any]], stem: Path, sizes: Sizes) -> list[Path]:
    """One report per device the rows ran on (`phase_report.device_stems`); the paths written."""
    return [p for dev, dev_stem in device_stems(rows, stem).items()
            for p in write_report(latest(rows, dev), dev_stem, sizes, dev)]


def write_reports(out_dir: Path, models: list[str], sizes: Sizes, day: str) -> dict[str, Path]:
    """Each model's reports (one per device its rows ran on) from its JSON of `day` (YYYYMMDD: the day the
    sweep's workers started, whose JSON every worker merged its rows into)."""
    out = {}
    for m in models:
        path = out_dir / f"phase_{m}_{day}.json"
        rows = load_rows(path)
        if rows:
            write_reports_by_device(rows, path.with_suffix(""), sizes)
            out[m] = path
    return out


def _sweep(plan: dict[str, tuple[_Store, list[Point]]], pols: tuple[str, ...], sizes: Sizes, dev: Any, dev_name: str,
           code: str, say: Any, progress: Callable[[int], None] | None, how: OracleRecording,
           report: bool = True, queue: PointQueue | None = None, deadline: float | None = None) -> None:
    for m, (store, pts) in plan.items():
        _sweep_model(m, pts if queue is None else _claimed(queue, m, pts), pols, sizes, dev, dev_name, code, store,
                     say, progress, how, deadline)
        if store.rows and report:
            write_reports_by_device(store.rows, store.path.with_suffix(""), sizes)
        say(f"{m}: {len(store.rows)} rows in {store.path}")


def _claimed(queue: PointQueue, model: str, pts: list[Point]) -> Iterator[Point]:
    """`model`'s points as this process claims them from `queue`, one at a time (each claim names the point it
    took among `pts`, the queue's points of this model)."""
    by_spec = {point_spec(p): p for p in pts}
    while (spec := queue.claim(str(os.getpid()), model)) is not None:
        yield by_spec[spec]


def _discarded_run(h: ModelHandle, ctx: PointContext, prefix_tokens: int, policy: str, sizes: Sizes) -> Outcome:
    """One run of `policy` at the point that makes no row (the calibration pass, the warm-up); its outcome."""
    with tempfile.TemporaryDirectory(prefix="tierplan-phase-") as tmp:
        return measure(h, ctx, make(policy), sizes, Path(tmp), prefix_tokens)


def _fold_settled(predictor: Predictor, out: Outcome, sizes: Sizes) -> None:
    """Fold a discarded run's steps past its warm-up (the last one at least) into the cost model, each at its place
    in the run's telemetry windows: its first steps compile kernels (up to 2.1 s against a 4-10 ms median in H200
    runs 27 and 29), and a run of such outliers loosens the fit's outlier cut (costmodel_fit.OnlineLinear; a review
    replayed a cold prefix folded in before each point's first run: 11 of 24 within 15 % against 14 with it left
    out)."""
    fold_settled(predictor, out.steps, sizes.warm_steps, out.window_steps)


def _keep_discarded(store: _Store, point: Point, ctx: PointContext, policy: str, status: str, out: Outcome,
                    ident: tuple[str, str], sizes: Sizes) -> None:
    """A discarded run's steps to the steps file (`store.add_steps`, with `save_steps`), its status saying which
    (`phase_steps.DISCARDED`): no row, but the cost model's replay folds them in where the process did."""
    device, code = ident
    store.add_steps({**_base_row(point, ctx, policy, device, code, sizes), "status": status,
                     "warm_steps": sizes.warm_steps}, out, ctx)


def _calibrate(h: ModelHandle, point: Point, sizes: Sizes, predictor: Predictor, say: Any,
               store: _Store | None = None, ident: tuple[str, str] = ("", "")) -> None:
    """One `resident` pass at the model's first point, its settled steps folded into the cost model (no row):
    the first runs' predictions start from this machine's step times rather than the priors. With `store`, its
    steps are kept (`_keep_discarded`; `ident`: the rows' device and code)."""
    try:
        ctx, prefix_tokens = point_context(h, point, sizes)
        out = _discarded_run(h, ctx, prefix_tokens, "resident", sizes)
    except Exception as exc:  # the sweep still runs: its first predictions then lean on the priors
        say(f"{h.spec.name}: no calibration pass ({type(exc).__name__}: {exc}); the cost model starts from its "
            "priors")
        return
    _fold_settled(predictor, out, sizes)
    if store is not None:
        _keep_discarded(store, point, ctx, "resident", CALIBRATION, out, ident, sizes)


def _warm_up(h: ModelHandle, ctx: PointContext, prefix_tokens: int, sizes: Sizes, predictor: Predictor,
             say: Any, store: _Store | None = None, point: Point | None = None,
             ident: tuple[str, str] = ("", "")) -> str | None:
    """One discarded run of each of `sizes.warmup_policies` at the point, in order (no row): the kernels their
    steps need are compiled before the first measured run, and their settled steps are folded into the cost model,
    so the point's first row is predicted from a fit that has seen the point, as the later ones are (the first
    policy, tierplan, was priced from the previous point's fit: replayed over runs 01-40, 9 of its 24 runs within
    15 % at the predicted misses, 14 with the point's static_lru run folded in first). The names of those that
    ran, joined by "+", or None where none did (each failure said; the runs still go, as the rows' `warmed_by`
    tells). With `store` and `point`, their steps are kept (`_keep_discarded`)."""
    ran = []
    for policy in sizes.warmup_policies:
        t0 = time.perf_counter()
        try:
            out = _discarded_run(h, ctx, prefix_tokens, policy, sizes)
        except Exception as exc:
            say(f"warm-up run ({policy}) failed, the point's runs go on without it: {type(exc).__name__}: {exc}")
            continue
        _fold_settled(predictor, out, sizes)
        if store is not None and point is not None:
            _keep_discarded(store, point, ctx, policy, WARMUP, out, ident, sizes)
        say(f"warm-up run ({policy}, discarded): {time.perf_counter() - t0:.1f} s")
        ran.append(policy)
    return "+".join(ran) or None


def _sweep_model(m: str, pts: Iterable[Point], pols: tuple[str, ...], sizes: Sizes, dev: Any, dev_name: str,
                 code: str, store: _Store, say: Any, progress: Callable[[int], None] | None,
                 how: OracleRecording, deadline: float | None = None) -> None:
    """Every run left at `pts`, taken in order (a queue's claims are taken as the runs go); the model is opened
    and its cost model calibrated at the first point with a run to do, so a model with none is never opened.
    `deadline` (`time.perf_counter()` seconds): a point whose runs would end past it by `phase_timing`'s
    estimate is skipped and named (a later call runs it)."""
    sweep = next(s for s in sizes.models if s.name == m)
    h: ModelHandle | None = None
    predictor: Predictor | None = None
    try:
        for p in pts:
            left = store.todo(p, pols, dev_name, code, sizes.repeats)
            if not left:
                continue
            runs = [pol for _, pol in left] + list(sizes.warmup_policies)  # + its warm-up
            if deadline is not None and (est := estimate_point_s(store.rows, p, runs, dev_name)) is not None:
                est += MODEL_OPEN_S if h is None else 0.0
                if est > (left_s := deadline - time.perf_counter()):
                    warm = " and its warm-up" if sizes.warmup_policies else ""
                    say(f"{p.key}: skipped, not started: its {len(left)} run(s){warm} took ~{est:.0f} s at the "
                        f"nearest point measured here, and {max(0.0, left_s):.0f} s are left before --deadline-s")
                    continue
            if h is None:
                h = open_model(m, sweep.layers, sweep.full_layers, dev, say)
                predictor = Predictor.for_model(h)
                _calibrate(h, p, sizes, predictor, say, store, (dev_name, code))
            assert predictor is not None
            ctx: PointContext | None = None
            prefix_tokens, why = 0, ""
            try:
                ctx, prefix_tokens = point_context(h, p, sizes)
            except ConfigError as exc:
                why = str(exc)
            warmed = (_warm_up(h, ctx, prefix_tokens, sizes, predictor, say, store, p, (dev_name, code))
                      if ctx is not None else None)
            for rep, pol in left:
                t0 = time.perf_counter()
                base = {**_base_row(p, ctx, pol, dev_name, code, sizes, rep),
                        "run_link_gb_s": _run_link_gb_s(h) if ctx is not None else None}  # a refused run: no probe
                row = (refused_row(base, why) if ctx is None
                       else _one(h, ctx, prefix_tokens, pol, sizes, predictor, base, store, say, how))
                row["run_s"] = time.perf_counter() - t0
                row["warmed_by"] = warmed
                store.add(row)
                if progress is not None:
                    progress(1)
                tok = f"{row['decode_tok_s']:.1f} tok/s" if row["decode_tok_s"] is not None else row["status"]
                again = f" (repeat {rep})" if rep else ""
                say(f"{p.key} {pol}{again}: {tok} ({row['run_s']:.1f} s) {row['notes'][:120] if row['notes'] else ''}")
    finally:
        if h is not None:
            h.close()
