"""Every run's per-step records, kept beside the phase JSON for study away from the device.

Runs in the bench process; pure Python. A row holds a run's means; fitting the cost model, or telling a few slow
steps from a slower device, needs the steps themselves, and the device's time is too scarce to run again for
them. `tierplan bench phase --save-steps` appends one gzip'd JSON line per run (oracle candidates included, and
since session 38 the runs that make no row: the cost model's calibration pass and each point's warm-up, `DISCARDED`) to
`phase_<model>_<day>_steps_<run id>.jsonl.gz` beside the JSON: one file per process, so the workers of a
`--gpus` sweep never write one file. A line holds the row's identity (`ROW_KEYS`), the warm-up steps, the slot
and KV block bytes, each applied plan's expert bytes per model layer, GPU KV blocks and reason by version, and the
`StepRecord` fields as columns (one list per field, in step order). They never change a row's figure.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any

ROW_KEYS = ("model", "point", "policy", "device", "code", "run_id", "oracle_split", "status")
# The statuses of runs that make no row, whose steps are kept since session 38 (bench/phase.py): the cost model's
# calibration pass at a model's first point and the warm-up run before each point's runs. Only the cost model's
# replay reads them (the process folded them in); every other reader skips them (`measured_lines`).
CALIBRATION, WARMUP = "calibration", "warmup"
DISCARDED = (CALIBRATION, WARMUP)


def measured_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lines of runs that made a row (or an oracle candidate): not the discarded ones."""
    return [line for line in lines if line.get("status") not in DISCARDED]


def steps_path(json_path: Path, run_id: str) -> Path:
    """The steps file of the process `run_id` beside the model's JSON."""
    return json_path.with_name(f"{json_path.stem}_steps_{run_id}.jsonl.gz")


def steps_line(row: dict[str, Any], outcome: Any, slot_bytes: int, kv_block_bytes: int) -> dict[str, Any]:
    """The line of one run: `row` (its identity), `outcome` (the runner's steps and applied plans)."""
    plans = outcome.extra.get("plans_applied") or {}
    steps = [dataclasses.asdict(s) for s in outcome.steps]
    return {**{k: row.get(k) for k in ROW_KEYS}, "warm_steps": row.get("warm_steps"),
            "window_steps": outcome.window_steps, "slot_bytes": slot_bytes, "kv_block_bytes": kv_block_bytes,
            "initial_plan_version": outcome.initial_plan.version,
            "plans": {str(v): {"expert_bytes_per_layer": list(p.expert_bytes_per_layer),
                               "kv_gpu_blocks": int(p.kv_blocks_per_tier.get("gpu", 0)),
                               "reason": p.reason}
                      for v, p in sorted(plans.items())},
            "steps": {k: [s[k] for s in steps] for k in (steps[0] if steps else {})}}


def append_steps(path: Path, line: dict[str, Any]) -> None:
    """One more line (a gzip member of its own: a run killed mid-write loses only its own line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "at", encoding="utf-8") as f:
        f.write(json.dumps(line, default=str) + "\n")


def load_steps(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a steps file. ValueError naming the file and line when one is not a run's."""
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            try:
                line = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc})") from exc
            if not isinstance(line, dict) or not {"point", "policy", "steps"} <= set(line):
                raise ValueError(f"{path}:{n}: expected a run's steps (point, policy, steps)")
            out.append(line)
    return out
