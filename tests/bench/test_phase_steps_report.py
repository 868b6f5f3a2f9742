"""The per-step report (bench/phase_steps_report.py): a few slow steps told apart from a whole run slower."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from tierplan.api.cli import app
from tierplan.bench.phase_steps import append_steps
from tierplan.bench.phase_steps_report import (
    between_summary,
    forward_split,
    host_fit,
    run_summary,
    spread_rows,
    window_places,
)


def _line(policy: str, decode_ms: list[float], run_id: str, warm: int = 2) -> dict[str, Any]:
    """A run of `warm` warm-up steps, one prefill step, then decode steps of `decode_ms`."""
    cycles = [0.050] * warm + [0.100] + [ms / 1e3 for ms in decode_ms]
    return {"point": "p", "policy": policy, "run_id": run_id, "repeat": 0, "warm_steps": warm,
            "steps": {"cycle_s": cycles, "num_prefills": [1] * warm + [1] + [0] * len(decode_ms),
                      "gc_ms": [0.0] * len(cycles)}}


def test_a_runs_decode_cycles_leave_out_the_warm_up_and_the_prefills() -> None:
    s = run_summary(_line("a", [2.0] * 19 + [40.0], "r"))
    assert s is not None and s["decode_steps"] == 20 and s["p50_ms"] == 2.0 and s["max_ms"] == 40.0
    assert s["mean_ms"] == (19 * 2.0 + 40.0) / 20 and s["tail_share"] == 40.0 / (19 * 2.0 + 40.0)
    assert run_summary(_line("a", [], "r")) is None  # no decode step measured


def test_slow_steps_and_a_slower_run_are_told_apart() -> None:
    base = [2.0] * 100
    runs = [run_summary(x) for x in (
        _line("same", base, "1"), _line("same", base, "2"),
        _line("hiccup", base, "1"), _line("hiccup", [2.0] * 95 + [20.0] * 5, "2"),
        _line("slower", base, "1"), _line("slower", [2.6] * 100, "2"),
        _line("once", base, "1"))]
    verdicts = {r["policy"]: r["verdict"] for r in spread_rows([r for r in runs if r])}
    assert verdicts == {"same": "alike", "hiccup": "a few slow steps", "slower": "the whole run slower"}


def test_the_time_between_steps_and_what_each_plan_change_moved() -> None:
    """H100 run 47, b128 16K 40 GiB in small: a plan after the warm-up spills blocks (booked in the step before it
    and its own) and fetches some back; the gap before its first step is the run's time between steps."""
    block = 1 << 18
    line = {"point": "p", "policy": "tierplan", "run_id": "r", "warm_steps": 2, "kv_block_bytes": block,
            "steps": {"cycle_s": [0.05, 0.05, 0.01, 0.01, 3.25, 0.01], "step_s": [0.04, 0.04, 0.01, 0.01, 0.01, 0.01],
                      "plan_version": [1, 1, 1, 1, 2, 2],
                      "link_bytes": [{}, {}, {}, {"d2h": 100 * block}, {"d2h": 20 * block}, {}],
                      "kv_fetch": [{}, {}, {}, {}, {"cpu": 17, "nvme": 0}, {}]}}
    b = between_summary(line)
    assert b is not None and round(b["between_ms"]) == 3240 and round(b["wall_ms"]) == 3280
    assert [(round(g), s, f) for g, s, f in b["changes"]] == [(3240, 120, 17)]
    line["steps"]["cycle_s"][4] = 0.012  # 2 ms between steps of 42 ms: under a tenth, not listed
    assert between_summary(line) is None
    del line["steps"]["step_s"]  # a line without the forward's own time: nothing to tell
    assert between_summary(line) is None


def test_a_decode_forward_is_split_into_its_replays_gpu_time_and_the_host_rest() -> None:
    """Steps saved with `graph_gpu_ms`: the forward's wall against its graph replays' GPU time (prefills, the
    warm-up and eager steps left out); lines saved before it, or with no replayed step, give nothing."""
    line = {"point": "p", "policy": "tierplan", "run_id": "r", "warm_steps": 1,
            "steps": {"step_s": [0.05, 0.020, 0.012, 0.010, 0.014], "num_prefills": [1, 1, 0, 0, 0],
                      "graph_gpu_ms": [None, None, 8.0, 7.0, None], "expert_hits": [0, 0, 380, 290, 0],
                      "expert_misses": [0, 0, 20, 10, 0], "context_tokens": [0, 0, 8000, 2000, 0]}}
    f = forward_split(line)
    assert f is not None and f["steps"] == 2 and f["forward_ms"] == 11.0 and f["gpu_ms"] == 7.5
    assert f["host_ms"] == 3.5 and f["reads"] == 350.0 and f["context_tokens"] == 5000.0
    assert f["host_us_per_read"] == pytest.approx(1e3 * (4.0 / 400 + 3.0 / 300) / 2)  # host ms / reads, per step
    assert f["host_us_per_kctx"] == pytest.approx(1e3 * (4.0 / 8 + 3.0 / 2) / 2)  # host ms / 1K context, per step
    assert f["outbox_ms"] is None  # saved before steps carried it
    assert f["planner_ms"] is None and f["planner_cores"] is None
    line["steps"] |= {"outbox_ms": [9.0, 9.0, 1.0, 2.0, 9.0], "planner_ms": [0.0, 0.0, 4.0, 2.0, 0.0],
                      "planner_cpu_ms": [0.0, 0.0, 8.0, 4.0, 0.0]}
    f = forward_split(line)
    assert f is not None and f["outbox_ms"] == 1.5 and f["planner_ms"] == 3.0 and f["planner_cores"] == 2.0
    line["steps"]["graph_gpu_ms"] = [None] * 5
    assert forward_split(line) is None
    del line["steps"]["graph_gpu_ms"]
    assert forward_split(line) is None


