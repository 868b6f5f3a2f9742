"""Reading a Mooncake request trace: the bundled sample loads whole; every bad line is refused by line and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierplan.controller.requests_jsonl import TraceError, load_request_trace, trace_from_rows

SAMPLE = Path(__file__).parents[2] / "data" / "requests" / "mooncake_conversation_sample.jsonl"
GOOD = '{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}'


def test_the_bundled_sample_loads_every_line() -> None:
    trace = load_request_trace(SAMPLE)
    assert trace.num_requests == 400 and trace.complete and trace.num_lines == 400
    assert trace.hash_ids[0] == tuple(range(14)) and trace.input_length[0] == 6758
    assert trace.num_blocks == sum(len(h) for h in trace.hash_ids)
    assert "all 400 lines read" in trace.summary()


def test_a_limit_says_the_file_was_not_read_whole() -> None:
    trace = load_request_trace(SAMPLE, limit=10)
    assert trace.num_requests == 10 and not trace.complete
    assert "10 of 400 lines read" in trace.summary()


def test_blank_lines_are_counted_not_hidden(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n\n" + GOOD.replace('"timestamp": 0', '"timestamp": 7') + "\n")
    trace = load_request_trace(path)
    assert trace.num_requests == 2 and trace.num_blank_lines == 1 and trace.complete
    assert list(trace.arrival_ms) == [0.0, 7.0]


@pytest.mark.parametrize(("line", "expected"), [
    ('{"timestamp": 0, "input_length": 1100', "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object, got list"),
    ('{"timestamp": 0, "input_length": 1100, "output_length": 5}', "line 2: missing field 'hash_ids'"),
    ('{"timestamp": 0, "input_length": -3, "output_length": 5, "hash_ids": []}',
     "line 2: field 'input_length' must be a positive int (tokens), got -3"),
    ('{"timestamp": 0, "input_length": 1100.0, "output_length": 5, "hash_ids": [0]}',
     "field 'input_length' must be a positive int (tokens), got 1100.0"),
    ('{"timestamp": 0, "input_length": 1100, "output_length": NaN, "hash_ids": [0]}',
     "line 2: not valid JSON (NaN is not a JSON number)"),
    ('{"timestamp": 0, "input_length": 1100, "output_length": true, "hash_ids": [0]}',
     "field 'output_length' must be a positive int (tokens), got True"),
    ('{"timestamp": "5", "input_length": 1100, "output_length": 5, "hash_ids": [0]}',
     "line 2: field 'timestamp' must be a non-negative number of ms, got '5'"),
    ('{"timestamp": 1e999, "input_length": 1100, "output_length": 5, "hash_ids": [0]}',
     "field 'timestamp' must be a non-negative number of ms, got inf"),
    ('{"timestamp": -1, "input_length": 1100, "output_length": 5, "hash_ids": [0]}',
     "field 'timestamp' must be a non-negative number of ms, got -1"),
    ('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2, 3]}',
     "line 2: field 'hash_ids' has 4 ids, but input_length=1100 covers at most ceil(1100/512) = 3 blocks"),
    ('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, -1]}',
     "field 'hash_ids' item 1 must be a non-negative int, got -1"),
    ('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [4, 5, 4]}',
     "field 'hash_ids' item 2 repeats id 4 of item 0"),
    ('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": "0"}',
     "field 'hash_ids' must be a list of non-negative ints"),
    ('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0], "tenant": 3}',
     "line 2: unknown field(s) ['tenant']"),
])
def test_a_bad_line_is_refused_by_line_and_field(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + "\n" + line + "\n")
    with pytest.raises(TraceError) as err:
        load_request_trace(path)
    assert expected in str(err.value) and str(path) in str(err.value)


def test_timestamps_must_not_go_back(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD.replace('"timestamp": 0', '"timestamp": 9') + "\n" + GOOD + "\n")
    with pytest.raises(TraceError, match=r"line 2: field 'timestamp' must not decrease \(previous line 9"):
        load_request_trace(path)


def test_bytes_that_are_not_utf8_are_refused_with_their_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes((GOOD + "\n" + GOOD + "\n").encode() + b'{"timestamp": \xff}\n')
    with pytest.raises(TraceError, match=r"line 3: not UTF-8 text \(byte 0xff"):
        load_request_trace(path)


@pytest.mark.parametrize(("content", "expected"), [("", "no requests"), ("\n  \n", "no requests")])
def test_an_empty_file_is_refused(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError, match=expected):
        load_request_trace(path)


def test_a_missing_file_and_a_bad_limit_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="file not found"):
        load_request_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="limit must be a positive int"):
        load_request_trace(SAMPLE, limit=0)


def test_rows_in_memory_give_the_same_trace_and_the_same_refusals() -> None:
    from_file = load_request_trace(SAMPLE, limit=50)
    rows = [{"timestamp": float(t), "input_length": int(i), "output_length": int(o), "hash_ids": list(h)}
            for t, i, o, h in zip(from_file.arrival_ms, from_file.input_length, from_file.output_length,
                                  from_file.hash_ids, strict=True)]
    from_rows = trace_from_rows(rows, source="replay")
    assert from_rows.hash_ids == from_file.hash_ids and list(from_rows.arrival_ms) == list(from_file.arrival_ms)
    assert from_rows.complete
    rows[7] = {**rows[7], "input_length": 0}
    with pytest.raises(TraceError, match=r"replay row 7: field 'input_length' must be a positive int"):
        trace_from_rows(rows, source="replay")
    with pytest.raises(TraceError, match="no rows"):
        trace_from_rows([], source="replay")
