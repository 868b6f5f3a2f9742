"""The phase sweep over several workers (bench/phase_shards.py): each point goes to exactly one worker, a point's
`--points` pattern selects that point alone, workers get one GPU each, and two CPU workers of the quick sweep
write one JSON that holds every run once, reported once at the end."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierplan.bench.phase import sweep_grid, write_reports
from tierplan.bench.phase_grid import FULL, QUICK, points, select_points
from tierplan.bench.phase_shards import point_spec, run_workers, shares, visible_devices
from tierplan.bench.phase_steps import load_steps
from tierplan.bench.phase_store import load_rows


@pytest.mark.parametrize("sizes", [QUICK, FULL], ids=["quick", "full"])
def test_every_point_goes_to_one_worker_and_its_pattern_selects_it_alone(sizes) -> None:
    grid = points(sizes)
    parts = shares(grid, 8)
    assert sorted((p for part in parts for p in part), key=grid.index) == grid  # each point once
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    for p in grid:
        assert select_points(grid, point_spec(p)) == [p]
    assert shares(grid[:2], 8) == [[grid[0]], [grid[1]]]  # no empty worker
    with pytest.raises(ValueError, match="workers must be >= 1"):
        shares(grid, 0)


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
                     None, "dry", True, save_steps=True)
    text = console.export_text()
    assert not failed, text + "".join(p.read_text()[-2000:] for p in tmp_path.glob("phase_worker*.log"))
    assert text.count(" done: ") == 2 and "tiny: report from" in text
    (json_path,) = tmp_path.glob("phase_tiny_*.json")
    rows = [r for r in load_rows(json_path) if r["status"] == "ok"]
    assert sorted((r["batch"], r["policy"]) for r in rows) == [(1, "resident"), (1, "static_lru"),
                                                               (4, "resident"), (4, "static_lru")]
    assert json_path.with_suffix(".md").exists() and len(list(tmp_path.glob("phase_worker*.log"))) == 2
    # --save-steps reaches the workers: each kept its own runs' steps, one line per run.
    files = sorted(tmp_path.glob("phase_tiny_*_steps_*.jsonl.gz"))
    lines = [line for f in files for line in load_steps(f)]
    assert len(files) == 2 and sorted((x["point"], x["policy"], x["run_id"]) for x in lines) == sorted(
        (r["point"], r["policy"], r["run_id"]) for r in rows)


def test_workers_write_rows_only_and_the_report_reads_their_days_json(tmp_path: Path) -> None:
    sizes, grid = sweep_grid(quick=True, point_spec="b1c32f0.4", policies=("resident",))
    (r,) = run_workers(grid, 2, ["--device", "cpu", "--quick", "--policies", "resident"], tmp_path, cuda=False)
    assert r.returncode == 0 and len(r.points) == 1
    assert not list(tmp_path.glob("*.md"))  # the workers wrote rows only
    (json_path,) = tmp_path.glob("phase_tiny_*.json")
    day = json_path.stem.rsplit("_", 1)[1]
    assert write_reports(tmp_path, ["tiny"], sizes, "cpu", "19990101") == {}  # another day's JSON: none
    assert write_reports(tmp_path, ["tiny"], sizes, "cpu", day) == {"tiny": json_path}
    assert json_path.with_suffix(".md").exists()


def test_a_failing_worker_is_reported_with_its_exit_code_and_last_line(tmp_path: Path) -> None:
    _sizes, grid = sweep_grid(quick=True, point_spec="b1c32f0.4")
    (r,) = run_workers(grid, 2, ["--device", "cpu", "--quick", "--policies", "nope"], tmp_path, cuda=False)
    assert r.returncode == 2 and "unknown policy" in r.last_line and "nope" in r.log.read_text()
