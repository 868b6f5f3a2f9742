"""The phase diagram's JSON: a list of rows per model, merged into the file after every run under a file lock.

Runs in the bench process; pure Python. A row is keyed by (point, policy, device, code, repeat). A rerun skips a
run whose key already has a result in the file ("ok" or "degraded": a degraded run is a measurement); "error"
and "refused" rows are retried (a one-off OOM or a missing wheel must not stick), and "candidate" rows are the
oracle's finished candidate splits (its search resumes from them). Every write re-reads the file and appends
under an exclusive `fcntl` lock on its folder, so two processes sharing one JSON never lose a row.
`latest` pairs rows of one code id only at each point (the newest), so a report never sets a new tierplan row
against old-code baselines, and shows each policy's median run where it ran more than once (`--repeats`).
`code_id` fingerprints the Python files a run imports: with a git checkout, the ones git tracks or would add
(`git ls-files -co --exclude-standard`: what the device copy of the working tree holds); without one (the
device's copy), the package's .py files outside .gitignore'd folders (build/ ...).
`merge_file` appends another call's copy of a file (a device run's, started from the same committed rows) to it,
each row once. It never edits a figure.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[1]
DONE_STATUSES = ("ok", "degraded")  # a rerun skips these; "error" / "refused" are retried
CANDIDATE = "candidate"  # an oracle candidate split's own run (never a row of the report)


def _git_files(root: Path) -> list[str] | None:
    """Tracked plus untracked-not-ignored .py files under `root` (None: no git checkout or no git)."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z", "--", "*.py"],
                             capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sorted({p for p in out.decode().split("\0") if p and (root / p).is_file()})


def _ignore_patterns(root: Path) -> list[str]:
    path = root / ".gitignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [s.strip().strip("/") for s in lines if s.strip() and not s.startswith(("#", "!"))]


def _tree_files(root: Path) -> list[str]:
    """The package's .py files outside hidden folders and the folders .gitignore names."""
    pats = _ignore_patterns(root)
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if any(p.startswith(".") for p in parts[:-1]):
            continue
        if any(fnmatch.fnmatch(part, pat) for part in parts[:-1] for pat in pats) or any(
                fnmatch.fnmatch(rel, pat) for pat in pats):
            continue
        out.append(rel)
    return sorted(out)


def code_files(root: Path = PACKAGE) -> list[str]:
    """The files `code_id` hashes (tests excluded: they never change a measurement)."""
    files = _git_files(root)
    return [f for f in (files if files is not None else _tree_files(root)) if not f.startswith("tests/")]


def code_id(extra: str = "", root: Path = PACKAGE) -> str:
    """sha256 (first 12 hex) over `code_files` (path and bytes) and `extra` (the sweep's sizes: a run at other
    sizes is another measurement)."""
    h = hashlib.sha256(extra.encode())
    for rel in code_files(root):
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()[:12]


def repeat_of(row: dict[str, Any]) -> int:
    """Which of a policy's runs at a point `row` is (`--repeats`): rows written before repeats existed are 0."""
    return int(row.get("repeat") or 0)


def run_key(row: dict[str, Any]) -> tuple[str, str, str, str, int]:
    """(point, policy, device, code, repeat)."""
    return row["point"], row["policy"], row["device"], row["code"], repeat_of(row)


def done_keys(rows: list[dict[str, Any]]) -> set[tuple[str, str, str, str, int]]:
    """Keys of the runs a rerun skips (a result: ok or degraded)."""
    return {run_key(r) for r in rows if r.get("status") in DONE_STATUSES}


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of `path` ([] when absent). ValueError naming the file when it is not a list of row objects."""
    if not path.exists():
        return []
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc}); move it aside") from exc
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"point", "policy", "device", "code"} <= set(r)
                                             for r in rows):
        raise ValueError(f"{path}: expected a list of phase rows (each with point, policy, device and code); move it "
                         "aside")
    return rows


def write_json(path: Path, value: Any) -> None:
    """Write atomically: a reader (or a run killed mid-write) sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str))
    os.replace(tmp, path)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """The rows, written atomically (`write_json`)."""
    write_json(path, rows)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock for read-merge-write of `path`, held until the block ends. It locks the folder (the
    file itself is replaced by each write, and a sidecar lock file would litter bench/results/)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def append_row(path: Path, row: dict[str, Any], seed: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Under the lock: the file's rows as they are now (`seed` when the file does not exist yet: an earlier
    day's rows carried over), plus `row`, written atomically; returns them (what other writers added included)."""
    with locked(path):
        rows = load_rows(path) if path.exists() else list(seed or [])
        rows.append(row)
        write_rows(path, rows)
    return rows


def latest(rows: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """The report's rows on `device`: at each point only the rows of the code id of the point's newest row (never
    old-code rows beside new ones), one per policy, in the order last written. Of each repeat the newest written
    counts (later rows win); a policy that ran several repeats shows its median run by tok/s (the lower middle
    of an even count; runs without a throughput only where none has one), with every repeat's tok/s, sorted, in
    `repeat_tok_s`. Oracle candidate rows are left out."""
    mine = [r for r in rows if r["device"] == device and r.get("status") != CANDIDATE]
    newest_code = {r["point"]: r["code"] for r in mine}  # later rows win
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in mine:
        if r["code"] == newest_code[r["point"]]:
            key = (r["point"], r["policy"], repeat_of(r))
            runs.pop(key, None)
            runs[key] = r
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    last: dict[tuple[str, str], int] = {}  # where each policy's newest repeat was written
    for i, ((point, policy, _), r) in enumerate(runs.items()):
        by.setdefault((point, policy), []).append(r)
        last[(point, policy)] = i
    return [_median_run(by[k]) for k in sorted(by, key=last.__getitem__)]


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    if len(runs) == 1:
        return runs[0]
    ran = sorted((r for r in runs if r.get("decode_tok_s")), key=lambda r: r["decode_tok_s"])
    if not ran:
        return runs[-1]
    return {**ran[(len(ran) - 1) // 2], "repeat_tok_s": [r["decode_tok_s"] for r in ran]}


def row_identity(row: dict[str, Any]) -> tuple[Any, ...]:
    """One run's row, wherever it was copied: its key, the run it came from and when it was written."""
    return (*run_key(row), row.get("run_id"), row.get("when"), row.get("status"))


def merge_file(target: Path, source: Path) -> tuple[list[dict[str, Any]], int]:
    """Under the lock: `source`'s rows that `target` lacks appended to it, in `source`'s order (rows another call
    measured, e.g. on a device, from the same start as this file); returns the merged rows and how many were
    added. ValueError naming the file when either is not a list of phase rows, or their models differ."""
    new = load_rows(source)
    models = {r.get("model") for r in new}
    if len(models) > 1:
        raise ValueError(f"{source}: rows of several models {sorted(map(str, models))}; expected one model a file")
    with locked(target):
        rows = load_rows(target)
        have = {r.get("model") for r in rows}
        if rows and new and have != models:
            raise ValueError(f"{source}: rows of {sorted(map(str, models))}, but {target} holds "
                             f"{sorted(map(str, have))}")
        seen = {row_identity(r) for r in rows}
        added = [r for r in new if row_identity(r) not in seen]
        if added:
            rows = rows + added
            write_rows(target, rows)
    return rows, len(added)
