"""Request-trace replay and forced-routing replay on the samples bundled in data/ (never /work/shared)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from tierplan.runtime.engine.routing_trace import RoutingTrace, expert_hit_rate_lru
from tierplan.runtime.engine.workloads import (
    Request,
    TraceFormat,
    detect_format,
    load_azure,
    load_mooncake,
    load_requests,
    parse_timestamp_s,
    scale_requests,
    synthetic_prompt_tokens,
)
from tierplan.runtime.errors import ConfigError

DATA = Path(__file__).parents[2] / "data"
MOONCAKE = DATA / "requests" / "mooncake_conversation_sample.jsonl"
AZURE = DATA / "requests" / "azure2023_conv_sample.csv"
FLAME = DATA / "routing" / "flame_moe_290m_sample.npz"

MOONCAKE_LINE = {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _save_npz(path: Path, **overrides: np.ndarray | None) -> Path:
    arrays: dict[str, np.ndarray | None] = {
        "expert_ids": np.array([[[0, 1]], [[2, 3]]], np.int16),  # [T=2, L=1, K=2]
        "weights": np.full((2, 1, 2), 0.5, np.float32),
        "seq_id": np.zeros(2, np.int32),
        "pos": np.arange(2, dtype=np.int32),
        "phase": np.zeros(2, np.uint8),
        "layers": np.zeros(1, np.int32),
    }
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


# ---- request traces -------------------------------------------------------------------------------------------


def test_mooncake_sample_loads_with_shared_prefixes_as_shared_tokens() -> None:
    reqs = load_mooncake(MOONCAKE)
    assert len(reqs) == 400
    assert reqs[0] == Request(0, 0.0, 6758, 500, tuple(range(14)), "mooncake:mooncake_conversation_sample.jsonl")
    assert reqs[-1].arrival_s == pytest.approx(141.0)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    # Requests 0 and 1 share block 0 only; 97 and 394 (a long conversation) share their first 235 blocks.
    a, b = reqs[0], reqs[1]
    assert a.prefix_block_ids[0] == b.prefix_block_ids[0] and a.prefix_block_ids[1] != b.prefix_block_ids[1]
    ta = synthetic_prompt_tokens(a, vocab_size=32000)
    tb = synthetic_prompt_tokens(b, vocab_size=32000)
    assert len(ta) == a.prompt_len and len(tb) == b.prompt_len
    assert ta[:512] == tb[:512] and ta[512:1024] != tb[512:1024]
    c, d = reqs[97], reqs[394]
    assert c.prefix_block_ids[:235] == d.prefix_block_ids[:235] and c.prefix_block_ids[235] != d.prefix_block_ids[235]
    tc = synthetic_prompt_tokens(c, vocab_size=32000)
    td = synthetic_prompt_tokens(d, vocab_size=32000)
    assert tc[: 235 * 512] == td[: 235 * 512] and tc[235 * 512 : 236 * 512] != td[235 * 512 : 236 * 512]
    assert all(0 <= t < 32000 for t in ta)
    assert synthetic_prompt_tokens(a, vocab_size=32000) == ta  # deterministic
    assert synthetic_prompt_tokens(a, vocab_size=32000, seed=1) != ta


def test_limit_and_time_scale() -> None:
    reqs = load_mooncake(MOONCAKE, limit=10, time_scale=0.5)
    full = load_mooncake(MOONCAKE, limit=10)
    assert len(reqs) == 10
    assert [r.arrival_s for r in reqs] == [r.arrival_s * 0.5 for r in full]
    with pytest.raises(ConfigError, match="time_scale"):
        load_mooncake(MOONCAKE, time_scale=0)
    with pytest.raises(ConfigError, match="limit"):
        load_azure(AZURE, limit=0)


def test_azure_sample_timestamps_with_seven_fraction_digits() -> None:
    reqs = load_azure(AZURE)
    assert len(reqs) == 400
    assert reqs[0].prompt_len == 374 and reqs[0].output_len == 44 and reqs[0].prefix_block_ids == ()
    # 18:15:50.9951690 - 18:15:46.6805900
    assert reqs[1].arrival_s == pytest.approx(4.314579, abs=1e-9)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    assert reqs[-1].arrival_s == pytest.approx(106.330212, abs=1e-9)
    assert parse_timestamp_s("1970-01-01 00:00:01.5") == 1.5
    assert parse_timestamp_s("1970-01-01T00:00:01.0000001Z") == pytest.approx(1.0000001, abs=1e-12)
    assert parse_timestamp_s("1970-01-01 01:00:00+01:00") == 0.0


def test_load_requests_dispatches_by_extension_and_content(tmp_path: Path) -> None:
    assert load_requests(MOONCAKE)[0].source.startswith("mooncake:")
    assert load_requests(AZURE)[0].source.startswith("azure:")
    odd = tmp_path / "trace.txt"
    odd.write_text(AZURE.read_text())
    assert detect_format(odd) is TraceFormat.AZURE
    assert len(load_requests(odd, limit=3)) == 3
    (tmp_path / "what.txt").write_text("hello\n")
    with pytest.raises(ConfigError, match=r"what\.txt: unknown format"):
        load_requests(tmp_path / "what.txt")


def test_scale_requests_clips_proportionally_and_cuts_prefix_ids() -> None:
    reqs = load_mooncake(MOONCAKE)
    small = scale_requests(reqs, max_prompt_len=256, max_output_len=32, max_requests=50, block_tokens=16)
    assert len(small) == 50
    assert max(r.prompt_len for r in small) == 256 and min(r.prompt_len for r in small) >= 1
    assert max(r.output_len for r in small) <= 32 and min(r.output_len for r in small) >= 1
    longest = max(range(50), key=lambda i: reqs[i].prompt_len)
    for r, s in zip(reqs[:50], small, strict=True):
        assert (s.request_id, s.arrival_s) == (r.request_id, r.arrival_s)
        assert s.prefix_block_ids == r.prefix_block_ids[: -(-s.prompt_len // 16)]
        assert len(synthetic_prompt_tokens(s, vocab_size=100, block_tokens=16)) == s.prompt_len
    assert small[longest].prompt_len == 256
    # Already small enough: unchanged.
    assert scale_requests(reqs[:5], 10**6, 10**6, None) == reqs[:5]
    assert scale_requests(reqs, 8, 8, 0) == []
    with pytest.raises(ConfigError, match="max_prompt_len"):
        scale_requests(reqs, 0, 8, None)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"timestamp": 0, "input_length": 7', r"line 2: not valid JSON"),
        (json.dumps({k: v for k, v in MOONCAKE_LINE.items() if k != "hash_ids"}), r"line 2: missing field 'hash_ids'"),
        (
            json.dumps({**MOONCAKE_LINE, "input_length": -3}),
            r"line 2: field 'input_length' must be a positive int, got -3",
        ),
        (json.dumps({**MOONCAKE_LINE, "output_length": "5"}), r"line 2: field 'output_length' must be a positive int"),
        (json.dumps({**MOONCAKE_LINE, "hash_ids": [1, -2]}), r"line 2: field 'hash_ids' must be a list"),
        (json.dumps({**MOONCAKE_LINE, "timestamp": -1}), r"line 2: field 'timestamp' must be a non-negative"),
        ("[1, 2]", r"line 2: expected a JSON object"),
    ],
)
def test_mooncake_bad_line_names_file_line_and_field(tmp_path: Path, line: str, expected: str) -> None:
    path = _write_jsonl(tmp_path / "x.jsonl", [MOONCAKE_LINE, line, MOONCAKE_LINE])
    with pytest.raises(ConfigError, match=r"mooncake trace .*x\.jsonl " + expected):
        load_mooncake(path)


def test_mooncake_decreasing_timestamp_and_empty_file(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "x.jsonl", [{**MOONCAKE_LINE, "timestamp": 10}, MOONCAKE_LINE])
    with pytest.raises(ConfigError, match=r"x\.jsonl line 2: field 'timestamp' must not decrease"):
        load_mooncake(path)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match=r"empty\.jsonl: no requests"):
        load_mooncake(tmp_path / "empty.jsonl")
    with pytest.raises(ConfigError, match="file not found"):
        load_mooncake(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ("2023-11-16 18:15:47.1,-3,5", r"line 3: field 'ContextTokens' must be a positive int, got '-3'"),
        ("2023-11-16 18:15:47.1,3,x", r"line 3: field 'GeneratedTokens' must be a positive int, got 'x'"),
        ("16/11/2023 18:15,3,5", r"line 3: field 'TIMESTAMP' expected 'YYYY-MM-DD HH:MM:SS"),
        ("2023-11-16 18:15:40.0,3,5", r"line 3: field 'TIMESTAMP' must not decrease"),
        ("2023-11-16 18:15:47.1,3", r"line 3: expected 3 fields, got 2"),
    ],
)
def test_azure_bad_row_names_file_line_and_field(tmp_path: Path, row: str, expected: str) -> None:
    path = tmp_path / "y.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n{row}\n")
    with pytest.raises(ConfigError, match=r"azure trace .*y\.csv " + expected):
        load_azure(path)


def test_azure_bad_header_and_empty(tmp_path: Path) -> None:
    (tmp_path / "h.csv").write_text("TIMESTAMP,Context\n2023-11-16 18:15:46.6,1\n")
    with pytest.raises(ConfigError, match=r"h\.csv line 1: header lacks field\(s\) \['ContextTokens'"):
        load_azure(tmp_path / "h.csv")
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(ConfigError, match=r"e\.csv: no header"):
        load_azure(tmp_path / "e.csv")
    (tmp_path / "o.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ConfigError, match=r"o\.csv: no requests"):
        load_azure(tmp_path / "o.csv")


# ---- routing traces -------------------------------------------------------------------------------------------


def test_flame_sample_loads_with_meta_and_lru_sanity() -> None:
    trace = RoutingTrace.load(FLAME)
    assert (trace.num_tokens, trace.num_layers, trace.top_k, trace.num_experts) == (2048, 8, 6, 64)
    assert trace.layers.tolist() == list(range(2, 10))
    ids, weights = trace.routes(trace.num_tokens, trace.num_layers, 6, 64)
    assert np.array_equal(ids, trace.expert_ids)  # identity fit keeps the recorded ids
    assert np.allclose(weights.sum(-1), 1.0, atol=1e-5)
    hit = expert_hit_rate_lru((ids, weights), cache_experts_per_layer=32)
    assert 0.0 < hit < 1.0
    assert hit == pytest.approx(0.50, abs=0.03)  # 0.50 measured on the full shared trace with the same cache
    assert expert_hit_rate_lru(ids, 64) > hit


def test_routes_cycle_tokens_and_layers() -> None:
    trace = RoutingTrace.load(FLAME)
    num_t, num_l = trace.num_tokens, trace.num_layers
    ids, weights = trace.routes(3 * num_t, 2 * num_l, 6, 64)
    assert ids.shape == weights.shape == (3 * num_t, 2 * num_l, 6)
    assert ids.dtype == np.int64 and weights.dtype == np.float32
    assert np.array_equal(ids[num_t : 2 * num_t], ids[:num_t])
    assert np.array_equal(ids[:, num_l:], ids[:, :num_l])
    shifted, _ = trace.routes(5, 1, 6, 64, start=num_t - 2)
    assert np.array_equal(shifted[2:, 0], ids[:3, 0]) and np.array_equal(shifted[:2, 0], ids[num_t - 2 : num_t, 0])


def test_remap_to_fewer_experts_keeps_ids_distinct_and_in_range() -> None:
    trace = RoutingTrace.load(FLAME)
    for num_experts, top_k in ((8, 2), (8, 6), (6, 6), (16, 8), (128, 4)):
        ids, weights = trace.routes(300, 10, top_k, num_experts)
        assert ids.min() >= 0 and ids.max() < num_experts
        assert (np.diff(np.sort(ids, axis=-1), axis=-1) > 0).all()
        assert np.allclose(weights.sum(-1), 1.0, atol=1e-5)
        assert (weights >= 0).all()


def test_adapt_k_truncates_extends_and_renormalizes() -> None:
    trace = RoutingTrace.from_arrays(np.array([[[5, 2, 9]]]), np.array([[[0.5, 0.3, 0.2]]]))
    ids, w = trace.routes(1, 1, 2, 16)
    assert ids[0, 0].tolist() == [5, 2] and w[0, 0].tolist() == pytest.approx([0.625, 0.375])
    ids, w = trace.routes(1, 1, 5, 16)
    assert ids[0, 0].tolist() == [5, 2, 9, 10, 11] and w[0, 0].tolist() == pytest.approx([0.5, 0.3, 0.2, 0, 0])
    ids, _ = trace.routes(1, 1, 3, 4)  # 5 % 4 = 1, 2, 9 % 4 = 1 collides -> next unused is 3
    assert ids[0, 0].tolist() == [1, 2, 3]
    with pytest.raises(ConfigError, match="top_k must be <= num_experts"):
        trace.routes(1, 1, 5, 4)


def test_missing_entries_are_filled_deterministically() -> None:
    ids_in = np.array([[[3, -1, 7]], [[-1, -1, -1]], [[4, 6, 1]]])  # [T=3, L=1, K=3]
    w_in = np.array([[[0.6, np.nan, 0.2]], [[np.nan] * 3], [[0.5, np.nan, 0.1]]])
    trace = RoutingTrace.from_arrays(ids_in, w_in, num_experts=10)
    ids, w = trace.routes(3, 1, 3, 10)
    assert (np.diff(np.sort(ids, axis=-1), axis=-1) > 0).all() and ids.min() >= 0 and ids.max() < 10
    assert ids[0, 0, :2].tolist() == [3, 7]  # present ids keep their order, the missing one is appended
    assert w[0, 0].tolist() == pytest.approx([0.6 / 1.2, 0.2 / 1.2, 0.4 / 1.2])  # filled with the mean weight
    assert w[1, 0].tolist() == pytest.approx([1 / 3] * 3)  # all missing: equal weights
    assert w[2, 0].tolist() == pytest.approx([0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9])
    again, _ = RoutingTrace.from_arrays(ids_in, w_in, num_experts=10).routes(3, 1, 3, 10)
    assert np.array_equal(ids, again)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"expert_ids": np.zeros((2, 1, 2), np.int32)}, r"field 'expert_ids' must be int16 \[T, L, K\], got int32"),
        ({"weights": np.zeros((2, 1, 2), np.float64)}, r"field 'weights' must be float32"),
        ({"phase": np.zeros(2, np.int8)}, r"field 'phase' must be uint8"),
        ({"weights": np.zeros((2, 1, 3), np.float32)}, r"field 'weights' must have shape \(2, 1, 2\)"),
        ({"seq_id": np.zeros(3, np.int32)}, r"field 'seq_id' must have shape \(2,\)"),
        ({"layers": np.zeros(2, np.int32)}, r"field 'layers' must have shape \(1,\)"),
        ({"expert_ids": np.zeros((2, 2), np.int16)}, r"field 'expert_ids' must have shape \[T, L, K\]"),
        ({"pos": None}, r"missing field 'pos'"),
        ({"expert_ids": np.full((2, 1, 2), -2, np.int16)}, r"field 'expert_ids' must be >= 0 or -1"),
        ({"weights": np.full((2, 1, 2), -0.5, np.float32)}, r"field 'weights' must be finite and >= 0"),
        ({"phase": np.full(2, 3, np.uint8)}, r"field 'phase' must be 0 \(prefill\) or 1 \(decode\)"),
    ],
)
def test_bad_npz_names_file_and_field(tmp_path: Path, overrides: dict[str, np.ndarray | None], expected: str) -> None:
    path = _save_npz(tmp_path / "z.npz", **overrides)
    with pytest.raises(ConfigError, match=r"routing trace .*z\.npz: " + expected):
        RoutingTrace.load(path)


def test_npz_meta_and_unreadable_files(tmp_path: Path) -> None:
    path = _save_npz(tmp_path / "z.npz")
    assert RoutingTrace.load(path).num_experts == 4  # max id + 1 without meta
    (tmp_path / "z.meta.json").write_text(json.dumps({"num_experts": 16}))
    assert RoutingTrace.load(path).num_experts == 16
    (tmp_path / "z.meta.json").write_text(json.dumps({"num_experts": 2}))
    with pytest.raises(ConfigError, match=r"z\.npz: field 'expert_ids' holds expert 3 at \[.*\], but the trace "
                                          r"declares num_experts=2 \(expected ids 0\.\.1, or -1 for missing\)"):
        RoutingTrace.load(path)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match=r"bad\.npz: not a readable npz"):
        RoutingTrace.load(tmp_path / "bad.npz")
    with pytest.raises(ConfigError, match="file not found"):
        RoutingTrace.load(tmp_path / "none.npz")


def test_bad_route_arguments_refused() -> None:
    trace = RoutingTrace.from_arrays(np.array([[[0, 1]]]), np.array([[[0.7, 0.3]]]))
    ids, _ = trace.routes(4, 2, 2, 2)
    assert ids.shape == (4, 2, 2)
    with pytest.raises(ConfigError, match="num_layers must be an int >= 1"):
        trace.routes(4, 0, 2, 2)
    with pytest.raises(ConfigError, match="cache_experts_per_layer"):
        expert_hit_rate_lru(ids, 0)


# ---- bad input, as a new user would give it: a clear refusal naming what, where and what was expected -----------
def test_an_empty_or_npy_routing_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.npz").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"empty\.npz: the file is empty \(0 bytes; expected a normalized \.npz"):
        RoutingTrace.load(tmp_path / "empty.npz")
    np.save(tmp_path / "ids.npy", np.zeros((2, 1, 2), np.int16))
    with pytest.raises(ConfigError, match=r"ids\.npy: holds one array \(int16 \(2, 1, 2\), a \.npy file\), not an npz"):
        RoutingTrace.load(tmp_path / "ids.npy")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"pos": np.array([0, -4], np.int32)}, r"field 'pos' must be >= 0, got -4 at \[1\]"),
        ({"seq_id": np.array([-1, 0], np.int32)}, r"field 'seq_id' must be >= 0, got -1 at \[0\]"),
        ({"expert_ids": np.array([[[0, 1]], [[3, 3]]], np.int16)},
         r"field 'expert_ids' repeats an expert in row \[1, 0\]: \[3, 3\] \(expected distinct ids"),
        ({"weights": np.array([[[0.5, 0.5]], [[0.0, 0.0]]], np.float32)},
         r"field 'weights' is all zero in row \[1, 0\] \(expected a positive weight, or NaN for a missing one\)"),
    ],
)
def test_bad_routing_rows_are_refused(tmp_path: Path, overrides: dict[str, np.ndarray], expected: str) -> None:
    with pytest.raises(ConfigError, match=r"routing trace .*z\.npz: " + expected):
        RoutingTrace.load(_save_npz(tmp_path / "z.npz", **overrides))


def test_routing_ids_beyond_the_declared_num_experts_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"field 'expert_ids' holds expert 5 at \[0, 0, 1\], but the trace declares "
                                          r"num_experts=4 \(expected ids 0\.\.3"):
        RoutingTrace.from_arrays(np.array([[[0, 5]]]), np.array([[[0.5, 0.5]]]), num_experts=4)


def test_mooncake_lines_past_the_limit_are_not_read(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "x.jsonl", [MOONCAKE_LINE, MOONCAKE_LINE, "{not json"])
    assert len(load_mooncake(path, limit=2)) == 2  # as the docstring says: the third line is never read
    with pytest.raises(ConfigError, match=r"x\.jsonl line 3: not valid JSON"):
        load_mooncake(path, limit=3)


def test_mooncake_hash_ids_beyond_the_prompt_are_refused(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "x.jsonl", [{**MOONCAKE_LINE, "input_length": 600, "hash_ids": [0, 1, 2]}])
    with pytest.raises(ConfigError, match=r"x\.jsonl line 1: field 'hash_ids' names 3 prefix blocks, but "
                                          r"input_length=600 covers 2 block\(s\) of 512 tokens \(expected at most 2"):
        load_mooncake(path)


@pytest.mark.parametrize(("arrival_s", "prompt_len"), [(float("nan"), 5), (float("inf"), 5), (0.0, 5.0), (0.0, True)])
def test_a_request_with_a_nan_arrival_or_a_non_int_length_is_refused(arrival_s: float, prompt_len: object) -> None:
    with pytest.raises(ConfigError, match=r"Request needs .*arrival_s >= 0 \(finite\).*\(ints\), got 0, "):
        Request(0, arrival_s, prompt_len, 5, (), "test")  # type: ignore[arg-type]
    assert Request(0, 0.0, np.int64(5), 5, (), "test").prompt_len == 5  # numpy ints are ints
