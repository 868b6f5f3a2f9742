"""`tierplan eval predictors`: the table, the JSON last line, and bad input refused with exit 2, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tierplan.api.cli import app

runner = CliRunner()
SAMPLE = Path(__file__).parents[1] / "data" / "routing" / "flame_moe_290m_sample.npz"


def _small_trace(path: Path, num_tokens: int = 120, num_layers: int = 3, num_experts: int = 8) -> Path:
    rng = np.random.default_rng(0)
    ids = np.stack([[rng.choice(num_experts, 2, replace=False) for _ in range(num_layers)]
                    for _ in range(num_tokens)]).astype(np.int16)  # [T, L, 2]
    np.savez(path, expert_ids=ids, weights=np.full(ids.shape, 0.5, np.float32),
             seq_id=np.zeros(num_tokens, np.int32), pos=np.arange(num_tokens, dtype=np.int32),
             phase=np.ones(num_tokens, np.uint8), layers=np.arange(num_layers, dtype=np.int32))
    return path


def _last_json(output: str) -> dict[str, dict[str, float]]:
    return json.loads(output.strip().splitlines()[-1])


def test_json_last_line_names_every_policy(tmp_path: Path) -> None:
    r = runner.invoke(app, ["eval", "predictors", "--trace", str(_small_trace(tmp_path / "t.npz")),
                            "--cache-frac", "0.5", "--batch", "2", "--json"])
    assert r.exit_code == 0, r.output
    result = _last_json(r.stdout)
    assert {"lru", "lfu", "lfru", "belady"} <= set(result)
    assert any(name.startswith("tierplan-") for name in result)
    for name, m in result.items():
        assert set(m) == {"hit_rate", "loads_per_demand"}, name
        assert 0.0 <= m["hit_rate"] <= 1.0
    assert "gap to belady" in r.stdout


def test_bundled_sample_belady_bounds_the_eviction_baselines() -> None:
    r = runner.invoke(app, ["eval", "predictors", "--trace", str(SAMPLE), "--cache-frac", "0.5", "--json"])
    assert r.exit_code == 0, r.output
    result = _last_json(r.stdout)
    for name in ("lru", "lfu", "lfru"):
        assert result[name]["hit_rate"] <= result["belady"]["hit_rate"]
        # Without prefetch every load is a miss.
        assert result[name]["loads_per_demand"] == pytest.approx(1 - result[name]["hit_rate"], abs=1e-5)


@pytest.mark.parametrize("setup, args, message", [
    (lambda d: None, ["--cache-frac", "0.5"], "file not found"),
    (lambda d: (d / "t.npz").write_bytes(b""), ["--cache-frac", "0.5"], "empty"),
    (lambda d: np.save((d / "t.npz").open("wb"), np.zeros(3)), ["--cache-frac", "0.5"], ".npy"),
    (lambda d: _small_trace(d / "t.npz"), ["--cache-frac", "0"], "--cache-frac must be in (0, 1]"),
    (lambda d: _small_trace(d / "t.npz"), ["--cache-frac", "1.01"], "--cache-frac must be in (0, 1]"),
    (lambda d: _small_trace(d / "t.npz"), ["--cache-frac", "0.5", "--batch", "0"], "--batch must be >= 1"),
])
def test_bad_input_exits_2_with_an_error_line(tmp_path: Path, setup, args: list[str], message: str) -> None:
    setup(tmp_path)
    r = runner.invoke(app, ["eval", "predictors", "--trace", str(tmp_path / "t.npz"), *args])
    assert r.exit_code == 2
    assert r.stderr.startswith("error: ") and message in r.stderr
    assert "Traceback" not in r.output
    assert r.stdout == ""
