"""How fast the repository stores telemetry: `add_windows` in batches of 256 (the sidecar's batch) on SQLite and
PostgreSQL, with real windows of the tiny model (tests/controller/loop_fixtures.Windows) and a synthetic
48-layer, 128-expert window of the same structure (the size of a large MoE's telemetry).

Run by hand (not a test: it measures wall-clock time), e.g.
    PYTHONPATH=$PWD python -m tests.api.db.ingest_rate [--windows 20000] [--pg-url URL]
It prints windows/s and per-batch p50/p99 (ms) of add_windows, and how fast the service could parse such
batches (TelemetryBatch.model_validate_json, the cost before storage); without --pg-url it starts a throwaway
PostgreSQL (api/db/throwaway_pg.py).
It writes only to the temporary databases it makes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from tests.api.db.builders import registration, windows
from tierplan.api.db import migrate
from tierplan.api.db import throwaway_pg as pg
from tierplan.api.db.engine import make_engine
from tierplan.api.db.repo import Repository
from tierplan.controller.protocol import Telemetry, parse
from tierplan.controller.protocol_service import TelemetryBatch

BATCH = 256


def large_window(num_layers: int = 48, num_experts: int = 128, seed: int = 0) -> Telemetry:
    rng = np.random.default_rng(seed)
    layers = []
    for m in range(num_layers):
        counts = rng.multinomial(8 * 512, rng.dirichlet(np.ones(num_experts) * 0.3))
        pairs = sorted({tuple(sorted(rng.choice(num_experts, 2, replace=False).tolist())) for _ in range(64)})
        layers.append({"layer": m, "activation_counts": counts.tolist(), "router_entropy_mean": 2.1,
                       "num_tokens": 512, "cooccurrence": [[a, b, int(rng.integers(1, 50))] for a, b in pairs]})
    data = {"agent_id": "agent-0", "rank": 0, "window_seq": 0, "window_start_s": 0.0, "window_end_s": 1.0,
            "model": "large-synthetic", "num_layers": num_layers, "num_experts": num_experts, "layers": layers,
            "kv": {"blocks_per_tier": {"gpu": 4000, "cpu": 9000}, "hits_per_tier": {"gpu": 90000, "cpu": 300},
                   "misses_per_tier": {"cpu": 20}},
            "stalls": [{"cause": "expert_miss", "count": 12, "total_ms": 8.0}],
            "step_timings_ms": {"num_steps": 64, "mean": 30.0, "p50": 29.0, "p99": 41.0},
            "expert_hits": 20000, "expert_misses": 300, "applied_plan_version": 3}
    return parse(Telemetry, data)


def measure(url: str, template: Telemetry, num_windows: int) -> dict[str, float]:
    migrate.upgrade(url)
    engine = make_engine(url)
    repo = Repository(engine)
    repo.register_agent(registration(template.agent_id))
    batches = [[template.model_copy(update={"window_seq": i}) for i in range(start, min(start + BATCH, num_windows))]
               for start in range(0, num_windows, BATCH)]
    repo.add_windows(batches[0])  # warm the pool and the statement cache
    times_s = []
    begin = time.perf_counter()
    for batch in batches[1:]:
        t0 = time.perf_counter()
        repo.add_windows(batch)
        times_s.append(time.perf_counter() - t0)
    total_s = time.perf_counter() - begin
    engine.dispose()
    stored = sum(len(b) for b in batches[1:])
    ms = sorted(t * 1000 for t in times_s)
    # What a POST costs the service before storage: parsing and validating the batch's JSON.
    body = TelemetryBatch(windows=tuple(batches[1])).model_dump_json()
    t0 = time.perf_counter()
    TelemetryBatch.model_validate_json(body)
    parse_s = time.perf_counter() - t0
    return {"windows_per_s": stored / total_s, "batch_p50_ms": statistics.median(ms),
            "batch_p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "body_bytes": len(template.model_dump_json()),
            "parse_windows_per_s": len(batches[1]) / parse_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=20_000)
    parser.add_argument("--pg-url", default=None)
    args = parser.parse_args()
    cluster = None if args.pg_url else pg.start_cluster()
    admin = args.pg_url or cluster.url()  # type: ignore[union-attr]
    tiny = windows(1)[0]
    with tempfile.TemporaryDirectory() as tmp:
        for label, template in (("tiny (2 layers x 8 experts)", tiny), ("large (48 layers x 128 experts)",
                                                                        large_window())):
            for backend in ("sqlite", "postgresql"):
                url = (f"sqlite:///{Path(tmp) / f'{backend}-{template.num_layers}.db'}" if backend == "sqlite"
                       else pg.create_database(admin, "ingest"))
                got = measure(url, template, args.windows)
                print(f"{label:32s} {backend:10s} {got['windows_per_s']:9.0f} windows/s   batch of {BATCH}: "
                      f"p50 {got['batch_p50_ms']:6.1f} ms  p99 {got['batch_p99_ms']:6.1f} ms   "
                      f"({got['body_bytes']} bytes/window; parsing a batch alone: "
                      f"{got['parse_windows_per_s']:.0f} windows/s)")
    if cluster is not None:
        cluster.stop()


if __name__ == "__main__":
    main()
