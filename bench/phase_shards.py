"""The phase sweep spread over several GPUs of one host: one bench process per GPU, each on its own share of the
points, all writing the same JSON (phase_store.py merges their rows under its file lock).

Runs in the user's shell process, which only plans, launches and waits; each worker is `tierplan bench phase`
itself with `--points` set to its share and `CUDA_VISIBLE_DEVICES` to its GPU (a worker sees one device, as the
single-GPU sweep does), its output in `phase_worker<i>.log` beside the JSON. Points go to workers round-robin in
sweep order, so each gets a mix of batches and contexts. Once every worker has ended, the report is written once
from the merged rows. A worker that fails is reported with its exit code and the last line of its log; the rows
it finished stay, and a rerun resumes from them (ok and degraded runs are skipped). Never measures anything
itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tierplan.bench.phase_grid import Point


def point_spec(p: Point) -> str:
    """The `--points` pattern that selects exactly `p` in its grid."""
    budget = f"f{p.budget_frac:g}" if p.budget_frac is not None else f"g{p.budget_label_gib:g}"
    return f"{p.model}:b{p.batch}c{p.context}{budget}"


def shares(points: Sequence[Point], num_workers: int) -> list[list[Point]]:
    """Round-robin shares of `points` (sweep order kept within each); empty shares are dropped."""
    if num_workers < 1:
        raise ValueError(f"workers must be >= 1, got {num_workers}")
    return [s for s in (list(points[i::num_workers]) for i in range(num_workers)) if s]


@dataclass
class WorkerResult:
    index: int
    device: str | None  # the CUDA_VISIBLE_DEVICES it ran with (None: unchanged)
    points: list[str]
    returncode: int
    log: Path
    last_line: str


def visible_devices(num_workers: int) -> list[str]:
    """The device each worker sees: the i-th of this process's CUDA_VISIBLE_DEVICES, or GPU i."""
    seen = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if seen and len(seen) < num_workers:
        raise ValueError(f"{num_workers} workers, but CUDA_VISIBLE_DEVICES names {len(seen)} device(s): {seen}")
    return seen[:num_workers] if seen else [str(i) for i in range(num_workers)]


def run_workers(points: Sequence[Point], num_workers: int, args: list[str], out_dir: Path, cuda: bool,
                on_done: Callable[[WorkerResult], None] | None = None) -> list[WorkerResult]:
    """Launch one `tierplan bench phase` per share (`args`: the sweep's other options, without --points and
    --out-dir), each on its own GPU when `cuda`, wait for all, and return how each ended (in launch order)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = shares(points, num_workers)
    devices = visible_devices(len(parts)) if cuda else [None] * len(parts)
    procs = []
    for i, (part, dev) in enumerate(zip(parts, devices, strict=True)):
        specs = [point_spec(p) for p in part]
        env = {**os.environ, "COLUMNS": "250"}  # rich leaves a log's lines unwrapped: the last one is the error
        if dev is not None:
            env["CUDA_VISIBLE_DEVICES"] = dev
        log = out_dir / f"phase_worker{i}.log"
        cmd = [sys.executable, "-m", "tierplan.api.cli", "bench", "phase", *args, "--points", ",".join(specs),
               "--out-dir", str(out_dir), "--no-report"]
        with log.open("w") as fh:
            procs.append((i, dev, specs, log, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)))
    results = []
    for i, dev, specs, log, proc in procs:
        rc = proc.wait()
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        res = WorkerResult(i, dev, specs, rc, log, lines[-1] if lines else "")
        results.append(res)
        if on_done is not None:
            on_done(res)
    return results
