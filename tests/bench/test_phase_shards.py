"""The phase sweep over several workers (bench/phase_shards.py): each point goes to exactly one worker's claim
from the shared queue, a point's `--points` pattern selects that point alone, workers get one GPU each, and two
CPU workers of the quick sweep write one JSON that holds every run once, reported once at the end."""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import Queue
from pathlib import Path

import pytest

from tierplan.bench.phase import sweep_grid, write_reports
from tierplan.bench.phase_grid import FULL, QUICK, points, select_points
from tierplan.bench.phase_shards import PointQueue, point_spec, run_workers, visible_devices
from tierplan.bench.phase_steps import CALIBRATION, WARMUP, load_steps, measured_lines
from tierplan.bench.phase_store import load_rows


@pytest.mark.parametrize("sizes", [QUICK, FULL], ids=["quick", "full"])
def test_a_points_pattern_selects_that_point_alone(sizes) -> None:
    grid = points(sizes)
    for p in grid:
        assert select_points(grid, point_spec(p)) == [p]


def _claim_all(path: str, model: str, out: Queue) -> None:
    q = PointQueue(Path(path))
    got = []
    while (spec := q.claim(str(os.getpid()), model)) is not None:
        got.append(spec)
    out.put(got)


def test_the_queue_hands_each_point_to_one_claim_in_sweep_order_model_by_model(tmp_path: Path) -> None:
    grid = points(FULL)
    q = PointQueue.create(tmp_path / "phase_queue.json", grid)
    assert q.specs() == [point_spec(p) for p in grid]
    first_mixtral = next(p for p in grid if p.model == "mixtral-8x7b")
    assert q.claim("w1", "mixtral-8x7b") == point_spec(first_mixtral)  # the claimer's model, not the queue's head
    assert q.claim("w2", "qwen3-30b-a3b") == point_spec(grid[0])
    assert q.claim("w1", "no-such-model") is None
    assert q.claims() == {point_spec(first_mixtral): "w1", point_spec(grid[0]): "w2"}
    # Four processes drain what is left: every point once, none twice.
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim_all, args=(str(q.path), m, out))
             for m in ("qwen3-30b-a3b", "qwen3-30b-a3b", "mixtral-8x7b", "mixtral-8x7b")]
    for pr in procs:
        pr.start()
    got = [spec for _ in procs for spec in out.get(timeout=120)]
    for pr in procs:
        pr.join(timeout=60)
    assert sorted(got) == sorted(set(q.specs()) - {point_spec(first_mixtral), point_spec(grid[0])})
    assert len(q.claims()) == len(grid)


def test_a_bad_queue_file_is_refused_by_name(tmp_path: Path) -> None:
    bad = tmp_path / "q.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"--queue .*q.json: expected an object with 'points'"):
        PointQueue(bad).specs()
    bad.write_text("{")
    with pytest.raises(ValueError, match="not a readable point queue"):
        PointQueue(bad).claim("w", "tiny")


