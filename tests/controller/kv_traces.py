"""Synthetic Mooncake request traces for the KV reuse tests, with a reuse pattern planted on purpose."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def planted_trace_rows(seed: int = 0, duration_s: float = 1800.0, sessions_per_s: float = 0.4) -> list[dict]:
    """Conversations of two kinds, half each: "deep" ones (a 6-block prompt, then 3-6 more turns 5-40 s apart,
    each one block longer) and "shallow" ones (one 2-block request, never back). Every prompt starts with a
    shared system block 0. A first turn has been seen zero times either way, so counting cannot tell the kinds
    apart, while the prompt's depth can: the planted pattern a learned model should find."""
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    next_id = 1
    t_s = 0.0
    while True:
        t_s += rng.exponential(1.0 / sessions_per_s)
        if t_s >= duration_s:
            break
        deep = bool(rng.random() < 0.5)
        depth = 6 if deep else 2
        num_turns = int(rng.integers(4, 8)) if deep else 1
        ids = list(range(next_id, next_id + depth - 1))
        next_id += depth - 1
        turn_s = t_s
        for _ in range(num_turns):
            hash_ids = [0, *ids]
            input_length = 512 * len(hash_ids) - int(rng.integers(0, 100))
            rows.append({"timestamp": round(turn_s * 1000), "input_length": input_length,
                         "output_length": int(rng.integers(1, 200)), "hash_ids": hash_ids})
            ids = [*ids, next_id]
            next_id += 1
            turn_s += rng.uniform(5.0, 40.0)
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
