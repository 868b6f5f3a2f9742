"""Read and validate a Mooncake request trace (jsonl) for the controller's KV demand models.

Runs in the controller (and the `tierplan eval kv-reuse` command) when it is given a trace file. One JSON
object per line: `timestamp` (ms since the trace start, non-decreasing), `input_length` and `output_length`
(positive ints, tokens) and `hash_ids` (ids of the prompt's 512-token prefix blocks; equal ids = reusable
prefix KV). The rules follow the runtime's loader (runtime/engine/workloads.py), which the controller must not
import; this one is stricter: unknown fields, more hash ids than the prompt's blocks (ceil(input_length / 512))
and an id repeated within one prompt are refused too.

Every non-blank line is read unless `limit` stops early; `RequestTrace.complete` says whether all were.
`trace_from_rows` builds the same trace from rows in memory (e.g. requests a replay already loaded).
A bad file raises `TraceError` naming the file, line, field, what was expected and what was found, and
nothing half-read is returned. It must never import runtime, decide anything, or keep state between calls.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BLOCK_TOKENS = 512  # Mooncake hash_ids cover 512-token prefix blocks
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A request trace that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class RequestTrace:
    """Requests in file order (= time order). Arrays are [R], R = num_requests."""

    path: Path
    arrival_ms: np.ndarray  # float64 [R], as in the file (not shifted to start at 0)
    input_length: np.ndarray  # int64 [R]
    output_length: np.ndarray  # int64 [R]
    hash_ids: tuple[tuple[int, ...], ...]  # [R] prefix block ids of each prompt
    num_lines: int  # lines in the file, blank ones included
    num_lines_read: int  # lines looked at (all of them unless `limit` stopped early)
    num_blank_lines: int  # blank lines among those read (skipped, counted here)

    @property
    def num_requests(self) -> int:
        return len(self.hash_ids)

    @property
    def complete(self) -> bool:
        """True when every line of the file was read."""
        return self.num_lines_read == self.num_lines

    @property
    def num_blocks(self) -> int:
        return sum(len(h) for h in self.hash_ids)

    def summary(self) -> str:
        span_s = (self.arrival_ms[-1] - self.arrival_ms[0]) / 1000.0
        read = (f"all {self.num_lines} lines read" if self.complete
                else f"{self.num_lines_read} of {self.num_lines} lines read (stopped at the limit)")
        return (f"{self.path.name}: {self.num_requests} requests, {self.num_blocks} prefix blocks, "
                f"{span_s:.0f} s of arrivals; {read}, {self.num_blank_lines} blank")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line_no = data[: exc.start].count(b"\n") + 1
        raise TraceError(f"request trace {path} line {line_no}: not UTF-8 text (byte {data[exc.start]:#04x} "
                         f"at file offset {exc.start})") from None


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


Checked = tuple[float, int, int, tuple[int, ...]]  # arrival ms, input length, output length, prefix hash ids


def _check_row(row: Any, at: str, prev_ms: float | None) -> Checked:
    if not isinstance(row, dict):
        raise TraceError(f"{at}: expected a JSON object, got {type(row).__name__}")
    for name in FIELDS:
        if name not in row:
            raise TraceError(f"{at}: missing field '{name}' (expected fields {', '.join(FIELDS)})")
    unknown = sorted(set(row) - set(FIELDS))
    if unknown:
        raise TraceError(f"{at}: unknown field(s) {unknown} (expected fields {', '.join(FIELDS)})")
    ts_ms = row["timestamp"]
    if isinstance(ts_ms, bool) or not isinstance(ts_ms, int | float) or not math.isfinite(ts_ms) or ts_ms < 0:
        raise TraceError(f"{at}: field 'timestamp' must be a non-negative number of ms, got {ts_ms!r}")
    if prev_ms is not None and ts_ms < prev_ms:
        raise TraceError(f"{at}: field 'timestamp' must not decrease (previous line {prev_ms!r}), got {ts_ms!r}")
    lengths = []
    for name in ("input_length", "output_length"):
        value = row[name]
        if not _is_int(value) or value < 1:
            raise TraceError(f"{at}: field '{name}' must be a positive int (tokens), got {value!r}")
        lengths.append(value)
    hash_ids = row["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TraceError(f"{at}: field 'hash_ids' must be a list of non-negative ints, got {hash_ids!r}")
    for i, h in enumerate(hash_ids):
        if not _is_int(h) or h < 0:
            raise TraceError(f"{at}: field 'hash_ids' item {i} must be a non-negative int, got {h!r}")
    max_blocks = -(-lengths[0] // BLOCK_TOKENS)
    if len(hash_ids) > max_blocks:
        raise TraceError(f"{at}: field 'hash_ids' has {len(hash_ids)} ids, but input_length={lengths[0]} covers "
                         f"at most ceil({lengths[0]}/{BLOCK_TOKENS}) = {max_blocks} blocks")
    if len(set(hash_ids)) != len(hash_ids):
        first: dict[int, int] = {}
        for i, h in enumerate(hash_ids):
            if h in first:
                raise TraceError(f"{at}: field 'hash_ids' item {i} repeats id {h} of item {first[h]} "
                                 "(a prefix block appears once per prompt)")
            first[h] = i
    return float(ts_ms), lengths[0], lengths[1], tuple(hash_ids)


def trace_from_rows(rows: Iterable[Mapping[str, Any]], source: str = "rows") -> RequestTrace:
    """The same trace from rows already in memory (dicts with the four fields, in time order), checked by
    the same rules; errors name `source` and the row's index. For callers that hold requests, not a file."""
    checked: list[Checked] = []
    for i, row in enumerate(rows):
        checked.append(_check_row(dict(row) if isinstance(row, Mapping) else row, f"request trace {source} row {i}",
                                  checked[-1][0] if checked else None))
    return _assemble(Path(source), checked, len(checked), len(checked), 0, "no rows")