def test_each_worker_sees_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_devices(3) == ["0", "1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    assert visible_devices(2) == ["4", "6"]
    with pytest.raises(ValueError, match="names 3 device"):
        visible_devices(4)


def test_two_cpu_workers_write_one_json_and_one_report(tmp_path: Path) -> None:
    """The `--gpus` path (api/cli_bench_phase.py `sharded`) with CPU workers: every run once in one JSON, the
    workers' rows only, then one report; each worker's line names how it ended."""
    from rich.console import Console

    from tierplan.api.cli_bench_phase import sharded

    console = Console(record=True, width=250)
    failed = sharded(console, tmp_path, 2, "cpu", True, "b1c32f0.4,b4c32f0.4", "resident,static_lru", "", False,
                     None, "dry", True, save_steps=True, deadline_s=3600.0)  # a worker refusing --deadline-s fails
    text = console.export_text()
    assert not failed, text + "".join(p.read_text()[-2000:] for p in tmp_path.glob("phase_worker*.log"))
    assert text.count(" done: ") == 2 and "tiny: report from" in text
    claims = PointQueue(tmp_path / "phase_queue.json").claims()
    assert sorted(claims) == ["tiny:b1c32f0.4", "tiny:b4c32f0.4"]  # each point claimed once, by one worker
    (json_path,) = tmp_path.glob("phase_tiny_*.json")
    rows = [r for r in load_rows(json_path) if r["status"] == "ok"]
    assert sorted((r["batch"], r["policy"]) for r in rows) == [(1, "resident"), (1, "static_lru"),
                                                               (4, "resident"), (4, "static_lru")]
    assert json_path.with_suffix(".md").exists() and len(list(tmp_path.glob("phase_worker*.log"))) == 2
    # --save-steps reaches the workers: each kept its own runs' steps, one line per run, and its discarded runs'
    # (the cost model's replay folds them in): its calibration pass first, then a warm-up run before each point.
    files = sorted(tmp_path.glob("phase_tiny_*_steps_*.jsonl.gz"))
    lines = [line for f in files for line in measured_lines(load_steps(f))]
    assert len(files) == 2 and sorted((x["point"], x["policy"], x["run_id"]) for x in lines) == sorted(
        (r["point"], r["policy"], r["run_id"]) for r in rows)
    for f in files:
        every = load_steps(f)
        assert every[0]["status"] == CALIBRATION and every[0]["policy"] == "resident" and every[0]["steps"]
        warm = [x for x in every if x["status"] == WARMUP]
        assert [x["point"] for x in warm] == list(dict.fromkeys(x["point"] for x in measured_lines(every)))
        assert all(x["policy"] in QUICK.warmup_policies and x["run_id"] == every[0]["run_id"] for x in warm)


def test_workers_write_rows_only_and_the_report_reads_their_days_json(tmp_path: Path) -> None:
    sizes, grid = sweep_grid(quick=True, point_spec="b1c32f0.4", policies=("resident",))
    (r,) = run_workers(grid, 2, ["--device", "cpu", "--quick", "--policies", "resident"], tmp_path, cuda=False)
    assert r.returncode == 0 and r.points == ["tiny:b1c32f0.4"]  # one point: one worker, which claimed it
    assert not list(tmp_path.glob("*.md"))  # the workers wrote rows only
    (json_path,) = tmp_path.glob("phase_tiny_*.json")
    day = json_path.stem.rsplit("_", 1)[1]
    assert write_reports(tmp_path, ["tiny"], sizes, "19990101") == {}  # another day's JSON: none
    assert write_reports(tmp_path, ["tiny"], sizes, day) == {"tiny": json_path}
    assert json_path.with_suffix(".md").exists()


def test_a_failing_worker_is_reported_with_its_exit_code_and_last_line(tmp_path: Path) -> None:
    _sizes, grid = sweep_grid(quick=True, point_spec="b1c32f0.4")
    (r,) = run_workers(grid, 2, ["--device", "cpu", "--quick", "--policies", "nope"], tmp_path, cuda=False)
    assert r.returncode == 2 and "unknown policy" in r.last_line and "nope" in r.log.read_text()


def test_the_cli_refuses_a_queue_beside_points_or_a_missing_queue(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tierplan.api.cli import app

    q = PointQueue.create(tmp_path / "phase_queue.json", points(QUICK)[:1])
    res = CliRunner().invoke(app, ["bench", "phase", "--quick", "--queue", str(q.path), "--points", "b1c32f0.4",
                                   "--out-dir", str(tmp_path)])
    assert res.exit_code == 2 and "leave out --points and --gpus" in " ".join(res.output.split())
    res = CliRunner().invoke(app, ["bench", "phase", "--quick", "--queue", str(tmp_path / "nope.json"),
                                   "--out-dir", str(tmp_path)])
    assert res.exit_code == 2 and "no such file" in " ".join(res.output.split())
    assert not list(tmp_path.glob("phase_tiny_*.json"))  # nothing ran
