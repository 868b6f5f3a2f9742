"""The cost model replayed over saved steps (bench/phase_cost_replay.py): a process's runs in the order they ran,
fitted as the rows' cost model is, each priced against its measured step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierplan.bench.phase_cost_replay import replay_file, section, shape_of
from tierplan.bench.phase_steps import append_steps, load_steps
from tierplan.bench.phase_steps_report import report

POINT = "qwen3-30b-a3b/L2/b4/c256/g1"
KV_BLOCK_BYTES = 16 * 2 * 2 * 4 * 128 * 2  # 16 tokens of 2 layers' K and V (4 KV heads of 128, bf16)


def _run(policy: str, seed: int, steps: int = 80, warm: int = 8) -> dict[str, Any]:
    """A run on a machine whose step costs 1 ms + 0.2 ms a token + 2 us a context token + 0.3 ms a miss, of
    which the agent times 0.1 ms a miss as its stall."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 9, steps)
    ctx = rng.integers(64, 1024, steps)
    misses = rng.integers(0, 12, steps)
    cycle_ms = 1.0 + 0.2 * tokens + 0.002 * ctx + 0.3 * misses
    return {"model": "qwen3-30b-a3b", "point": POINT, "policy": policy, "run_id": "r1", "status": "ok",
            "warm_steps": warm, "slot_bytes": 1 << 20, "kv_block_bytes": KV_BLOCK_BYTES,
            "steps": {"cycle_s": (cycle_ms / 1e3).tolist(), "num_prefills": [0] * steps, "gc_ms": [0.0] * steps,
                      "batch_tokens": tokens.tolist(), "context_tokens": ctx.tolist(),
                      "expert_hits": rng.integers(0, 16, steps).tolist(), "expert_misses": misses.tolist(),
                      "expert_stall_ms": (0.1 * misses).tolist(), "kv_stall_ms": [0.0] * steps,
                      "kv_fetch": [{"cpu": 0, "nvme": 0}] * steps}}


def test_the_shape_is_the_preset_cut_to_the_points_layers_with_the_runs_bytes() -> None:
    shape = shape_of(_run("resident", 0))
    assert (shape.num_layers, shape.moe_layers, shape.num_experts, shape.top_k) == (2, (0, 1), 128, 8)
    assert (shape.expert_bytes, shape.block_tokens) == (1 << 20, 16)
    with pytest.raises(ValueError, match="has no built-in shape"):
        shape_of({**_run("resident", 0), "model": "mine"})
    with pytest.raises(ValueError, match=r"expected <model>/L<layers>/"):
        shape_of({**_run("resident", 0), "point": "qwen3-30b-a3b/b4"})


def test_runs_are_fitted_in_order_and_priced_against_their_measured_step(tmp_path: Path) -> None:
    path = tmp_path / "phase_qwen3-30b-a3b_20261205_steps_r1.jsonl.gz"
    for i, pol in enumerate(("tierplan", "kv_tiering", "resident")):
        append_steps(path, _run(pol, i))
    got = replay_file(path, load_steps(path))
    assert [r["policy"] for r in got] == ["tierplan", "kv_tiering", "resident"]
    # the priors know nothing of this machine's compute; one run's steps teach the fit what the next ones cost
    assert all(r["ratio"] == pytest.approx(1.0, abs=0.15) for r in got[1:]), got
    text = "\n".join(section(got))
    assert "| resident | 1 | 1 |" in text and "Within 15%:" in text
    md = report([path])
    assert "## The cost model replayed" in md and "Not replayed" not in md


def test_a_file_of_a_model_without_a_shape_is_named_and_the_rest_replayed(tmp_path: Path) -> None:
    mine, ours = tmp_path / "phase_mine_20261205_steps_a.jsonl.gz", tmp_path / "phase_q_20261205_steps_b.jsonl.gz"
    append_steps(mine, {**_run("resident", 0), "model": "mine"})
    append_steps(ours, _run("resident", 1))
    md = report([mine, ours])
    assert "Not replayed: phase_mine_20261205_steps_a.jsonl.gz: " in md and "model 'mine' has no built-in" in md
    assert "of 1 runs; median predicted / measured" in md  # the other file's one run