def load_request_trace(path: str | Path, limit: int | None = None) -> RequestTrace:
    """Read a Mooncake jsonl trace; `limit` stops after that many requests (None: read every line)."""
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise TraceError(f"limit must be a positive int or None, got {limit!r}")
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"request trace {path}: file not found") from None
    except OSError as exc:
        raise TraceError(f"request trace {path}: cannot read ({exc.strerror or exc})") from None
    lines = _decode(path, data).splitlines()
    checked: list[Checked] = []
    num_read = num_blank = 0
    for line_no, line in enumerate(lines, start=1):
        if limit is not None and len(checked) >= limit:
            break
        num_read += 1
        if not line.strip():
            num_blank += 1
            continue
        at = f"request trace {path} line {line_no}"
        try:
            row = json.loads(line, parse_constant=_refuse_constant)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{at}: not valid JSON ({exc.msg} at column {exc.colno}); a Mooncake trace has one "
                             "JSON object per line") from None
        except ValueError as exc:  # NaN / Infinity, which Python's json would otherwise accept
            raise TraceError(f"{at}: not valid JSON ({exc})") from None
        checked.append(_check_row(row, at, checked[-1][0] if checked else None))
    return _assemble(path, checked, len(lines), num_read, num_blank, "the file is empty or blank")


def _assemble(path: Path, checked: list[Checked], num_lines: int, num_read: int, num_blank: int,
              empty_detail: str) -> RequestTrace:
    """The trace from checked rows (arrival ms, input length, output length, hash ids) in time order."""
    if not checked:
        raise TraceError(f"request trace {path}: no requests ({empty_detail})")
    lens = np.asarray([(c[1], c[2]) for c in checked], dtype=np.int64)  # [R, 2]
    return RequestTrace(path=path, arrival_ms=np.asarray([c[0] for c in checked], dtype=np.float64),
                        input_length=lens[:, 0], output_length=lens[:, 1], hash_ids=tuple(c[3] for c in checked),
                        num_lines=num_lines, num_lines_read=num_read, num_blank_lines=num_blank)
