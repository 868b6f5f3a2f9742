"""`tierplan sim` as a user types it: bundled traces in, a summary, sim.json and sim.png out; bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierplan.api.cli import app

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
    assert data["summary"] == summary and len(data["steps"]["total_ms"]) == summary["steps"]
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


def test_a_chunked_step_price_slows_a_cache_too_small_for_a_steps_experts(tmp_path: Path) -> None:
    """`--chunked-step-ms` prices each decode step a layer's experts outrun its slots (a per-layer cache of 2 slots
    against top-2 of 8 experts at batch 8): the same steps and hits, each such step slower; the input is kept."""
    common = ["--requests", "synthetic:8,1e9,16,8", "--preset", "tiny", "--policy", "lru-layer",
              "--resident-frac", "0.25", "--json"]
    plain = _sim(*common, "--out", str(tmp_path / "a"))
    charged = _sim(*common, "--chunked-step-ms", "20", "--out", str(tmp_path / "b"))
    assert plain.exit_code == 0 and charged.exit_code == 0, plain.output + charged.output
    p, c = (json.loads(x.output.strip().splitlines()[-1]) for x in (plain, charged))
    assert p["steps"] == c["steps"] and p["expert_hit_rate"] == c["expert_hit_rate"]
    assert c["step_ms_mean"] > p["step_ms_mean"] + 5  # its decode steps; the prefills run eagerly anyway
    assert json.loads((tmp_path / "b" / "sim.json").read_text())["inputs"]["compute_params"]["chunked_step_ms"] == 20


def test_a_config_json_is_read(tmp_path: Path) -> None:
    from tierplan.controller.model_shape import BUILTIN_CONFIGS

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


def test_a_controller_plan_is_replayed_and_a_bad_one_refused(tmp_path: Path) -> None:
    from tierplan.controller.model_shape import builtin_shape
    from tierplan.controller.protocol import ExpertKey, Plan, Tier, to_json

    shape = builtin_shape("tiny")
    plan = Plan(plan_id="p", version=1, base_version=0, created_s=0.0, hbm_budget_bytes=1 << 20,
                expert_bytes_per_layer=(4 * shape.expert_bytes, 4 * shape.expert_bytes),
                kv_blocks_per_tier={Tier.GPU: 6}, pinned_experts=(ExpertKey(layer=0, expert=1),), reason="test")
    (tmp_path / "plan.json").write_text(to_json(plan))
    args = ["--requests", MOONCAKE, "--limit", "10", "--max-prompt-len", "48", "--max-output-len", "16",
            "--preset", "tiny", "--hbm-gb", "1", "--kv-gb", "0.001", "--workspace-gb", "0",
            "--out", str(tmp_path / "o"), "--json"]
    r = _sim(*args, "--policy", "plan", "--plan", str(tmp_path / "plan.json"))
    assert r.exit_code == 0, r.output
    s = json.loads(r.output.strip().splitlines()[-1])
    assert s["policy"] == "plan" and s["num_slots"] == 8 and 0 < s["expert_hit_rate"] < 1
    (tmp_path / "bad.json").write_text(to_json(plan).replace('"version":1', '"version":0'))
    r = _sim(*args, "--policy", "plan", "--plan", str(tmp_path / "bad.json"))
    assert r.exit_code == 2 and "version" in r.output and "Traceback" not in r.output
    r = _sim(*args, "--plan", str(tmp_path / "plan.json"))
    assert r.exit_code == 2 and "only with --policy plan" in r.output


def test_a_plan_is_replayed_whole_or_refused(tmp_path: Path) -> None:
    from tierplan.controller.model_shape import builtin_shape
    from tierplan.controller.protocol import ExpertKey, Plan, Tier, to_json

    eb = builtin_shape("tiny").expert_bytes
    plan = Plan(plan_id="p", version=1, base_version=0, created_s=0.0, hbm_budget_bytes=1 << 20,
                expert_bytes_per_layer=(2 * eb, 4 * eb), kv_blocks_per_tier={Tier.GPU: 5},
                pinned_experts=(ExpertKey(layer=0, expert=1),), reason="test")
    args = ["--requests", MOONCAKE, "--limit", "10", "--max-prompt-len", "48", "--max-output-len", "16",
            "--preset", "tiny", "--hbm-gb", "1", "--kv-gb", "0.001", "--workspace-gb", "0", "--policy", "plan"]
    (tmp_path / "plan.json").write_text(to_json(plan))
    r = _sim(*args, "--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "o"), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "o/sim.json").read_text())["inputs"]["kv_gpu_blocks"] == 5  # the plan's KV
    bad = {"part_slot": {"expert_bytes_per_layer": (2 * eb + eb // 2, 4 * eb)},
           "over_pinned": {"expert_bytes_per_layer": (eb, 4 * eb),
                           "pinned_experts": (ExpertKey(layer=0, expert=1), ExpertKey(layer=0, expert=2))},
           "no_kv": {"kv_blocks_per_tier": {Tier.GPU: 0}}}
    want = {"part_slot": "not a whole number of", "over_pinned": "pins 2 experts of layer 0, more than its 1 slots",
            "no_kv": "gives no GPU KV blocks"}
    for name, update in bad.items():
        path = tmp_path / f"{name}.json"
        path.write_text(to_json(plan.model_copy(update=update)))
        r = _sim(*args, "--plan", str(path), "--out", str(tmp_path / name))
        assert r.exit_code == 2, (name, r.output)
        assert f"error: --plan '{path}'" in r.output and want[name] in r.output and "Traceback" not in r.output
        assert not (tmp_path / name).exists()


def test_calibration_from_recorded_telemetry_changes_the_prediction(tmp_path: Path) -> None:
    from tests.controller.test_costmodel_calibrate import _window
    from tierplan.controller.protocol import to_json

    # The agent's windows of a machine whose steps take ~20 ms: the default prior (0.19 ms a layer) is far off.
    windows = [_window(i, 5 + i % 3, 8, 0, 0, 20.0, 0.0, gpu_blocks=3 + i % 3) for i in range(30)]
    (tmp_path / "tel.jsonl").write_text("\n".join(to_json(w) for w in windows) + "\n")
    args = ["--requests", "synthetic:6,1e9,8,4", "--preset", "tiny", "--hbm-gb", "1", "--kv-gb", "0.001",
            "--workspace-gb", "0", "--json"]
    plain = _sim(*args, "--out", str(tmp_path / "a"))
    fitted = _sim(*args, "--calibrate", str(tmp_path / "tel.jsonl"), "--out", str(tmp_path / "b"))
    assert plain.exit_code == 0 and fitted.exit_code == 0, plain.output + fitted.output
    assert "calibrated from 30 telemetry windows" in fitted.output
    p, f = (json.loads(x.output.strip().splitlines()[-1]) for x in (plain, fitted))
    assert p["decode_step_ms_p50"] < 2.0 and f["decode_step_ms_p50"] == pytest.approx(20.0, rel=0.1)
    (tmp_path / "bad.jsonl").write_text('{"schema_version": 1}\n')
    r = _sim(*args, "--calibrate", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "c"))
    assert r.exit_code == 2 and "line 1" in r.output and "Traceback" not in r.output
