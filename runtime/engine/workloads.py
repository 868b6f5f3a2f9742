"""Request replay: load real request traces (Mooncake jsonl, Azure LLM csv) into `Request`s (inference process).

Runs in the inference process (or a bench driver) before serving starts. It reads a trace file once, checks
every line, and returns plain frozen records: a bad line refuses the whole file with a `ConfigError` naming
file, line, field, expected and got, and nothing half-loaded is returned. It also makes CPU-sized versions of
the real traces (`scale_requests`) and deterministic prompt tokens whose shared prefixes follow the trace's
prefix-block ids (`synthetic_prompt_tokens`), so KV prefix reuse in a replay is the trace's real reuse.

Must never decide anything about scheduling or caching, never touch the network, and never need the
shared data folder: the bundled samples in `data/requests/` are enough for tests.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta, timezone
from enum import Enum
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np

from tierplan.runtime.errors import ConfigError

MOONCAKE_BLOCK_TOKENS = 512  # Mooncake hash_ids cover 512-token prefix blocks
_AZURE_FIELDS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TIMESTAMP_RE = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?\s*(Z|[+-]\d{2}:?\d{2})?$"
)
# Distinct SeedSequence stream tags, so prefix-block tokens never collide with per-request tokens.
_STREAM_PREFIX_BLOCK = 0
_STREAM_REQUEST_TAIL = 1


class TraceFormat(Enum):
    MOONCAKE = "mooncake"
    AZURE = "azure"


@dataclass(frozen=True)
class Request:
    """One request of a trace. `prefix_block_ids[j]` names tokens [j*512, (j+1)*512) of the prompt (Mooncake
    hash_ids): equal ids at equal positions mean a shared, reusable KV prefix."""

    request_id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_block_ids: tuple[int, ...]
    source: str

    def __post_init__(self) -> None:
        ints_ok = all(isinstance(v, Integral) and not isinstance(v, bool)
                      for v in (self.request_id, self.prompt_len, self.output_len))
        arrival_ok = isinstance(self.arrival_s, Real) and not isinstance(self.arrival_s, bool) and \
            math.isfinite(self.arrival_s) and self.arrival_s >= 0
        if not ints_ok or not arrival_ok or self.request_id < 0 or self.prompt_len < 1 or self.output_len < 1:
            raise ConfigError(
                f"Request needs request_id >= 0, arrival_s >= 0 (finite), prompt_len >= 1, output_len >= 1 (ints), "
                f"got {self.request_id!r}, {self.arrival_s!r}, {self.prompt_len!r}, {self.output_len!r}"
            )
        if any(b < 0 for b in self.prefix_block_ids):
            raise ConfigError(f"Request {self.request_id}: prefix_block_ids must be >= 0, got {self.prefix_block_ids}")


def _check_limit_and_scale(limit: int | None, time_scale: float) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit must be a positive int or None, got {limit!r}")
    if (
        isinstance(time_scale, bool)
        or not isinstance(time_scale, int | float)
        or not (math.isfinite(time_scale) and time_scale > 0)
    ):
        raise ConfigError(f"time_scale must be a positive finite number, got {time_scale!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError as exc:
        raise ConfigError(f"{what} {path}: file not found") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path}: cannot read as UTF-8 text ({exc})") from exc


def load_mooncake(path: str | Path, limit: int | None = None, time_scale: float = 1.0) -> list[Request]:
    """Mooncake jsonl (timestamp ms, input_length, output_length, hash_ids) -> requests in file order.

    `arrival_s` is relative to the first request, multiplied by `time_scale` (0.5 = twice the load).
    Timestamps must not decrease. Blank lines are skipped; `limit` stops after that many requests: the lines
    after the limit-th request are not read at all, so a bad line there is not reported. `hash_ids` may name
    at most the ceil(input_length / 512) blocks the prompt covers.
    """
    _check_limit_and_scale(limit, time_scale)
    path = Path(path)
    where = f"mooncake trace {path}"
    text = _read_text(path, "mooncake trace")
    requests: list[Request] = []
    first_ms: float | None = None
    prev_ms: float | None = None
    for line_no, line in enumerate(text.splitlines(), start=1):
        if limit is not None and len(requests) >= limit:
            break
        if not line.strip():
            continue
        at = f"{where} line {line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{at}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(row, dict):
            raise ConfigError(f"{at}: expected a JSON object, got {type(row).__name__}")
        for name in ("timestamp", "input_length", "output_length", "hash_ids"):
            if name not in row:
                raise ConfigError(f"{at}: missing field '{name}'")
        ts_ms = row["timestamp"]
        if isinstance(ts_ms, bool) or not isinstance(ts_ms, int | float) or not math.isfinite(ts_ms) or ts_ms < 0:
            raise ConfigError(f"{at}: field 'timestamp' must be a non-negative number of ms, got {ts_ms!r}")
        if prev_ms is not None and ts_ms < prev_ms:
            raise ConfigError(f"{at}: field 'timestamp' must not decrease (previous {prev_ms!r}), got {ts_ms!r}")
        for name in ("input_length", "output_length"):
            if not _is_int(row[name]) or row[name] < 1:
                raise ConfigError(f"{at}: field '{name}' must be a positive int, got {row[name]!r}")
        hash_ids = row["hash_ids"]
        if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
            raise ConfigError(f"{at}: field 'hash_ids' must be a list of non-negative ints, got {hash_ids!r}")
        num_blocks = -(-row["input_length"] // MOONCAKE_BLOCK_TOKENS)
        if len(hash_ids) > num_blocks:
            raise ConfigError(f"{at}: field 'hash_ids' names {len(hash_ids)} prefix blocks, but input_length="
                              f"{row['input_length']} covers {num_blocks} block(s) of {MOONCAKE_BLOCK_TOKENS} tokens "
                              f"(expected at most {num_blocks} ids)")
        if first_ms is None:
            first_ms = float(ts_ms)
        prev_ms = ts_ms
        requests.append(
            Request(
                request_id=len(requests),
                arrival_s=(ts_ms - first_ms) / 1000.0 * time_scale,
                prompt_len=row["input_length"],
                output_len=row["output_length"],
                prefix_block_ids=tuple(hash_ids),
                source=f"mooncake:{path.name}",
            )
        )
    if not requests:
        raise ConfigError(f"{where}: no requests (the file is empty)")
    return requests


def parse_timestamp_s(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' (any 1-9 fraction digits, optional Z/+hh:mm) -> POSIX seconds (naive = UTC).

    Raises ValueError with the text on a bad value; callers add file and line.
    """
    whole_s, fraction_s = _parse_timestamp(text)
    return whole_s + fraction_s


