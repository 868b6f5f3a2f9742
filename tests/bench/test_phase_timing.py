"""bench/phase_timing.py and `tierplan bench phase --deadline-s`: a point whose runs would not end in time, by
the rows of the nearest point measured before, is not started; a point with no history is."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierplan.api.cli import app
from tierplan.bench.phase_grid import Point
from tierplan.bench.phase_store import write_rows
from tierplan.bench.phase_timing import estimate_point_s

DEV = "NVIDIA H200"
POINT = Point("qwen3-30b-a3b", 8, 48, 32, 4096, 40.0, None)


def _row(policy: str, run_s: float, budget: float = 40.0, batch: int = 32, context: int = 4096, code: str = "c1",
         when: str = "2026-12-05 01:00:00", **kw: object) -> dict:
    return {"model": "qwen3-30b-a3b", "point": f"qwen3-30b-a3b/L8/b{batch}/c{context}/g{budget:g}", "policy": policy,
            "device": DEV, "code": code, "batch": batch, "context": context, "hbm_budget_gib": budget,
            "run_s": run_s, "when": when, "status": "ok", **kw}


def test_a_point_is_priced_at_the_nearest_budget_measured_with_its_batch_and_context() -> None:
    rows = [_row("resident", 10.0, budget=24.0), _row("oracle", 80.0, budget=24.0),
            _row("resident", 5.0, budget=56.0), _row("oracle", 30.0, budget=56.0),
            _row("resident", 1.0, batch=8), _row("resident", 1.0, context=1024),  # other batch, other context
            _row("resident", 1.0, budget=40.0, device="cpu (x86_64)"),  # another device
            _row("oracle", 999.0, budget=40.0, status="candidate")]  # a candidate's run: in the oracle's row
    # 24 and 56 GiB are both 16 from 40: the newest measurement wins
    rows += [_row("mv_wsa", 20.0, budget=56.0, when="2026-12-05 02:00:00")]
    assert estimate_point_s(rows, POINT, ["resident", "oracle"], DEV) == pytest.approx(35.0)
    # a policy the nearest point did not run: the mean of those that did
    assert estimate_point_s(rows, POINT, ["resident", "fluxmoe"], DEV) == pytest.approx(5.0 + (5 + 30 + 20) / 3)
    # a policy run twice there: its newest run
    rows.append(_row("resident", 7.0, budget=56.0, when="2026-12-05 03:00:00", code="c2"))
    assert estimate_point_s(rows, POINT, ["resident"], DEV) == pytest.approx(7.0)
    assert estimate_point_s(rows, Point("qwen3-30b-a3b", 8, 48, 128, 4096, 40.0, None), ["resident"], DEV) is None
    assert estimate_point_s([], POINT, ["resident"], DEV) is None


def test_the_sweep_skips_a_point_that_would_not_end_in_time_and_runs_one_with_no_history(tmp_path: Path) -> None:
    """b1 at 40 % took 1e6 s here before (seeded): with --deadline-s 900 it is named and not started (its run and
    the point's warm-up, priced alike, and the model's opening); b4 at 40 % has no measured point of its batch and
    context, so it runs."""
    from tierplan.bench.phase import _device_name
    from tierplan.runtime.device import Device

    dev = _device_name(Device("cpu"))
    seed = [{**_row("resident", 1e6, budget=0.1, batch=1, context=32), "model": "tiny", "device": dev,
             "point": "tiny/L2/b1/c32/f0.4", "code": "older"}]
    path = tmp_path / f"phase_tiny_{time.strftime('%Y%m%d')}.json"
    write_rows(path, seed)
    res = CliRunner().invoke(app, ["bench", "phase", "--quick", "--points", "b1c32f0.4,b4c32f0.4", "--policies",
                                   "resident", "--deadline-s", "900", "--out-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())  # the console wraps its lines
    assert "tiny/L2/b1/c32/f0.4: skipped, not started: its 1 run(s) and its warm-up took ~2000090 s" in said
    new = [r for r in json.loads(path.read_text()) if r["code"] != "older"]
    assert [(r["point"], r["policy"], r["status"]) for r in new] == [("tiny/L2/b4/c32/f0.4", "resident", "ok")]
    bad = CliRunner().invoke(app, ["bench", "phase", "--quick", "--deadline-s", "0", "--out-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "--deadline-s" in bad.output
