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


def test_the_discarded_runs_are_folded_in_as_the_process_did_and_make_no_line_of_their_own(tmp_path: Path) -> None:
    """A calibration pass and a warm-up run saved before the first run (bench/phase.py) teach the fit as they
    taught the process, so the file's first run (one warm-up step of its own) is priced closer to its measured
    step than from the priors and that step; they are replayed as no run, and the report's other sections leave
    them out."""
    from tierplan.bench.phase_steps import CALIBRATION, WARMUP

    bare, kept = tmp_path / "phase_qwen3-30b-a3b_20261205_steps_r1.jsonl.gz", tmp_path / "kept" / "x_steps_r2.jsonl.gz"
    append_steps(bare, _run("tierplan", 3, warm=1))  # one warm-up step: alone, the fit is still its priors
    append_steps(kept, {**_run("resident", 1), "status": CALIBRATION})
    append_steps(kept, {**_run("static_lru", 2), "status": WARMUP})
    append_steps(kept, _run("tierplan", 3, warm=1))
    (cold,), (warm,) = replay_file(bare, load_steps(bare)), replay_file(kept, load_steps(kept))
    assert warm["policy"] == "tierplan" and abs(warm["ratio"] - 1) < abs(cold["ratio"] - 1) / 2, (cold, warm)
    md = report([kept])
    assert "| resident |" not in md.split("## The cost model replayed")[0] and "1 runs with decode steps" in md


def test_a_file_of_a_model_without_a_shape_is_named_and_the_rest_replayed(tmp_path: Path) -> None:
    mine, ours = tmp_path / "phase_mine_20261205_steps_a.jsonl.gz", tmp_path / "phase_q_20261205_steps_b.jsonl.gz"
    append_steps(mine, {**_run("resident", 0), "model": "mine"})
    append_steps(ours, _run("resident", 1))
    md = report([mine, ours])
    assert "Not replayed: phase_mine_20261205_steps_a.jsonl.gz: " in md and "model 'mine' has no built-in" in md
    assert "of 1 runs; median predicted / measured" in md  # the other file's one run


def test_given_the_routers_table_each_run_is_also_priced_at_the_misses_its_splits_predict(tmp_path: Path) -> None:
    """The rows' own figure, `predicted_step_ms`, replayed with this code: each step at the split of the plan it
    ran under, the misses the engine's residency replays there. A plan holding every expert predicts no miss (as
    measured here: the two prices agree); one of 8 slots a layer predicts some, so its price rises; a line saved
    before steps carried their plan is priced at its measured misses only."""
    from tierplan.bench.phase_cost_replay import router_table

    def planned(policy: str, seed: int, slots: int) -> dict[str, Any]:
        run = _run(policy, seed)
        n = len(run["steps"]["cycle_s"])
        run["steps"] |= {"expert_misses": [0] * n, "expert_stall_ms": [0.0] * n, "plan_version": [1] * n,
                         "expert_prefetch_hits": [0] * n}
        run["steps"]["cycle_s"] = [c - 0.3e-3 * m for c, m in zip(run["steps"]["cycle_s"], _run(policy, seed)[
            "steps"]["expert_misses"], strict=True)]  # the machine's step without the misses it no longer makes
        return run | {"initial_plan_version": 1,
                      "plans": {"1": {"expert_bytes_per_layer": [slots << 20] * 2, "kv_gpu_blocks": 64}}}

    path = tmp_path / "phase_qwen3-30b-a3b_20261205_steps_r1.jsonl.gz"
    for line in (_run("resident", 0), planned("resident", 1, 128), planned("resident", 2, 128),
                 planned("static_lru", 3, 8)):
        append_steps(path, line)
    shape = shape_of(_run("resident", 0))
    routes = router_table(shape)
    assert routes.shape == (4096, 2, 8) and routes.max() < 128
    got = replay_file(path, load_steps(path), routes)
    assert got[0]["predicted_ratio"] is None  # no plans saved with it
    assert got[2]["predicted_ratio"] == pytest.approx(got[2]["ratio"])  # every expert resident: no miss either way
    assert got[3]["predicted_ratio"] > got[3]["ratio"] + 0.05  # 8 slots of 128: the replayed misses are priced
    assert all(r["predicted_ratio"] is None for r in replay_file(path, load_steps(path)))  # no table, no figure
    text = "\n".join(section(got))
    assert "At the predicted misses" in text and "it): within 15%: " in text and "of 3 runs" in text, text


