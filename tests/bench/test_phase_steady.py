"""The steps report's steady throughput per prompt token (bench/phase_steady.py): each saved run restated at its
point's request mix, tierplan against the best static baseline by tok/s and by steady tok/s."""

from __future__ import annotations

from typing import Any

import pytest

from tierplan.bench.phase_steady import request_means, restated, run_figures, section

POINT = "m/L8/b8/c16384/g56"
MEANS = {POINT: (4.0, 100.0)}  # 4 tokens out and 100 prompt tokens a request


def _line(policy: str, prompts: list[int], run_id: str = "r1", device: str = "H100") -> dict[str, Any]:
    """Two warm-up decode steps, then a prefill step per prompt in `prompts` (0.4 ms a prompt token beside two
    decodes at 5 ms a sequence), then 8 decode steps of two sequences."""
    steps = [(0.010, 0, 2, 2)] * 2 + [(0.010 + p * 0.0004, 1, 2, p + 2) for p in prompts] + [(0.010, 0, 2, 2)] * 8
    cols = dict(zip(("cycle_s", "num_prefills", "num_decodes", "batch_tokens"), zip(*steps, strict=True),
                    strict=True))
    cols = {k: list(v) for k, v in cols.items()}
    cols["tokens_out"] = [n + d for n, d in zip(cols["num_prefills"], cols["num_decodes"], strict=True)]
    return {"point": POINT, "policy": policy, "run_id": run_id, "device": device, "status": "ok", "warm_steps": 2,
            "steps": cols}


def test_a_window_that_held_a_longer_prompt_is_not_charged_for_it() -> None:
    """kv_tiering's window prefilled a 100-token prompt, tierplan's a 300-token one, for the same output: by tok/s
    tierplan is 0.62x, by steady tok/s (both charged the prompt tokens their output implies) the two are even."""
    lines = [_line("tierplan", [300]), _line("kv_tiering", [100]), _line("resident", [100], device="H200")]
    (row,) = restated(lines, MEANS)
    assert row["best_tok_s"] == row["best_steady"] == "kv_tiering"
    assert row["vs_tok_s"] == pytest.approx(0.13 / 0.21)  # 19 tokens each: 0.13 + 0.08 s against 0.05 + 0.08
    assert row["vs_steady"] == pytest.approx(1.0)
    tok_s, steady = run_figures(lines[0], MEANS[POINT])
    # 19 tokens imply 4.75 requests, 475 prompt tokens: 175 beyond the 300 computed, at 0.4 ms each.
    assert tok_s == pytest.approx(19 / 0.21) and steady == pytest.approx(19 / (0.21 + 175 * 0.0004))


def test_the_newest_run_of_each_policy_and_only_points_with_a_static_baseline() -> None:
    old, new = _line("tierplan", [300], run_id="old"), _line("tierplan", [100], run_id="new")
    (row,) = restated([old, _line("static_lru", [100]), new], MEANS)
    assert row["run_id"] == "new" and row["vs_tok_s"] == pytest.approx(1.0)
    assert restated([new, _line("fluxmoe", [100])], MEANS) == []  # no static baseline: no row
    lacking = _line("kv_tiering", [100])
    del lacking["steps"]["batch_tokens"]  # saved before the column: not restated
    assert restated([new, lacking], MEANS) == [] and run_figures(lacking, MEANS[POINT]) is None
    assert restated([new, _line("kv_tiering", [100]) | {"point": "other"}], MEANS) == []  # no request mix known
    text = "\n".join(section([_line("tierplan", [300]), _line("kv_tiering", [100])], MEANS))
    assert "1 points; below 0.95x the best static by tok/s: 1, by steady tok/s: 0." in text
    assert "| H100 | m/L8/b8/c16384/g56 | r1 | 90.5 | 0.62 (kv_tiering) | 67.9 | 1.00 (kv_tiering) |" in text
    assert "No point here" in "\n".join(section([], MEANS))


def test_each_grid_point_has_its_request_mix() -> None:
    means = request_means()
    out, prompt = means["qwen3-30b-a3b/L8/b8/c16384/g56"]
    assert out > 0 and prompt == pytest.approx(16384, rel=0.1)  # prompts scaled to the context, capped at 2x
    assert len(means) == 90
