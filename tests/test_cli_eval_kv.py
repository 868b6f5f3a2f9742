"""`tierplan eval kv-reuse`: a table and a last JSON line on good input; `error: ...` and exit 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierplan.api.cli import app

runner = CliRunner()
SAMPLE = Path(__file__).parents[1] / "data" / "requests" / "mooncake_conversation_sample.jsonl"


def test_json_last_line_maps_each_scorer_to_its_auc() -> None:
    r = runner.invoke(app, ["eval", "kv-reuse", "--trace", str(SAMPLE), "--horizon-min", "0.5", "--json"])
    assert r.exit_code == 0, r.output
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(last) == {"count", "recency", "logistic", "lightgbm", "logistic_online"}
    assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in last.values())
    assert "all 400 lines read" in r.stdout and "KVBM freq>=2 rule: precision" in r.stdout


def test_the_table_names_the_scorers_asked_for() -> None:
    r = runner.invoke(app, ["eval", "kv-reuse", "--trace", str(SAMPLE), "--horizon-min", "0.5",
                            "--scorers", "count,recency"])
    assert r.exit_code == 0, r.output
    assert "count" in r.stdout and "recency" in r.stdout and "logistic" not in r.stdout
    assert not r.stdout.strip().splitlines()[-1].startswith("{")


@pytest.mark.parametrize(("line", "args", "expected"), [
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1, 2]}', ["--horizon-min", "1"],
     "line 1: field 'hash_ids' has 3 ids, but input_length=600 covers at most ceil(600/512) = 2 blocks"),
    ("not json", ["--horizon-min", "1"], "line 1: not valid JSON"),
    (None, ["--horizon-min", "0"], "--horizon-min must be a positive number of minutes, got 0.0"),
    (None, ["--horizon-min", "1", "--scorers", "count,oracle"], "unknown scorer(s) ['oracle']"),
    (None, ["--horizon-min", "600"], "both reused and not-reused events are needed"),
])
def test_bad_input_is_an_error_line_and_exit_2(tmp_path: Path, line: str | None, args: list[str],
                                               expected: str) -> None:
    path = SAMPLE
    if line is not None:
        path = tmp_path / "bad.jsonl"
        path.write_text(line + "\n")
    r = runner.invoke(app, ["eval", "kv-reuse", "--trace", str(path), *args])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and expected in r.stderr
    assert "Traceback" not in r.output and r.stdout == ""


def test_a_missing_trace_is_an_error_line() -> None:
    r = runner.invoke(app, ["eval", "kv-reuse", "--trace", "/no/such/trace.jsonl", "--horizon-min", "1"])
    assert r.exit_code == 2 and r.stderr.strip() == "error: request trace /no/such/trace.jsonl: file not found"