def test_a_plan_that_evicts_kv_blocks_pays_them_at_the_time_plan_changes_measured() -> None:
    """A step a new plan took effect at, whose share leaves no room for blocks the step before held, pays each
    at `evict_ms_per_block`, learned from the plan changes calibrated (their time outside the forward over the
    blocks the plan moved to the host: in the record of the step before, as the runner's hook books them), not
    folded into compute; priced at the measured misses, such a step pays the blocks its plan moved."""
    from types import SimpleNamespace

    from tierplan.bench.phase_cost_replay import router_table
    from tierplan.bench.phase_predictor import Predictor, predict_at_plans

    def steps(evicted: int, apply_ms: float) -> list[SimpleNamespace]:
        out = []
        for i in range(20):
            out.append(SimpleNamespace(
                batch_tokens=4, context_tokens=1600, expert_hits=8, expert_misses=0, expert_prefetch_hits=0,
                expert_stall_ms=0.0, kv_stall_ms=0.0, kv_fetch={"cpu": 0, "nvme": 0}, num_prefills=0,
                executors={}, cycle_s=0.004 + (apply_ms / 1e3 if i == 10 else 0.0), step_s=0.004,
                plan_version=1 if i < 10 else 2,
                # the plan applied after step 9 ended: its spill is in step 9's record, its time in step 10's cycle
                link_bytes={"h2d": 0, "d2h": (evicted if i == 9 else 0) * KV_BLOCK_BYTES}))
        return out

    shape = shape_of(_run("resident", 0))
    pred = Predictor.for_shape(shape, KV_BLOCK_BYTES, 2e9, ids_host=router_table(shape))
    prior = pred.evict_ms_per_block
    assert 0 < prior < 0.2  # the link's per-record prior and one block's bytes
    run = steps(40, 12.0)  # 40 blocks out (1,600 tokens held = 100 blocks, a share of 60) in 12 ms
    pred.calibrate(run[:8])
    assert pred.evict_ms_per_block == prior  # no plan change seen yet
    quiet = Predictor.for_shape(shape, KV_BLOCK_BYTES, 2e9, ids_host=router_table(shape))
    quiet.calibrate(steps(0, 12.0))  # a change that moved no block teaches nothing
    assert quiet.evict_ms_per_block == prior
    pred.calibrate(run[8:], before=run[7])
    assert pred.evict_ms_per_block == pytest.approx(0.3)
    plan = SimpleNamespace(expert_bytes_per_layer=[128 << 20] * 2, kv_gpu_blocks=60)
    roomy = SimpleNamespace(expert_bytes_per_layer=[128 << 20] * 2, kv_gpu_blocks=200)
    cut, source = predict_at_plans(pred, {2: plan}, plan, run[8:], before=run[7])
    kept, _ = predict_at_plans(pred, {2: roomy}, roomy, run[8:], before=run[7])
    assert cut - kept == pytest.approx(40 * 0.3 / 12) and "40 KV blocks the plans evicted" in source
    assert predict_at_plans(pred, {2: plan}, plan, run[11:], before=run[10])[0] == pytest.approx(
        predict_at_plans(pred, {2: roomy}, roomy, run[11:], before=run[10])[0])  # no change among these steps
    measured = pred.step_prices(run[8:], before=run[7])
    assert measured[2] - measured[1] == pytest.approx(40 * 0.3)  # the step the plan took effect at
    assert pred.step_prices(steps(0, 0.0)[8:])[2] == pytest.approx(measured[1])
