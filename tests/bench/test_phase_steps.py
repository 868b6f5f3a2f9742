"""Per-step records kept beside the phase JSON (bench/phase_steps.py): one line per run, columns per field."""

from __future__ import annotations

import gzip
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierplan.bench.phase_run import StepRecord
from tierplan.bench.phase_steps import append_steps, load_steps, steps_line, steps_path


def _step(i: int, version: int) -> StepRecord:
    return StepRecord(step_s=0.001 * i, cycle_s=0.002 * i, num_prefills=int(i == 0), num_decodes=3, tokens_out=4,
                      batch_tokens=4 + 60 * (i == 0), context_tokens=100 + i, expert_hits=5, expert_misses=i,
                      expert_stall_ms=0.5 * i, kv_stall_ms=0.0, kv_gpu_hits=2, kv_fetch={"cpu": i},
                      link_bytes={"h2d": 4096 * i}, gc_ms=0.0, plan_version=version)


def _outcome() -> SimpleNamespace:
    def plan(version: int, slots: int) -> SimpleNamespace:
        return SimpleNamespace(version=version, expert_bytes_per_layer=(slots * 4096, 0, slots * 4096),
                               kv_blocks_per_tier={"gpu": 10 * version, "cpu": 99},
                               reason=f"plan {version}: why")

    return SimpleNamespace(steps=[_step(i, 1 + (i >= 2)) for i in range(4)], window_steps=2,
                           initial_plan=plan(1, 3), extra={"plans_applied": {1: plan(1, 3), 2: plan(2, 5)}})


def test_a_runs_line_holds_its_identity_plans_and_every_step_field(tmp_path: Path) -> None:
    row = {"model": "tiny", "point": "tiny/L2/b4/c32/f1", "policy": "tierplan", "device": "cpu", "code": "abc",
           "run_id": "r1", "status": "ok", "warm_steps": 1, "decode_tok_s": 9.0}
    path = steps_path(tmp_path / "phase_tiny_20261204.json", "r1")
    assert path.name == "phase_tiny_20261204_steps_r1.jsonl.gz"
    append_steps(path, steps_line(row, _outcome(), slot_bytes=4096, kv_block_bytes=1024))
    append_steps(path, steps_line({**row, "policy": "resident"}, _outcome(), 4096, 1024))
    first, second = load_steps(path)
    assert (first["policy"], second["policy"]) == ("tierplan", "resident")
    assert first["point"] == row["point"] and first["run_id"] == "r1" and first["oracle_split"] is None
    assert "decode_tok_s" not in first  # the row keeps the figures; the line only names the run
    assert first["warm_steps"] == 1 and first["window_steps"] == 2 and first["slot_bytes"] == 4096
    assert first["plans"] == {"1": {"expert_bytes_per_layer": [12288, 0, 12288], "kv_gpu_blocks": 10,
                                    "reason": "plan 1: why"},
                              "2": {"expert_bytes_per_layer": [20480, 0, 20480], "kv_gpu_blocks": 20,
                                    "reason": "plan 2: why"}}
    cols = first["steps"]
    assert cols["plan_version"] == [1, 1, 2, 2] and cols["expert_misses"] == [0, 1, 2, 3]
    assert cols["link_bytes"][3] == {"h2d": 12288} and cols["cycle_s"][1] == pytest.approx(0.002)
    assert set(cols) == set(StepRecord.__dataclass_fields__)


def test_a_line_that_is_not_a_runs_steps_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x_steps_r.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write('{"point": "p", "policy": "q", "steps": {}}\n{"point": "p"}\n')
    with pytest.raises(ValueError, match=r"x_steps_r.jsonl.gz:2: expected a run's steps"):
        load_steps(path)
    with gzip.open(path, "wt") as f:
        f.write("not json\n")
    with pytest.raises(ValueError, match=r":1: not JSON"):
        load_steps(path)
