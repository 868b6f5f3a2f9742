"""`tierplan sim` as a user types it: bundled traces in, a summary, sim.json and sim.png out; bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from api.cli import app

runner = CliRunner()
DATA = Path(__file__).resolve().parents[1] / "data"
ROUTING = str(DATA / "routing/flame_moe_290m_sample.npz")
MOONCAKE = str(DATA / "requests/mooncake_conversation_sample.jsonl")


def _sim(*args: str) -> object:
    return runner.invoke(app, ["sim", "--routing", ROUTING, *args])


def test_a_large_model_on_an_h200_writes_json_and_png(tmp_path: Path) -> None:
    r = _sim("--requests", MOONCAKE, "--limit", "20", "--max-prompt-len", "256", "--max-output-len", "16",
             "--preset", "qwen3-235b-a22b", "--link-gbps", "53.4", "--hbm-gb", "141", "--out", str(tmp_path),
             "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output.strip().splitlines()[-1])
    assert summary["requests"] == 20 and summary["tokens_out"] > 0 and 0 <= summary["expert_hit_rate"] <= 1
    data = json.loads((tmp_path / "sim.json").read_text())
    assert data["summary"] == summary and len(data["steps"]) == summary["steps"]
    assert data["inputs"]["model"] == "qwen3-235b-a22b" and 0 < data["inputs"]["resident_frac"] < 1
    assert (tmp_path / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_faster_link_makes_the_same_run_faster(tmp_path: Path) -> None:
    """All requests at once: the batches (so the hits) cannot depend on how fast the steps go."""
    common = ["--requests", "synthetic:12,1e9,64,8", "--preset", "mixtral-8x7b", "--hbm-gb", "80", "--json"]
    slow = _sim(*common, "--link-gbps", "50", "--out", str(tmp_path / "a"))
    fast = _sim(*common, "--link-gbps", "450", "--out", str(tmp_path / "b"))
    assert slow.exit_code == 0 and fast.exit_code == 0, slow.output + fast.output
    s, f = (json.loads(x.output.strip().splitlines()[-1]) for x in (slow, fast))
    assert s["steps"] == f["steps"] and s["expert_hit_rate"] == f["expert_hit_rate"]
    assert f["tokens_per_s"] > 3 * s["tokens_per_s"]


def test_a_config_json_is_read(tmp_path: Path) -> None:
    from controller.model_shape import BUILTIN_CONFIGS

    (tmp_path / "config.json").write_text(json.dumps(BUILTIN_CONFIGS["qwen3-30b-a3b"]))
    r = _sim("--requests", "synthetic:5,10,32,4", "--config", str(tmp_path), "--out", str(tmp_path / "o"), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["requests"] == 5


@pytest.mark.parametrize(("args", "message"), [
    (["--requests", MOONCAKE], "exactly one of --preset"),
    (["--requests", MOONCAKE, "--preset", "tiny", "--config", "x.json"], "both given"),
    (["--requests", MOONCAKE, "--preset", "gpt-9"], "unknown preset 'gpt-9'"),
    (["--requests", MOONCAKE, "--preset", "tiny", "--policy", "random"], "--policy 'random'"),
    (["--requests", "nope.jsonl", "--preset", "tiny"], "no such file"),
    (["--requests", "synthetic:3,0,1,1", "--preset", "tiny"], "synthetic:NUM"),
    (["--requests", MOONCAKE, "--preset", "deepseek-v3", "--hbm-gb", "10"], "holds no expert slot"),
    (["--requests", MOONCAKE, "--preset", "tiny", "--config", "x.json"], "both given"),
])
def test_bad_input_is_refused_with_exit_2_and_no_traceback(tmp_path: Path, args: list[str], message: str) -> None:
    r = _sim(*args, "--out", str(tmp_path / "o"))
    assert r.exit_code == 2, r.output
    assert f"error: {message}" in r.output or message in r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


def test_a_bad_routing_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "r.npz"
    bad.write_bytes(b"not an npz")
    r = runner.invoke(app, ["sim", "--routing", str(bad), "--requests", MOONCAKE, "--preset", "tiny"])
    assert r.exit_code == 2 and "routing trace" in r.output and "Traceback" not in r.output
