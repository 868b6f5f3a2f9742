"""KV value curves: the budget's admitted context and prefix hits, by hand on tiny traces and against exact LRU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.controller.kv_traces import planted_trace_rows, write_trace
from tierplan.controller.kv_demand import KVDemandModel, lru_prefix_hit_rate
from tierplan.controller.requests_jsonl import load_request_trace

SAMPLE = Path(__file__).parents[2] / "data" / "requests" / "mooncake_conversation_sample.jsonl"


def _trace(tmp_path: Path, rows: list[dict]):
    return load_request_trace(write_trace(tmp_path / "t.jsonl", rows))


def test_one_request_by_hand(tmp_path: Path) -> None:
    trace = _trace(tmp_path, [{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}])
    win = KVDemandModel(trace, decode_step_s=0.1, block_tokens=16, sample_s=0.1).window(0.0, 1.0)
    # Samples at 0.05, 0.15, ..., 0.95 s see 1024 prompt tokens + 0.5, 1.5, ..., 9.5 generated ones.
    assert win.demand_tokens_mean == pytest.approx(1029.0) and win.running_mean == pytest.approx(1.0)
    small, big = win.kv_value_curve([32, 1000])
    assert small.admitted_tokens == pytest.approx(512.0) and big.admitted_tokens == pytest.approx(1029.0)
    assert win.admitted_batch(32) == pytest.approx(np.mean(512.0 / (1024.0 + np.arange(10) + 0.5)))
    assert small.prefix_hit_rate == big.prefix_hit_rate == 0.0  # a first access always misses


def test_prefix_hits_need_the_leading_blocks_and_enough_cache(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": [0, 1, 2]},
            {"timestamp": 10_000, "input_length": 1536, "output_length": 1, "hash_ids": [0, 1, 5]},
            {"timestamp": 10_000, "input_length": 1536, "output_length": 1, "hash_ids": [7, 1, 2]}]
    win = KVDemandModel(_trace(tmp_path, rows), decode_step_s=1e-3).window(5.0, 15.0)
    # Second request: blocks 0 and 1 hit, 5 is new. Third: 7 is new, so 1 and 2 are not a prefix hit.
    none, ample = win.kv_value_curve([0, 10_000])
    assert win.num_prefix_blocks == 6 and none.prefix_hit_rate == 0.0 and ample.prefix_hit_rate == pytest.approx(2 / 6)
    assert lru_prefix_hit_rate(_trace(tmp_path, rows), 100, 5.0, 15.0) == pytest.approx(2 / 6)


@pytest.mark.parametrize("which", ["sample", "planted"])
def test_hit_rates_track_exact_lru(tmp_path: Path, which: str) -> None:
    trace = load_request_trace(SAMPLE) if which == "sample" else _trace(tmp_path, planted_trace_rows(seed=2))
    model = KVDemandModel(trace, decode_step_s=1e-6, block_tokens=512)  # ~no generated tokens held
    win = model.window(0.0, model.span_s + 1.0)
    # From about one prompt's blocks up (the sample's prompts average 28); below, it overestimates (0.03 at 1).
    capacities = [30, 100, 300, 1000, 3000, 10_000]
    approx = [p.prefix_hit_rate for p in win.kv_value_curve(capacities)]
    exact = [lru_prefix_hit_rate(trace, c) for c in capacities]
    assert np.abs(np.array(approx) - np.array(exact)).max() <= 0.03, (approx, exact)
    assert exact[-1] > exact[0] + 0.09  # the range of capacities matters on this trace
    assert win.kv_value_curve([0])[0].prefix_hit_rate == 0.0


def test_curves_grow_with_the_budget_and_windows_match_single_windows() -> None:
    model = KVDemandModel(load_request_trace(SAMPLE), decode_step_s=0.03, block_tokens=16)
    wins = model.windows(30.0)
    assert wins[0].start_s == 0.0 and wins[-1].end_s >= model.span_s
    assert sum(w.num_requests for w in wins) == 400
    options = [0, 100, 1000, 10_000, 100_000, 1_000_000]
    for w in wins:
        curve = w.kv_value_curve(options)
        assert [p.blocks for p in curve] == options
        hits, admitted = [p.prefix_hit_rate for p in curve], [p.admitted_tokens for p in curve]
        assert hits == sorted(hits) and admitted == sorted(admitted)
        assert admitted[-1] == pytest.approx(w.demand_tokens_mean)
        assert w.admitted_batch(options[-1]) == pytest.approx(w.running_mean)
        alone = model.window(w.start_s, w.end_s)  # direct path vs the sorted one used by windows()
        np.testing.assert_allclose(alone.ws_blocks, w.ws_blocks, rtol=1e-9, atol=1e-6)
        np.testing.assert_allclose(np.array(alone.kv_value_curve(options)), np.array(curve), rtol=1e-9)


@pytest.mark.parametrize(("call", "expected"), [
    (lambda m: m.window(0.0, 60.0).kv_value_curve([]), "blocks_options is empty"),
    (lambda m: m.window(0.0, 60.0).kv_value_curve([10, -1]), r"blocks_options\[1\] must be an int >= 0"),
    (lambda m: m.window(0.0, 60.0).kv_value_curve([True]), r"blocks_options\[0\] must be an int >= 0"),
    (lambda m: m.window(5.0, 5.0), "window needs 0 <= start_s < end_s"),
    (lambda m: m.windows(0.0), "window_s must be a positive finite number"),
])
def test_bad_arguments_are_refused_by_name(call, expected: str) -> None:
    model = KVDemandModel(load_request_trace(SAMPLE, limit=20), decode_step_s=0.03)
    with pytest.raises(ValueError, match=expected):
        call(model)


def test_a_bad_step_time_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_step_s must be a positive finite number"):
        KVDemandModel(load_request_trace(SAMPLE, limit=5), decode_step_s=float("nan"))
