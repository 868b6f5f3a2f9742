"""`tierplan bench phase --quick` as CI runs it: one point, every policy, every output; resume; bad input.

The smoke test checks what the sweep writes (every row field of the issue, the table, the plots), never a
speed: the figures of a CPU run are no result.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tierplan.api.cli import app
from tierplan.bench.baselines import BASELINES
from tierplan.bench.phase_grid import QUICK, points, select_points
from tierplan.bench.phase_metrics import ROW_FIELDS
from tierplan.bench.phase_store import load_rows, write_rows

# The issue's row, field by field (issue 14, Build 3): the JSON must carry each of these in every row.
ISSUE_FIELDS = ("model", "layers", "batch", "context", "hbm_budget_gib", "policy", "decode_tok_s", "tpot_p50_ms",
                "tpot_p99_ms", "ttft_p50_ms", "expert_hit_rate", "stall_ms_expert", "stall_ms_kv", "stall_ms_both",
                "predicted_step_ms", "measured_step_ms", "device")
POINT = "b4c32f0.7"


def _run(*args: str) -> object:
    return CliRunner().invoke(app, ["bench", "phase", "--quick", *args])


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("phase")
    res = _run("--points", POINT, "--out-dir", str(out))
    assert res.exit_code == 0, res.output
    files = sorted(out.glob("phase_tiny_*.json"))
    assert len(files) == 1, sorted(p.name for p in out.iterdir())
    rows = json.loads(files[0].read_text())
    # The oracle's candidate splits are saved as they finish (its search resumes from them), before its row.
    candidates = [r for r in rows if r["status"] == "candidate"]
    assert candidates and all(r["policy"] == "oracle" and r["oracle_split"] for r in candidates)
    assert len(candidates) <= QUICK.oracle_max_splits
    return out, [r for r in rows if r["status"] != "candidate"]


def test_every_policy_has_a_row_with_every_field_of_the_issue(swept: tuple[Path, list[dict]]) -> None:
    _, rows = swept
    assert ROW_FIELDS == ISSUE_FIELDS
    assert [r["policy"] for r in rows] == list(BASELINES)
    for r in rows:
        missing = [f for f in ISSUE_FIELDS if f not in r]
        assert not missing, (r["policy"], missing)
        assert r["status"] != "error", (r["policy"], r["notes"])  # an error row is a bug in a policy or the runner
        assert r["model"] == "tiny" and r["batch"] == 4 and r["context"] == 32 and r["quick"] is True
        if r["status"] == "ok":
            empty = [f for f in ISSUE_FIELDS if r[f] is None]
            assert not empty, (r["policy"], empty)
            assert 0.0 <= r["expert_hit_rate"] <= 1.0
            assert r["measured_steps"] > 0 and r["predicted_step_ms"] > 0
            assert r["over_budget_steps"] == 0, r["policy"]  # a budget is a promise, on every step
            assert r["link_gb_s"] > 0 and "visible_devices" in r  # the link it planned with, the GPU it ran on
        else:  # a refusal says why
            assert r["notes"], r["policy"]
    # Every policy runs at the smoke point: one that does not (refused, degraded) is a bug to look at.
    assert {r["policy"]: r["status"] for r in rows} == dict.fromkeys(BASELINES, "ok")
    # A live policy's planner process says where it ran (plan_process.cpu_share: the sweep's cores, or all)
    live = [r for r in rows if r["policy"] in ("tierplan", "fluxmoe", "mv_wsa")]
    assert live and all("planner process on " in r["notes"] for r in live), [r["notes"] for r in live]


def test_rows_time_the_whole_measured_span_and_name_the_batch(swept: tuple[Path, list[dict]]) -> None:
    _, rows = swept
    for r in rows:
        # The wall time of the measured steps holds each forward and everything between two of them (the
        # hooks run between any two steps, so it is always longer than the forwards alone).
        assert r["measured_step_ms"] > r["engine_step_ms"] > 0, r["policy"]
        assert r["measured_step_ms"] == pytest.approx(r["measured_wall_s"] * 1e3 / r["measured_steps"])
        assert r["decode_tok_s"] == pytest.approx(r["output_tokens"] / r["measured_wall_s"])
        assert r["ms_per_token"] == pytest.approx(1e3 / r["decode_tok_s"])
        assert 1 <= r["mean_running_batch"] <= r["batch"]
        # A run stops once QUICK.stop_decode_steps measured steps had no prefill; what it left is counted.
        assert r["decode_steps"] <= QUICK.stop_decode_steps <= r["measured_steps"] or not r["requests_unfinished"]
        assert r["decode_step_ms"] is None or r["decode_step_ms"] > 0
        assert r["predicted_step_ms_measured_misses"] > 0
        # Each measured step ran on one executor, named with its reason (CPU: eager, no graphs or a prefill).
        ran = r["executor_steps"]
        assert sum(ran.values()) == r["measured_steps"] and all(k.startswith("eager/") for k in ran), ran
        for kind in ("decode", "prefill"):  # each kind of step priced apart, beside its own measured mean
            assert (r[f"{kind}_step_ms"] is None) == (r[f"predicted_{kind}_step_ms_measured_misses"] is None), kind
        assert r["prefill_step_ms"] is None or r["prefill_step_ms"] > 0
    by = {r["policy"]: r for r in rows}
    # No policy runs the agent's layer-ahead predictor by default (tierplan_live.py says why).
    assert not any(r["local_predictor"] for r in by.values())
    # One pricing rule for every policy; a live one's own figure beside it, a static one has none.
    assert all(r["predicted_from"].startswith("split: ") for r in rows)
    assert by["tierplan"]["controller_step_ms"] > 0 and by["resident"]["controller_step_ms"] is None
    # A live controller's plans are in its row, each with the split, the batch it saw and why; a static none.
    plans = by["tierplan"]["plans_issued"]
    assert all(p["reason"] and p["kv_gpu_blocks"] > 0 and p["expert_slots"] > 0 for p in plans)
    assert by["resident"]["plans_issued"] == []
    # ... and how far behind decode it planned: its time a window, and each applied plan's lag in steps.
    live = by["tierplan"]
    assert live["planner_ms_p50"] > 0 and live["planner_ms_max"] >= live["planner_ms_p50"]
    assert len(live["plan_lag_steps"]) == live["plan_changes"] and all(n >= 0 for n in live["plan_lag_steps"])
    # ... and how often it kept its split since, with the last reasons (why no plan beat the one in force): tierplan
    # weighs its first plan against its start, so a short run may keep the start throughout.
    held = by["tierplan"]["plans_held"]
    assert held["count"] >= len(held["last"]) and all(h["reason"] and h["window"] > 0 for h in held["last"])
    assert plans or held["count"] > 0
    # ... every decision with the KV shares it weighed, term by term (coupling.ShareTerms), the plan's own among them.
    assert all(any(s["kv_blocks"] <= p["kv_gpu_blocks"] and s["objective_ms"] is not None for s in p["shares"])
               for p in plans)
    assert all(any(s["objective_ms"] is not None for s in h["shares"]) for h in held["last"])
    assert by["resident"]["plans_held"] is None
    oracle = by["oracle"]
    assert isinstance(oracle["diverged_steps"], int) and f"diverged_steps {oracle['diverged_steps']}" in oracle["notes"]


def test_a_long_run_stops_at_the_step_cap_and_counts_what_it_left(tmp_path: Path) -> None:
    """b12 at 40 % of its need holds a few sequences at once: the full run takes ~130 steps. It stops once
    QUICK.stop_decode_steps measured steps had no prefill, every figure over those steps, the unfinished
    requests counted."""
    res = _run("--points", "b12c128f0.4", "--policies", "resident", "--out-dir", str(tmp_path))
    assert res.exit_code == 0, res.output
    (row,) = [r for r in json.loads(next(tmp_path.glob("phase_tiny_*.json")).read_text()) if r["status"] == "ok"]
    assert row["decode_steps"] == QUICK.stop_decode_steps < row["measured_steps"] < 100
    assert row["warm_steps"] == QUICK.warm_steps
    assert 0 < row["requests_unfinished"] < row["requests"]
    assert row["decode_tok_s"] == pytest.approx(row["output_tokens"] / row["measured_wall_s"])


def test_repeats_run_in_rounds_of_alternating_order_and_resume(tmp_path: Path) -> None:
    """--repeats 3: three runs of each policy (the oracle's candidate search again in each), round 1 in reverse
    order; a rerun adds none; the report shows each policy's median run and says so."""
    args = ("--points", "b1c32f0.4", "--policies", "resident,oracle", "--repeats", "3", "--out-dir", str(tmp_path))
    res = _run(*args)
    assert res.exit_code == 0, res.output
    path = next(tmp_path.glob("phase_tiny_*.json"))
    rows = json.loads(path.read_text())
    runs = [(r["repeat"], r["policy"]) for r in rows if r["status"] == "ok"]
    assert runs == [(0, "resident"), (0, "oracle"), (1, "oracle"), (1, "resident"), (2, "resident"), (2, "oracle")]
    candidates = [r for r in rows if r["status"] == "candidate"]
    assert {r["repeat"] for r in candidates} == {0, 1, 2}
    assert len(candidates) == 3 * len([r for r in candidates if r["repeat"] == 0])
    md = path.with_suffix(".md").read_text()
    assert "Repeats: 2 policy runs at 1 points ran 3 times each" in md
    again = _run(*args)
    assert again.exit_code == 0 and len(json.loads(path.read_text())) == len(rows)  # nothing left to run
    bad = _run("--repeats", "0", "--out-dir", str(tmp_path))
    assert bad.exit_code == 2 and "--repeats" in bad.output


def test_table_and_plots_are_written(swept: tuple[Path, list[dict]]) -> None:
    out, _ = swept
    (md,) = out.glob("phase_tiny_*.md")
    text = md.read_text()
    assert "CPU smoke run" in text and "## Targets" in text and "tierplan / best" in text
    assert "tierplan / oracle" in text and "steps graph/piecewise/eager" in text
    for policy in BASELINES:
        assert f"| {policy} |" in text
    for suffix in ("_tok_s.png", "_winner.png"):
        (png,) = out.glob(f"phase_tiny_*{suffix}")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rerun_skips_what_is_measured_and_adds_what_is_not(swept: tuple[Path, list[dict]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import tierplan.bench.phase as phase

    out, _ = swept
    (path,) = out.glob("phase_tiny_*.json")
    rows = json.loads(path.read_text())
    real_open = phase.open_model

    def never(*_a: object, **_k: object) -> None:
        raise AssertionError("a model with no run left was opened")

    monkeypatch.setattr(phase, "open_model", never)
    res = _run("--points", POINT, "--out-dir", str(out))
    assert res.exit_code == 0, res.output
    assert json.loads(path.read_text()) == rows  # nothing run twice, nothing lost, the model never opened
    opened: list[object] = []
    monkeypatch.setattr(phase, "open_model", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    res = _run("--points", "b1c32f0.7", "--policies", "resident", "--out-dir", str(out))
    assert res.exit_code == 0, res.output
    after = json.loads(path.read_text())
    assert after[: len(rows)] == rows and [(r["batch"], r["policy"]) for r in after[len(rows):]] == [(1, "resident")]
    assert len(opened) == 1  # opened once, for the point with a run left


def test_unmeasured_runs_only_the_points_this_device_has_no_row_at(tmp_path: Path) -> None:
    """--unmeasured: a point with a row from this device (another code's, another policy's) is left out; one with
    rows from another device only runs; with --gpus N it is refused (the workers share a queue of listed points)."""
    assert _run("--points", "b1c32f0.4", "--policies", "resident", "--out-dir", str(tmp_path)).exit_code == 0
    path = next(tmp_path.glob("phase_tiny_*.json"))
    rows = json.loads(path.read_text())
    rows += [{**r, "point": r["point"].replace("f0.4", "f0.7"), "device": "NVIDIA H200", "budget_frac": 0.7}
             for r in rows]  # b1c32f0.7 measured elsewhere only
    for r in rows:
        r["code"] = "older"  # another code's rows count as measured
    path.write_text(json.dumps(rows))
    res = _run("--points", "b1c32f0.4,b1c32f0.7", "--policies", "resident,static_lru", "--unmeasured",
               "--out-dir", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert "1 of 2 selected point(s) already have rows" in res.output
    new = json.loads(path.read_text())[len(rows):]
    assert {(r["point"].rsplit("/", 1)[-1], r["policy"]) for r in new if r["status"] == "ok"} == {
        ("f0.7", "resident"), ("f0.7", "static_lru")}
    bad = _run("--gpus", "2", "--unmeasured", "--device", "cuda", "--out-dir", str(tmp_path))
    assert bad.exit_code != 0 and "--unmeasured selects points on one GPU" in bad.output


@pytest.mark.parametrize(("args", "says"), [
    (["--policies", "resident,nosuch"], "unknown policy ['nosuch']"),
    (["--models", "qwen3-30b-a3b"], "unknown model ['qwen3-30b-a3b']"),
    (["--points", "b3c32"], "'b3c32' matches no point"),
    (["--points", "batch=4"], "is not [model:]b<batch>"),
    (["--device", "tpu"], "expected cpu or cuda"),
    (["--oracle-recording", "gpu"], "--oracle-recording 'gpu': expected one of 'dry', 'engine'"),
])
def test_bad_input_is_refused_by_name_before_any_work(tmp_path: Path, args: list[str], says: str) -> None:
    res = _run(*args, "--out-dir", str(tmp_path))
    assert res.exit_code == 2, res.output
    assert "error: " in res.output and says in res.output
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path: Path) -> None:
    res = _run("--device", "cuda", "--out-dir", str(tmp_path))
    assert res.exit_code == 2 and "sees no CUDA device" in res.output


def test_point_patterns_select_from_the_grid() -> None:
    grid = points(QUICK)
    assert len(grid) == len(QUICK.batches) * len(QUICK.contexts) * len(QUICK.models[0].budget_fracs)
    picked = select_points(grid, "b1, tiny:b4c128f1")
    assert {(p.batch, p.context, p.budget_frac) for p in picked} == (
        {(1, c, f) for c in QUICK.contexts for f in QUICK.models[0].budget_fracs} | {(4, 128, 1.0)})


def test_the_json_is_replaced_whole_and_a_broken_one_is_named(tmp_path: Path) -> None:
    path = tmp_path / "phase_tiny_20000101.json"
    rows = [{"point": "p", "policy": "resident", "device": "cpu", "code": "x", "decode_tok_s": 1.0}]
    write_rows(path, rows)
    assert load_rows(path) == rows and [p.name for p in tmp_path.iterdir()] == [path.name]
    path.write_text('[{"point": "p"}')
    with pytest.raises(ValueError, match=r"phase_tiny_20000101\.json: not JSON"):
        load_rows(path)
    path.write_text('{"rows": []}')
    with pytest.raises(ValueError, match="expected a list of phase rows"):
        load_rows(path)


class _FailingSource:
    """A live policy's source whose planner fails every window (a solver missing on the device image, say)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def sync_from(self, telemetry: object) -> object:
        return self.inner.sync_from(telemetry)  # type: ignore[attr-defined]

    def step_next(self) -> None:
        raise RuntimeError("no solver here")

    def record_ack(self, ack: object) -> None:
        self.inner.record_ack(ack)  # type: ignore[attr-defined]

    def close(self) -> str | None:  # the inner controller's process stops with the run
        return self.inner.close()  # type: ignore[attr-defined]


def test_a_live_planner_that_fails_gives_a_degraded_row_never_a_result(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import tierplan.bench.phase as phase

    real = phase.make

    def make(name: str) -> object:
        baseline = real(name)
        start = baseline.start

        def failing_start(engine: object, ctx: object) -> object:
            run = start(engine, ctx)
            if run.source is not None:
                run.source = _FailingSource(run.source)
            return run

        baseline.start = failing_start  # type: ignore[method-assign]
        return baseline

    monkeypatch.setattr(phase, "make", make)
    res = _run("--points", POINT, "--policies", "tierplan", "--out-dir", str(tmp_path))
    assert res.exit_code == 0, res.output
    (row,) = json.loads(next(tmp_path.glob("phase_tiny_*.json")).read_text())
    assert row["status"] == "degraded" and row["planner_errors"] > 0
    assert "RuntimeError: no solver here" in row["notes"]
    md = next(tmp_path.glob("phase_tiny_*.md")).read_text()
    assert "| degraded |" in md and "| tierplan tok/s |" in md
    # A degraded tierplan is never its figure: the point counts as missed, and says why.
    assert "at >= 1 point | not met | no point where tierplan ran ok; tierplan not ok at 1 of 1 points" in md
    assert "at every point | not met |" in md
    assert "missed: tierplan degraded: " in md


def test_other_sizes_are_another_measurement(tmp_path: Path) -> None:
    args = ("--points", "b1c32f0.4", "--policies", "resident", "--out-dir", str(tmp_path))
    assert _run(*args).exit_code == 0
    res = _run(*args, "--requests-per-batch", "3")
    assert res.exit_code == 0, res.output
    rows = json.loads(next(tmp_path.glob("phase_tiny_*.json")).read_text())
    assert [r["requests"] for r in rows] == [2, 3] and rows[0]["code"] != rows[1]["code"]
    res = _run(*args, "--requests-per-batch", "0")
    assert res.exit_code == 2 and "--requests-per-batch must be > 0" in res.output


def test_the_oracle_recording_option_reaches_the_sweep(tmp_path: Path) -> None:
    """`--oracle-recording engine`: each candidate's access stream is recorded on an engine run and the CPU replay
    is checked against it (the candidates' notes say so); the default replays without recording."""
    res = _run("--points", "b1c32f0.7", "--policies", "oracle", "--oracle-recording", "engine",
               "--out-dir", str(tmp_path))
    assert res.exit_code == 0, res.output
    (path,) = tmp_path.glob("phase_tiny_*.json")
    notes = [r["notes"] for r in json.loads(path.read_text()) if r.get("status") == "candidate"]
    assert notes and all("engine recording; the dry replay equals it" in n for n in notes), notes


def test_merge_adds_another_calls_rows_and_rewrites_the_report(tmp_path: Path) -> None:
    """`--merge FILE` measures nothing: FILE's rows that --out-dir's file of the same name lacks are appended and
    its report rewritten; a missing file is refused by name (exit 2)."""
    call, out = tmp_path / "call", tmp_path / "out"
    res = _run("--points", "b4c32f1.0", "--policies", "resident,kv_tiering", "--out-dir", str(call))
    assert res.exit_code == 0, res.output
    src = next(call.glob("phase_tiny_*.json"))
    rows = json.loads(src.read_text())
    out.mkdir()
    write_rows(out / src.name, rows[:1])  # the committed file held the first run only
    res = CliRunner().invoke(app, ["bench", "phase", "--out-dir", str(out), "--merge", str(src)])
    assert res.exit_code == 0, res.output
    assert f"{len(rows) - 1} row(s) added" in " ".join(res.output.split())  # rich wraps lines at its width
    assert load_rows(out / src.name) == rows
    md = (out / src.name).with_suffix(".md").read_text()
    assert "| kv_tiering |" in md and "| resident |" in md
    # Another card's rows join the JSON, more of them than the first card's: the report of the device the JSON
    # started on keeps its name, the other card gets its own, and neither mixes the two.
    other = [{**r, "device": "NVIDIA H100 80GB HBM3", "run_id": f"h100-{i}"} for i in range(2) for r in rows]
    write_rows(tmp_path / src.name, other)
    res = CliRunner().invoke(app, ["bench", "phase", "--out-dir", str(out), "--merge", str(tmp_path / src.name)])
    assert res.exit_code == 0, res.output
    h100 = out / f"{src.stem}_nvidia-h100-80gb-hbm3.md"
    assert (out / src.name).with_suffix(".md").read_text() == md and h100.is_file()
    assert "Device: NVIDIA H100 80GB HBM3." in h100.read_text() and f"Rows: {len(rows)} " in h100.read_text()
    res = CliRunner().invoke(app, ["bench", "phase", "--out-dir", str(out), "--merge", str(tmp_path / "no.json")])
    assert res.exit_code == 2 and "no.json: no such file" in " ".join(res.output.split())
    res = CliRunner().invoke(app, ["bench", "phase", "--out-dir", str(out), "--merge", str(out / src.name)])
    assert res.exit_code == 2 and "that is the file it would merge into" in " ".join(res.output.split())


def test_each_point_runs_its_discarded_warm_ups_first_and_goes_on_without_one_that_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a point's measured runs, one run of each warm-up policy, in order, whose outcome is no row (the kernels
    their steps need are built before the first measured policy runs) but whose steps the cost model is fitted on
    before the point's first row is predicted; each row names them. A warm-up that fails is said and the others
    and the runs go on, the rows naming those that ran. The full sweep warms up KV first too (mv_wsa after
    static_lru: H100 runs 78-79, the first KV-first run's slow prefills)."""
    import dataclasses

    import tierplan.bench.phase as phase
    from tierplan.bench.phase_grid import FULL
    from tierplan.bench.phase_predictor import Predictor

    assert FULL.warmup_policies == ("static_lru", "mv_wsa") and QUICK.warmup_policies == ("static_lru",)
    warm = ("static_lru", "kv_tiering")
    monkeypatch.setattr(phase, "QUICK", dataclasses.replace(QUICK, warmup_policies=warm))
    real, made = phase.make, []
    monkeypatch.setattr(phase, "make", lambda name: made.append(name) or real(name))
    fit = Predictor.calibrate
    monkeypatch.setattr(Predictor, "calibrate",
                        lambda self, steps, *a, **kw: made.append(len(steps)) or fit(self, steps, *a, **kw))
    res = _run("--points", POINT, "--policies", "resident", "--out-dir", str(tmp_path / "ok"))
    assert res.exit_code == 0, res.output
    (row,) = json.loads(next((tmp_path / "ok").glob("phase_tiny_*.json")).read_text())
    names = [x for x in made if isinstance(x, str)]
    assert names[-3:] == [*warm, "resident"] and row["warmed_by"] == "static_lru+kv_tiering"
    between = made[made.index(warm[-1]) + 1:made.index("resident", made.index(warm[-1]))]
    assert between and between[0] > 0, made  # the warm-up's steps, folded in before the measured run
    assert all(f"warm-up run ({w}, discarded)" in res.output for w in warm)

    def broken(name: str) -> object:
        if name == warm[0] and not broken.failed:  # type: ignore[attr-defined]
            broken.failed = True  # type: ignore[attr-defined]
            raise RuntimeError("warm-up broke")
        return real(name)

    broken.failed = False  # type: ignore[attr-defined]
    monkeypatch.setattr(phase, "make", broken)
    res = _run("--points", POINT, "--policies", "resident", "--out-dir", str(tmp_path / "failed"))
    assert res.exit_code == 0, res.output
    (row,) = json.loads(next((tmp_path / "failed").glob("phase_tiny_*.json")).read_text())
    assert row["status"] == "ok" and row["warmed_by"] == "kv_tiering" and "warm-up broke" in res.output
