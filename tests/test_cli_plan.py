"""`tierplan plan bench`: what a user types, what they read, and the exit codes (small sizes; never timed)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tierplan.api.cli import app

runner = CliRunner()


def test_plan_bench_json_last_line() -> None:
    r = runner.invoke(app, ["plan", "bench", "--layers", "4", "--experts", "8", "--repeats", "3", "--json"])
    assert r.exit_code == 0, r.output
    last = json.loads(r.output.strip().splitlines()[-1])
    assert set(last) == {"p50_ms", "p99_ms", "solver"}
    assert last["solver"] == "dp" and 0 <= last["p50_ms"] <= last["p99_ms"]
    assert "plan bench: 4 layers x 8 experts" in r.output


def test_plan_bench_other_solvers() -> None:
    for solver in ("milp", "greedy"):
        r = runner.invoke(app, ["plan", "bench", "--layers", "3", "--experts", "8", "--repeats", "2",
                                "--solver", solver, "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output.strip().splitlines()[-1])["solver"] == solver


def test_plan_bench_refuses_bad_input() -> None:
    r = runner.invoke(app, ["plan", "bench", "--solver", "simplex"])
    assert r.exit_code == 2 and "simplex" in r.output
    r = runner.invoke(app, ["plan", "bench", "--layers", "0"])
    assert r.exit_code == 2 and "layers" in r.output
    r = runner.invoke(app, ["plan", "bench", "--layers", "2", "--experts", "4", "--repeats", "1", "--hbm-gib", "1"])
    assert r.exit_code == 2 and "error:" in r.output and "dense weights" in r.output


def test_plan_bench_writes_its_report(tmp_path: Path) -> None:
    r = runner.invoke(app, ["plan", "bench", "--layers", "3", "--experts", "8", "--repeats", "2", "--baselines", "2",
                            "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "plan_bench_dp.json").read_text())
    assert len(data["wall_ms"]) == 2 and set(data["summary"]) == {"p50_ms", "p99_ms", "solver"}
    assert "FluxMoE rho rule" in data["baselines"]
    assert (tmp_path / "plan_bench_dp.md").read_text().startswith("# plan bench: 3 layers x 8 experts")
    assert (tmp_path / "plan_bench_dp.png").stat().st_size > 0
