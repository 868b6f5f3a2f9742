"""The `tierplan` command line: what a user types, what they read, and the exit codes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierplan.api.cli import app

runner = CliRunner()


def test_check_slots_prints_the_result_line(tmp_path: Path) -> None:
    r = runner.invoke(app, ["check", "slots", "--remaps", "60", "--seed", "3", "--workdir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert r.output.strip().splitlines()[-1] == "slots: remaps=60 stale_reads=0"


def test_check_tiers_prints_the_result_line(tmp_path: Path) -> None:
    r = runner.invoke(app, ["check", "tiers", "--moves", "400", "--seed", "3", "--inject-every", "100",
                            "--workdir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert re.fullmatch(r"tiers: moves=400 verified=\d+ mismatches=0 misplaced=0 corrupt_detected=4",
                        r.output.strip().splitlines()[-1])
    assert "injected=4" in r.output


def test_bad_arguments_are_refused_with_a_reason() -> None:
    r = runner.invoke(app, ["check", "tiers", "--moves", "0"])
    assert r.exit_code == 2 and "moves" in r.output
    r = runner.invoke(app, ["check", "slots", "--device", "tpu"])
    assert r.exit_code == 2 and "device" in r.output
    r = runner.invoke(app, ["bench", "substrate", "--only", "bogus"])
    assert r.exit_code == 2 and "bogus" in r.output
    r = runner.invoke(app, ["bench", "engine", "--only", "moe,bogus"])
    assert r.exit_code == 2 and "bogus" in r.output
    r = runner.invoke(app, ["check", "exact", "--expert-map-in", "gpu"])
    assert r.exit_code == 2 and "'gpu'" in r.output and "'beside_copy'" in r.output
    r = runner.invoke(app, ["check", "exact", "--expert-map-in", "link"])  # the old name: refused, never aliased
    assert r.exit_code == 2 and "old name" in r.output and "use 'beside_copy'" in r.output
    r = runner.invoke(app, ["check", "exact", "--expert-store", "disk"])
    assert r.exit_code == 2 and "'disk'" in r.output and "'pinned'" in r.output
    r = runner.invoke(app, ["bench", "substrate", "--load-configs", "fastest"])
    assert r.exit_code == 2 and "'fastest'" in r.output and "'map-in'" in r.output


def test_bench_substrate_quick_writes_json_markdown_and_plot(tmp_path: Path) -> None:
    r = runner.invoke(app, ["bench", "substrate", "--device", "cpu", "--quick", "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "substrate_cpu.json").read_text())
    assert res["expert_loads"] and res["urgent_kv"] and set(res["links"]) == {"h2d", "d2h", "h2disk", "disk2h"}
    assert all(v["ratio"] > 0 for v in res["links"].values())
    assert {(e["map_in"], e["publish"]) for e in res["expert_loads"]} == {("beside_copy", "issued"),
                                                                        ("before_copy", "issued")}
    assert all(e["worker_us_per_load"]["issue"] > 0 for e in res["expert_loads"])
    assert "| link | engine GB/s" in (tmp_path / "substrate_cpu.md").read_text()
    assert (tmp_path / "substrate_cpu.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_ends_with_demo_ok(tmp_path: Path) -> None:
    r = runner.invoke(app, ["demo", "--workdir", str(tmp_path), "--requests", "16"])
    assert r.exit_code == 0, r.output
    assert r.output.strip().splitlines()[-1].startswith("demo: ok")
    assert "outputs identical with and without the controller: True" in r.output
    assert "controller plan history" in r.output and "v1: batch" in r.output  # each plan's reason, in words
    assert "every applied plan within it True" in r.output
    # the controller ran as a service: plans came over HTTP, the agent's link never did I/O on engine threads
    assert "controller (service):" in r.output and "0 socket calls on the engine's threads" in r.output
    assert "decisions page: http://127.0.0.1:" in r.output


def test_check_exact_prints_the_result_line(tmp_path: Path) -> None:
    r = runner.invoke(app, ["check", "exact", "--preset", "tiny", "--resident-frac", "0.25",
                            "--workdir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert r.output.strip().splitlines()[-1] == "exact: max_abs_diff=0.0 tokens_equal=True ok"


def test_check_exact_fails_when_nothing_was_offloaded(tmp_path: Path) -> None:
    r = runner.invoke(app, ["check", "exact", "--preset", "tiny", "--resident-frac", "1.0", "--new-tokens", "2",
                            "--workdir", str(tmp_path)])
    assert r.exit_code == 1, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("exact: max_abs_diff=0.0 tokens_equal=True FAILED: nothing was offloaded"), last


def test_check_exact_unknown_preset_is_a_clear_error() -> None:
    r = runner.invoke(app, ["check", "exact", "--preset", "gpt-5"])
    assert r.exit_code == 2 and "gpt-5" in r.output


def test_bench_engine_quick_writes_json_and_markdown(tmp_path: Path) -> None:
    r = runner.invoke(app, ["bench", "engine", "--device", "cpu", "--quick", "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "engine_cpu.json").read_text())
    assert len(res["moe"]) == 2 and len(res["attention"]) == 2 and len(res["decode"]) == 2 and len(res["prefill"]) == 2
    assert all(m["ratio"] > 0 for m in res["moe"]) and "SDPA" in (tmp_path / "engine_cpu.md").read_text()
    full, padded = res["attention"]  # a full bucket, and 3 sequences padded to a bucket of 4: both sizings timed
    assert full["padded_to"] == 2 and padded["padded_to"] == 4
    assert all(a["paged_ms_splits_by_padded_rows"] > 0 for a in (full, padded))
    assert padded["splits"] > padded["splits_by_padded_rows"]


def test_bench_engine_prefill_times_mixed_steps_on_both_decode_paths(tmp_path: Path) -> None:
    """The prefill section: a decode-only step, the same decodes beside a prefill, the prefill alone and a long
    one, on the paged kernel (Triton's interpreter here) and on the reference path, each mixed step set against
    the reference path's in the table; --profile writes the long prefill's profiler table."""
    r = runner.invoke(app, ["bench", "engine", "--device", "cpu", "--quick", "--only", "prefill", "--profile",
                            "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "engine_cpu.json").read_text())["prefill"]
    assert [x["decode_kernel"] for x in rows] == [False, True]
    assert all(x[k] > 0 for x in rows for k in ("decode_step_ms", "mixed_step_ms", "prefill_step_ms",
                                                 "long_prefill_step_ms"))
    md = (tmp_path / "engine_cpu.md").read_text()
    assert "| paged kernel |" in md and "| reference |" in md and "mixed / reference path's" in md
    assert "one prefill of 64 tokens" in (tmp_path / "profile_prefill_long.txt").read_text()


def test_bench_offload_quick_writes_json_markdown_and_plot(tmp_path: Path) -> None:
    r = runner.invoke(app, ["bench", "offload", "--device", "cpu", "--quick", "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "offload_cpu.json").read_text())
    rows = res["rows"]
    resident = [x for x in rows if x["frac"] == 1.0 and x["forced"]]
    offloaded = [x for x in rows if x["frac"] < 1.0]
    assert resident and all(x["executors"]["graph"] > 0 == x["executors"]["eager"] + x["executors"]["piecewise"]
                            for x in resident)  # forced all-resident decode replays the whole graph
    assert offloaded and all(x["executors"]["piecewise"] > 0 and x["miss_bytes_per_step"] > 0 for x in offloaded)
    assert any(x["lookahead"] for x in offloaded) and any(not x["forced"] for x in rows)
    assert "link floor" in (tmp_path / "offload_cpu.md").read_text() and (tmp_path / "offload_cpu.png").exists()


def test_bench_engine_attention_runs_on_a_plain_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: without Triton's interpreter the CPU run called the GPU kernel and died ('0 active drivers');
    it now times the engine's CPU path (gather by block table + SDPA) and says so."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = runner.invoke(app, ["bench", "engine", "--device", "cpu", "--quick", "--only", "attention",
                            "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "engine_cpu.json").read_text())
    assert [a["paged_kernel"] for a in res["attention"]] == ["torch gather + SDPA (CPU reference)"] * 2