def test_the_cli_writes_the_report_or_names_what_is_missing(tmp_path: Path) -> None:
    run = CliRunner()
    empty = run.invoke(app, ["bench", "phase", "--steps-report", str(tmp_path)])
    assert empty.exit_code == 2 and "no phase_*_steps_*.jsonl.gz under it" in " ".join(empty.output.split())
    call = tmp_path / "phase_run01"  # a device call's folder under the one named
    for rid in ("1", "2"):
        append_steps(call / f"phase_m_20261204_steps_{rid}.jsonl.gz", _line("resident", [2.0] * 30, rid))
    res = run.invoke(app, ["bench", "phase", "--steps-report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "phase_steps_report.md").read_text()
    assert "Policies run twice or more at a point: 1; means within 5 %: 1" in text and "| p | resident | 2 |" in text


def test_the_host_fit_finds_what_the_host_rest_grows_with() -> None:
    """Host rest = 0.5 ms + 30 us per 1,000 context tokens + 20 us a sequence, nothing per read: the fit says so;
    steps with a miss or a KV fetch (their waits are no host work) and the warm-up stay out."""
    rng = np.random.default_rng(0)
    n = 200
    reads, ctx, seqs = rng.integers(100, 400, n), rng.integers(1000, 200000, n), rng.integers(1, 33, n)
    gpu = rng.uniform(2.0, 5.0, n)
    host = 0.5 + 0.030 * ctx / 1e3 + 0.020 * seqs
    misses = [0] * n
    misses[5] = 40  # a step that waited on loads: its host rest is no fit point
    host[5] += 50.0
    line = {"point": "p", "policy": "tierplan", "run_id": "r", "warm_steps": 3,
            "steps": {"step_s": list((gpu + host) / 1e3), "num_prefills": [0] * n, "graph_gpu_ms": list(gpu),
                      "expert_hits": list(reads), "expert_misses": misses, "context_tokens": list(ctx),
                      "num_decodes": list(seqs), "kv_fetch": [{"cpu": 0, "nvme": 0}] * n}}
    line["steps"]["step_s"][0] = 1.0  # the warm-up's slow step
    fit = host_fit([line])
    assert fit is not None and fit["steps"] == n - 4
    assert fit["const_ms"] == pytest.approx(0.5, abs=1e-6) and fit["per_read_ms"] == pytest.approx(0.0, abs=1e-8)
    assert fit["per_kctx_ms"] == pytest.approx(0.030) and fit["per_seq_ms"] == pytest.approx(0.020)
    assert fit["r2"] == pytest.approx(1.0)
    assert host_fit([line], min_steps=n) is None


def test_decode_forwards_are_told_by_their_place_in_the_window() -> None:
    """Place i % window_steps after the warm-up: medians of the replayed decode forwards, means of what ran beside
    them; prefills and eager steps stay out; a run with an empty place or without graph times gives nothing."""
    n = 12
    step_s = [0.010 if i % 4 == 0 else 0.004 for i in range(n)]
    step_s[5] = 0.5  # a prefill: left out
    line = {"point": "p", "policy": "tierplan", "run_id": "r", "warm_steps": 4, "window_steps": 4,
            "steps": {"step_s": step_s, "num_prefills": [1 if i == 5 else 0 for i in range(n)],
                      "graph_gpu_ms": [2.0] * n, "planner_ms": [8.0 if i % 4 == 1 else 0.0 for i in range(n)]}}
    w = window_places(line)
    assert w is not None and w["forward_ms"] == pytest.approx([10.0, 4.0, 4.0, 4.0])
    assert w["planner_ms"] == pytest.approx([0.0, 8.0, 0.0, 0.0]) and w["outbox_ms"] is None
    line["steps"]["graph_gpu_ms"] = [None if i % 4 == 3 else 2.0 for i in range(n)]  # place 3: eager only
    assert window_places(line) is None
    del line["steps"]["graph_gpu_ms"]
    assert window_places(line) is None