def _parse_timestamp(text: str) -> tuple[int, float]:
    """-> (whole POSIX seconds, fraction of a second): kept apart so differences keep 100 ns precision."""
    match = _TIMESTAMP_RE.match(text.strip())
    if match is None:
        raise ValueError(f"expected 'YYYY-MM-DD HH:MM:SS[.fraction]', got {text!r}")
    year, month, day, hour, minute, second, fraction, offset = match.groups()
    tz = UTC
    if offset and offset != "Z":
        sign = -1 if offset[0] == "-" else 1
        digits = offset[1:].replace(":", "")
        tz = timezone(sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:])))
    try:
        whole = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second), tzinfo=tz)
    except ValueError as exc:
        raise ValueError(f"not a valid date/time: {text!r} ({exc})") from exc
    return int(whole.timestamp()), (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def load_azure(path: str | Path, limit: int | None = None, time_scale: float = 1.0) -> list[Request]:
    """Azure LLM inference csv (TIMESTAMP, ContextTokens, GeneratedTokens) -> requests in file order.

    Line numbers in errors count the header as line 1. Timestamps must not decrease; no prefix ids.
    """
    _check_limit_and_scale(limit, time_scale)
    path = Path(path)
    where = f"azure trace {path}"
    lines = _read_text(path, "azure trace").splitlines()
    if not lines or not lines[0].strip():
        raise ConfigError(f"{where}: no header (the file is empty)")
    reader = csv.reader(lines)
    header = [h.strip() for h in next(reader)]
    missing = [f for f in _AZURE_FIELDS if f not in header]
    if missing:
        raise ConfigError(
            f"{where} line 1: header lacks field(s) {missing}, expected {list(_AZURE_FIELDS)}, got {header}"
        )
    col = {name: header.index(name) for name in _AZURE_FIELDS}
    requests: list[Request] = []
    first: tuple[int, float] | None = None
    prev: tuple[int, float] | None = None
    for line_no, cells in enumerate(reader, start=2):
        if limit is not None and len(requests) >= limit:
            break
        if not any(c.strip() for c in cells):
            continue
        at = f"{where} line {line_no}"
        if len(cells) != len(header):
            raise ConfigError(f"{at}: expected {len(header)} fields, got {len(cells)}")
        try:
            ts = _parse_timestamp(cells[col["TIMESTAMP"]])
        except ValueError as exc:
            raise ConfigError(f"{at}: field 'TIMESTAMP' {exc}") from exc
        if prev is not None and ts < prev:
            raise ConfigError(f"{at}: field 'TIMESTAMP' must not decrease, got {cells[col['TIMESTAMP']]!r}")
        lengths = {}
        for name in ("ContextTokens", "GeneratedTokens"):
            raw = cells[col[name]].strip()
            value = int(raw) if re.fullmatch(r"[+-]?\d+", raw) else None
            if value is None or value < 1:
                raise ConfigError(f"{at}: field '{name}' must be a positive int, got {raw!r}")
            lengths[name] = value
        if first is None:
            first = ts
        prev = ts
        requests.append(
            Request(
                request_id=len(requests),
                arrival_s=((ts[0] - first[0]) + (ts[1] - first[1])) * time_scale,
                prompt_len=lengths["ContextTokens"],
                output_len=lengths["GeneratedTokens"],
                prefix_block_ids=(),
                source=f"azure:{path.name}",
            )
        )
    if not requests:
        raise ConfigError(f"{where}: no requests (header only)")
    return requests


def detect_format(path: str | Path) -> TraceFormat:
    """.jsonl/.json -> Mooncake, .csv -> Azure; otherwise by the first non-blank line."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return TraceFormat.MOONCAKE
    if suffix == ".csv":
        return TraceFormat.AZURE
    for line in _read_text(path, "request trace").splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            return TraceFormat.MOONCAKE
        if "TIMESTAMP" in line:
            return TraceFormat.AZURE
        break
    raise ConfigError(
        f"request trace {path}: unknown format, expected Mooncake jsonl (lines of JSON objects) "
        f"or Azure csv (header with {', '.join(_AZURE_FIELDS)})"
    )


def load_requests(path: str | Path, limit: int | None = None, time_scale: float = 1.0) -> list[Request]:
    """Load a Mooncake or Azure trace, chosen by `detect_format`."""
    fmt = detect_format(path)
    loader = load_mooncake if fmt is TraceFormat.MOONCAKE else load_azure
    return loader(path, limit=limit, time_scale=time_scale)


def scale_requests(
    reqs: Sequence[Request],
    max_prompt_len: int,
    max_output_len: int,
    max_requests: int | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[Request]:
    """CPU-sized copy: first `max_requests`, lengths scaled by one factor per kind so the longest fits.

    Prompt lengths are multiplied by min(1, max_prompt_len / longest prompt) and rounded, at least 1 (output
    lengths likewise), so the length distribution keeps its shape. Prefix block ids are cut to the blocks
    that still cover the shorter prompt (ceil(prompt_len / block_tokens)); pass the same `block_tokens` to
    `synthetic_prompt_tokens`. Ids, arrivals and sources are kept.
    """
    for name, value in (
        ("max_prompt_len", max_prompt_len),
        ("max_output_len", max_output_len),
        ("block_tokens", block_tokens),
    ):
        if not _is_int(value) or value < 1:
            raise ConfigError(f"scale_requests: {name} must be a positive int, got {value!r}")
    if max_requests is not None and (not _is_int(max_requests) or max_requests < 0):
        raise ConfigError(f"scale_requests: max_requests must be a non-negative int or None, got {max_requests!r}")
    picked = list(reqs if max_requests is None else reqs[:max_requests])
    if not picked:
        return []
    prompt_factor = min(1.0, max_prompt_len / max(r.prompt_len for r in picked))
    output_factor = min(1.0, max_output_len / max(r.output_len for r in picked))
    out: list[Request] = []
    for r in picked:
        prompt_len = min(max_prompt_len, max(1, round(r.prompt_len * prompt_factor)))
        output_len = min(max_output_len, max(1, round(r.output_len * output_factor)))
        num_blocks = -(-prompt_len // block_tokens)
        out.append(
            replace(r, prompt_len=prompt_len, output_len=output_len, prefix_block_ids=r.prefix_block_ids[:num_blocks])
        )
    return out


def synthetic_prompt_tokens(
    req: Request, vocab_size: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS, seed: int = 0
) -> list[int]:
    """Deterministic prompt of exactly `req.prompt_len` token ids in [0, vocab_size).

    Tokens of prefix block j are drawn from (seed, prefix_block_ids[j]) only, so requests whose leading block
    ids agree get identical leading tokens; tokens after the prefix blocks come from (seed, request_id).
    """
    if not _is_int(vocab_size) or vocab_size < 1:
        raise ConfigError(f"synthetic_prompt_tokens: vocab_size must be a positive int, got {vocab_size!r}")
    if not _is_int(block_tokens) or block_tokens < 1:
        raise ConfigError(f"synthetic_prompt_tokens: block_tokens must be a positive int, got {block_tokens!r}")
    if not _is_int(seed) or seed < 0:
        raise ConfigError(f"synthetic_prompt_tokens: seed must be a non-negative int, got {seed!r}")
    parts: list[np.ndarray] = []
    num_tokens = 0
    for block_id in req.prefix_block_ids:
        if num_tokens >= req.prompt_len:
            break
        rng = np.random.default_rng([seed, _STREAM_PREFIX_BLOCK, block_id])
        parts.append(rng.integers(0, vocab_size, size=block_tokens, dtype=np.int64))  # [block_tokens]
        num_tokens += block_tokens
    if num_tokens < req.prompt_len:
        rng = np.random.default_rng([seed, _STREAM_REQUEST_TAIL, req.request_id])
        parts.append(rng.integers(0, vocab_size, size=req.prompt_len - num_tokens, dtype=np.int64))
    return np.concatenate(parts)[: req.prompt_len].tolist()
