"""How long a phase point's runs will take, from the rows already measured: what `--deadline-s` reads.

Runs in the bench process; pure Python over rows (bench/phase_store.py). A device call has a fixed time and the
code moves between calls, so a point cut off by the call's timeout is lost: its finished runs pair with no
others of the same code (phase_store `latest`). The sweep therefore starts a point only when the runs it has
left, priced from the nearest point measured before on this device, fit in the time left; a point with no such
history starts anyway (nothing to price it by). Each row's `run_s` is its run's wall time, the oracle's
candidate runs included.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tierplan.bench.phase_grid import Point

MODEL_OPEN_S = 90.0  # opening a model (pinned store, probe engine, calibration pass): 60-90 s in the H200 runs


def estimate_point_s(rows: list[dict[str, Any]], point: Point, policies: Iterable[str], device: str) -> float | None:
    """Seconds the runs of `policies` at `point` should take, from the point of the same model, batch and context
    measured on `device` whose budget is nearest `point`'s (the newest measurement where two tie): each policy at
    its newest time there, a policy that did not run there at the mean of those that did. None: no such point."""
    runs: dict[tuple[str, float], dict[str, tuple[str, float]]] = {}  # (code, budget) -> policy -> (when, run_s)
    for r in rows:
        if (r.get("model") != point.model or r.get("batch") != point.batch or r.get("context") != point.context
                or r.get("device") != device or r.get("status") == "candidate"
                or not isinstance(r.get("run_s"), int | float)):
            continue
        at = runs.setdefault((str(r.get("code")), float(r.get("hbm_budget_gib") or 0.0)), {})
        when = str(r.get("when") or "")
        if r["policy"] not in at or when >= at[r["policy"]][0]:
            at[r["policy"]] = (when, float(r["run_s"]))
    if not runs:
        return None
    newest = {k: max(w for w, _ in v.values()) for k, v in runs.items()}
    nearest = min(abs(b - point.budget_label_gib) for _, b in runs)
    key = max((k for k in runs if abs(k[1] - point.budget_label_gib) == nearest), key=lambda k: newest[k])
    times = {p: s for p, (_, s) in runs[key].items()}
    mean = sum(times.values()) / len(times)
    return sum(times.get(p, mean) for p in policies)
