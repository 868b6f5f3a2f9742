"""The phase sweep spread over several GPUs of one host: one bench process per GPU, each taking points from one
shared queue, all writing the same JSON (phase_store.py merges their rows under its file lock).

Runs in the user's shell process, which only plans, launches and waits; each worker is `tierplan bench phase`
itself with `--queue` naming the queue file and `CUDA_VISIBLE_DEVICES` its GPU (a worker sees one device, as the
single-GPU sweep does), its output in `phase_worker<i>.log` beside the JSON. A worker claims one point at a time
(`PointQueue.claim`, under the JSON folder's lock), its current model's points first in sweep order, so no GPU
idles while points are left (a fixed share per worker left some GPUs idle behind one worker's heavy points) and
each worker opens each model at most once. Once every worker has ended, the report is written once from the
merged rows. A worker that fails is reported with its exit code and the last line of its log; the rows it
finished stay, and a rerun resumes from them (ok and degraded runs are skipped); the point it held is not handed
to another worker in that sweep. Never measures anything itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierplan.bench.phase_grid import Point
from tierplan.bench.phase_store import locked, write_json


def point_spec(p: Point) -> str:
    """The `--points` pattern that selects exactly `p` in its grid."""
    budget = f"f{p.budget_frac:g}" if p.budget_frac is not None else f"g{p.budget_label_gib:g}"
    return f"{p.model}:b{p.batch}c{p.context}{budget}"


class PointQueue:
    """The points of one sweep (their `point_spec`s, in sweep order) and which worker claimed each, in one JSON file
    that every worker reads and writes under the folder's lock."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, path: Path, points: Sequence[Point]) -> PointQueue:
        with locked(path):
            write_json(path, {"points": [point_spec(p) for p in points], "claims": {}})
        return cls(path)

    def _read(self) -> dict[str, Any]:
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--queue {self.path}: not a readable point queue ({exc})") from exc
        if not (isinstance(state, dict) and isinstance(state.get("points"), list)
                and isinstance(state.get("claims"), dict)):
            raise ValueError(f"--queue {self.path}: expected an object with 'points' (a list) and 'claims'")
        return state

    def specs(self) -> list[str]:
        return list(self._read()["points"])

    def claims(self) -> dict[str, str]:
        """{spec: the worker that claimed it}."""
        return dict(self._read()["claims"])

    def claim(self, worker: str, model: str) -> str | None:
        """The first unclaimed point of `model`, now `worker`'s; None when every one is claimed."""
        with locked(self.path):
            state = self._read()
            spec = next((x for x in state["points"] if x.split(":", 1)[0] == model and x not in state["claims"]),
                        None)
            if spec is not None:
                state["claims"][spec] = worker
                write_json(self.path, state)
        return spec


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
    """Write the queue of `points` (phase_queue.json in `out_dir`), launch one `tierplan bench phase --queue` per
    worker (`args`: the sweep's other options, without --points and --out-dir; no more workers than points),
    each on its own GPU when `cuda`, wait for all, and return how each ended (in launch order), with the points
    it claimed. ValueError for fewer than one worker."""
    if num_workers < 1:
        raise ValueError(f"workers must be >= 1, got {num_workers}")
    out_dir.mkdir(parents=True, exist_ok=True)
    queue = PointQueue.create(out_dir / "phase_queue.json", points)
    count = max(1, min(num_workers, len(points)))
    devices = visible_devices(count) if cuda else [None] * count
    procs = []
    for i, dev in enumerate(devices):
        env = {**os.environ, "COLUMNS": "250"}  # rich leaves a log's lines unwrapped: the last one is the error
        if dev is not None:
            env["CUDA_VISIBLE_DEVICES"] = dev
        log = out_dir / f"phase_worker{i}.log"
        cmd = [sys.executable, "-m", "tierplan.api.cli", "bench", "phase", *args, "--queue", str(queue.path),
               "--out-dir", str(out_dir), "--no-report"]
        with log.open("w") as fh:
            procs.append((i, dev, log, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)))
    results = []
    for i, dev, log, proc in procs:
        rc = proc.wait()
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        claimed = [spec for spec, who in queue.claims().items() if who == str(proc.pid)]
        res = WorkerResult(i, dev, claimed, rc, log, lines[-1] if lines else "")
        results.append(res)
        if on_done is not None:
            on_done(res)
    return results
