"""`tierplan bench offload --model DIR` runs a checkpoint's real weights whole; `--models` with it is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierplan.api.cli import app

pytest.importorskip("transformers")
runner = CliRunner()


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_bench_offload_runs_a_checkpoint(family: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    folder = checkpoints[family]
    r = runner.invoke(app, ["bench", "offload", "--device", "cpu", "--quick", "--model", str(folder),
                            "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / f"offload_cpu_{folder.name}.json").read_text())
    assert res["meta"]["model_dir"] == str(folder.resolve())
    rows = res["rows"]
    assert rows and {x["model"] for x in rows} == {folder.name}  # the checkpoint, not the preset sweep
    assert any(x["frac"] < 1.0 and x["miss_bytes_per_step"] > 0 for x in rows)
    assert (tmp_path / f"offload_cpu_{folder.name}.md").exists() and not (tmp_path / "offload_cpu.json").exists()


def test_bench_offload_refuses_models_with_model(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    r = runner.invoke(app, ["bench", "offload", "--device", "cpu", "--quick", "--models", "tiny",
                            "--model", str(checkpoints["olmoe"]), "--out-dir", str(tmp_path)])
    assert r.exit_code == 2 and "Invalid value for --models / --model" in r.output, r.output
    r = runner.invoke(app, ["bench", "offload", "--device", "cpu", "--quick", "--model", str(tmp_path / "none"),
                            "--out-dir", str(tmp_path)])
    assert r.exit_code == 2 and "not a folder" in " ".join(r.output.split()) and not list(tmp_path.glob("offload_*"))
