"""Chunked decode steps against the union model (bench/phase_chunking.py): what is measured, and each prediction."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tierplan.bench.phase_chunking import MIN_DECODE_STEPS, chunk_rows, p_chunked, section, token_probs, union_moments

E, K = 16, 2
PROBS = np.full((2, E), K / E)  # two MoE layers, uniform top-2 of 16
SLOT = 1 << 20


def _line(batches: list[int], chunked: list[bool], slots: tuple[int, int] = (10, 12), warm: int = 2) -> dict[str, Any]:
    """A run of `warm` warm-up steps, one prefill, then decode steps of `batches` tokens, some run chunked."""
    n = warm + 1 + len(batches)
    execs = [{"graph/warm": 1}] * warm + [{"eager/prefill": 1}] + [
        {"eager/layer_over_slots": 1} if c else {"piecewise/experts_missing": 1} for c in chunked]
    return {"point": "p", "policy": "resident", "run_id": "r", "warm_steps": warm, "slot_bytes": SLOT,
            "plans": {"1": {"expert_bytes_per_layer": [s * SLOT for s in slots], "kv_gpu_blocks": 8}},
            "steps": {"step_s": [0.01] * n, "num_prefills": [0] * warm + [1] + [0] * len(batches),
                      "batch_tokens": [3] * warm + [500] + batches, "executors": execs, "plan_version": [1] * n}}


def test_the_token_probs_of_a_routing_table() -> None:
    routes = np.array([[[0, 1]], [[0, 2]], [[3, 0]], [[1, 2]]])  # [T=4, M=1, k=2]
    assert token_probs(routes, 4).tolist() == [[0.75, 0.5, 0.5, 0.25]]


def test_the_union_grows_with_the_batch_and_the_batch_cv_widens_its_spread() -> None:
    mean2, _ = union_moments(PROBS, 2.0)
    mean6, sd6 = union_moments(PROBS, 6.0)
    assert mean2[0] == pytest.approx(E * (1 - (1 - K / E) ** 2)) and mean6[0] > mean2[0]
    _, wide = union_moments(PROBS, 6.0, batch_cv=0.5)
    assert (wide > sd6).all()
    assert p_chunked(PROBS, [4, 4], 6.0) > p_chunked(PROBS, [12, 12], 6.0)  # fewer slots, more chunking


def test_a_swinging_batch_chunks_more_than_its_mean_says_and_the_per_step_mixture_tells() -> None:
    """Batches of 2 and 10 alternating (mean 6): the steps at 10 run chunked at 10-12 slots a layer, those at 2
    never; the per-step mixture is each step's own chance averaged, the warm-up and the prefill left out."""
    batches = [2, 10] * (MIN_DECODE_STEPS // 2 + 1)
    (row,) = chunk_rows([_line(batches, [b == 10 for b in batches])], PROBS)
    assert row["steps"] == len(batches) and row["measured"] == 0.5 and row["min_slots"] == 10
    assert row["batch"] == 6.0 and row["batch_cv"] == pytest.approx(4 / 6)
    assert row["at_mean"] == pytest.approx(p_chunked(PROBS, [10, 12], 6.0))
    assert row["per_step"] == pytest.approx((p_chunked(PROBS, [10, 12], 2.0) + p_chunked(PROBS, [10, 12], 10.0)) / 2)
    assert abs(row["per_step"] - row["measured"]) < abs(row["at_mean"] - row["measured"])
    # The controller's price (controller/chunk_whole.py): quantiles of the batch over its median, here half at
    # 2 / 6 and half at 10 / 6, so the same mixture.
    assert row["swing"] == pytest.approx(row["per_step"])
    text = "\n".join(section([row]))
    assert "Mean absolute error, every plan (1): at_mean" in text and "| p | resident | r | 1 |" in text


def test_plans_with_too_few_decode_steps_or_no_executors_are_left_out() -> None:
    assert chunk_rows([_line([4] * (MIN_DECODE_STEPS - 1), [False] * (MIN_DECODE_STEPS - 1))], PROBS) == []
    line = _line([4] * MIN_DECODE_STEPS, [False] * MIN_DECODE_STEPS)
    del line["steps"]["executors"]
    assert chunk_rows([line], PROBS) == []
    assert section([])[-1].startswith("No plan with enough decode steps")


def test_a_plans_bytes_per_model_layer_are_read_at_the_moe_layers() -> None:
    """A model whose first layer is dense (deepseek's first three are): the plan's bytes are per model layer, the
    routing probabilities per MoE layer, so the slots are read at the MoE layers' indices, not dropped."""
    line = _line([4] * MIN_DECODE_STEPS, [False] * MIN_DECODE_STEPS)
    line["plans"]["1"]["expert_bytes_per_layer"] = [0, 10 * SLOT, 12 * SLOT]
    assert chunk_rows([line], PROBS) == []  # three layers against two rows of probabilities: not these layers
    (row,) = chunk_rows([line], PROBS, moe_layers=(1, 2))
    assert row["min_slots"] == 10 and row["at_mean"] == pytest.approx(p_chunked(PROBS, [10, 12], 4.0))
