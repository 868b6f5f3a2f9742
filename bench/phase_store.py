"""The phase diagram's JSON: a list of rows per model, written after every run (atomic rename), merged on rerun.

Runs in the bench process; pure Python. A row is keyed by (point, policy, device, code): a rerun skips the
runs whose key is already in the file (same code and device: the sweep may be spread over several calls), and
keeps every other row, so runs of earlier code or on another device stay in the file and the report chooses.
`code_id` fingerprints the package's Python sources (a user's clone may have no git) and the sweep's sizes.
It never edits a figure.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[1]


def code_id(extra: str = "") -> str:
    """sha256 (first 12 hex) over the package's .py files (tests excluded), path and bytes, and `extra` (the
    sweep's sizes: a run at other sizes is another measurement)."""
    h = hashlib.sha256(extra.encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(("tests/", ".venv")) or "/." in f"/{rel}":
            continue
        h.update(rel.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def run_key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    return row["point"], row["policy"], row["device"], row["code"]


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of `path` ([] when absent). ValueError naming the file when it is not a list of row objects."""
    if not path.exists():
        return []
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc}); move it aside or pass --fresh") from exc
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"point", "policy", "device", "code"} <= set(r)
                                             for r in rows):
        raise ValueError(f"{path}: expected a list of phase rows (each with point, policy, device and code); move it "
                         "aside or pass --fresh")
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write atomically: a reader (or a run killed mid-write) sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(rows, indent=1, default=str))
    os.replace(tmp, path)


def latest(rows: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """One row per (point, policy) on `device`: the newest written (later rows win), in the order last written."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        if r["device"] == device:
            out.pop((r["point"], r["policy"]), None)
            out[(r["point"], r["policy"])] = r
    return list(out.values())
