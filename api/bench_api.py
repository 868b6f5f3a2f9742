"""Telemetry ingest benchmark of the controller service on loopback (what `tierplan bench api` will run).

Runs in the user's shell: starts `tierplan serve` as a real subprocess on a free port against the given
database, registers agents of the tiny model, and POSTs batches of telemetry windows over one keep-alive
HTTP connection per client, timing every POST. `run_ingest_bench(db_url, ...)` returns a dict (windows/s,
per-POST p50/p99/max in ms, accepted/rejected counts, the setup) that the caller writes to bench/results/.
Also home of the tiny agent's `AgentRegistration` (the numbers `api/demo_loop.py` builds its controller
from) and of synthetic windows shaped like the CPU engine's (same layers, experts, pairs and unions), which
the service tests reuse. It never asserts a time; the caller compares against the target.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from tierplan.api.demo_loop import tiny_registration
from tierplan.api.stack import start_service
from tierplan.controller.protocol import Telemetry

TARGET_WINDOWS_PER_S = 2000.0
TARGET_P99_MS = 20.0


def synthetic_window(agent_id: str, seq: int, rng: np.random.Generator, applied_plan_version: int = 0,
                     batch_tokens: int = 8, kv_blocks: int = 12, step_ms: float = 2.0, hot: int = 0) -> Telemetry:
    """One window of the tiny model (2 MoE layers x 8 experts, 4 steps), shaped like the engine's; `hot`
    skews routing towards expert `hot`, `kv_blocks` sets the KV demand."""
    steps, e = 4, 8
    weights = np.ones(e)
    weights[hot % e] += 3.0
    p = weights / weights.sum()
    layers, unions, pairs = [], [], []
    for layer in (0, 1):
        counts = rng.multinomial(2 * batch_tokens * steps, p)
        co = sorted({(int(a), int(b)) for a, b in rng.integers(0, e, (12, 2)) if a < b})
        layers.append({"layer": layer, "activation_counts": counts.tolist(), "router_entropy_mean": 0.7,
                       "num_tokens": batch_tokens * steps, "cooccurrence": [[a, b, 1] for a, b in co]})
        unions.append({"layer": layer, "batch_tokens": [batch_tokens] * steps,
                       "unions": [sorted(set(rng.choice(e, min(e, 2 * batch_tokens), p=p).tolist()))
                                  for _ in range(steps)]})
    for a in range(e):
        for b in rng.choice(e, 3, replace=False).tolist():
            pairs.append([a, int(b), int(rng.integers(1, 6))])
    start = 0.1 * seq
    body = {
        "agent_id": agent_id, "rank": 0, "window_seq": seq, "window_start_s": start, "window_end_s": start + 0.05,
        "model": "tiny", "num_layers": 2, "num_experts": e, "layers": layers,
        "kv": {"blocks_per_tier": {"gpu": kv_blocks, "cpu": 0, "nvme": 0},
               "hits_per_tier": {"gpu": 9, "cpu": 0, "nvme": 0}, "misses_per_tier": {"gpu": 0, "cpu": 0, "nvme": 0}},
        "links": [{"link": "h2d", "bytes": 184320, "queue_delay_ms_mean": 0.1, "queue_delay_ms_max": 0.12}],
        "stalls": [{"cause": "expert_miss", "count": 1, "total_ms": 2.4}],
        "step_timings_ms": {"num_steps": steps, "mean": step_ms, "p50": step_ms, "p99": 2 * step_ms},
        "expert_hits": 6, "expert_misses": 15, "applied_plan_version": applied_plan_version,
        "fallbacks": {"prefetch_late": 0},
        "transitions": [{"layer": 0, "next_layer": 1, "num_tokens": batch_tokens * steps, "pairs": pairs}],
        "step_unions": unions, "queued_kv_blocks": 0,
    }
    return Telemetry.model_validate(body)


@contextmanager
def serve_process(db_url: str, token: str, port: int | None = None, plan_interval_s: float = 0.2,
                  timeout_s: float = 60.0) -> Iterator[str]:
    """`tierplan serve` as a subprocess until the block ends (api/stack.py); yields its base URL once /readyz
    answers. Its log goes to a temporary folder, removed with it."""
    with tempfile.TemporaryDirectory(prefix="tierplan-serve-") as logs:
        svc = start_service(db_url, token, Path(logs), port=port, timeout_s=timeout_s,
                            extra_args=("--plan-interval-s", str(plan_interval_s)))
        try:
            yield svc.url
        finally:
            svc.proc.stop()


def _client(url: str, token: str, bodies: list[bytes], latencies_ms: list[float], results: list[dict]) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=30.0) as client:
        for body in bodies:
            t0 = time.perf_counter()
            r = client.post("/v1/telemetry", content=body)
            latencies_ms.append((time.perf_counter() - t0) * 1e3)
            results.append(r.json() if r.status_code == 200 else {"status": r.status_code, "accepted": 0})


def _histogram(text: str, name: str) -> tuple[float, float]:
    """(count, sum) of a Prometheus histogram in exposition text."""
    values = {}
    for line in text.splitlines():
        for part in ("_count", "_sum"):
            if line.startswith(name + part + " "):
                values[part] = float(line.split()[-1])
    return values.get("_count", 0.0), values.get("_sum", 0.0)


def _direct_baseline(db_url: str, bodies: list[bytes], agent: str) -> float:
    """The same batches parsed and stored by a Repository in this process, no HTTP, no checks: windows/s."""
    from tierplan.api.db.engine import make_engine
    from tierplan.api.db.repo import Repository
    from tierplan.controller.protocol_service import TelemetryBatch

    engine = make_engine(db_url)
    try:
        repo = Repository(engine)
        repo.register_agent(tiny_registration(agent))
        t0, n = time.perf_counter(), 0
        for body in bodies:
            wins = [w.model_copy(update={"agent_id": agent}) for w in TelemetryBatch.model_validate_json(body).windows]
            repo.add_windows(wins)
            n += len(wins)
        return n / (time.perf_counter() - t0)
    finally:
        engine.dispose()


def run_ingest_bench(db_url: str, num_batches: int = 200, batch_windows: int = 64, clients: int = 1,
                     warmup_batches: int = 5, seed: int = 0, plan_interval_s: float = 0.2) -> dict[str, Any]:
    """POST `num_batches` batches of `batch_windows` windows (after a warm-up) split over `clients` agents,
    one connection each; the numbers of the timed part, and as the baseline the same batches parsed and stored
    straight through a Repository in this process (`service_to_direct`: the service's share of that rate)."""
    import json

    token = "tp_bench_" + os.urandom(8).hex()
    rng = np.random.default_rng(seed)
    per_client = [num_batches // clients + (1 if c < num_batches % clients else 0) for c in range(clients)]
    with serve_process(db_url, token, plan_interval_s=plan_interval_s) as url:
        import httpx

        plans: list[list[bytes]] = []
        for c, n in enumerate(per_client):
            agent = f"bench-{seed}-{c}-{os.getpid()}"
            r = httpx.post(f"{url}/v1/agents", headers={"Authorization": f"Bearer {token}",
                                                       "Content-Type": "application/json"},
                           content=tiny_registration(agent).model_dump_json(), timeout=30.0)
            r.raise_for_status()
            template = [synthetic_window(agent, 0, rng, hot=h).model_dump(mode="json") for h in range(4)]
            bodies = []
            for b in range(warmup_batches + n):
                wins = []
                for i in range(batch_windows):
                    seq = b * batch_windows + i
                    w = dict(template[seq % 4], window_seq=seq, window_start_s=0.1 * seq,
                             window_end_s=0.1 * seq + 0.05)
                    wins.append(w)
                bodies.append(json.dumps({"windows": wins}).encode())
            plans.append(bodies)
        warm_lat: list[float] = []
        for c, bodies in enumerate(plans):  # warm-up: connections, caches, the first plans
            _client(url, token, bodies[:warmup_batches], warm_lat, [])
            plans[c] = bodies[warmup_batches:]
        latencies: list[list[float]] = [[] for _ in plans]
        results: list[list[dict]] = [[] for _ in plans]
        threads = [threading.Thread(target=_client, args=(url, token, bodies, latencies[c], results[c]))
                   for c, bodies in enumerate(plans)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall_s = time.perf_counter() - t0
        passes = _histogram(httpx.get(f"{url}/metrics", timeout=30.0).text, "tierplan_planner_pass_seconds")
    direct = _direct_baseline(db_url, [b for bodies in plans for b in bodies], f"bench-direct-{seed}-{os.getpid()}")
    lat = np.array([x for xs in latencies for x in xs])
    accepted = sum(int(r.get("accepted", 0)) for rs in results for r in rs)
    rejected = sum(len(r.get("rejected", ())) for rs in results for r in rs)
    failed = sum(1 for rs in results for r in rs if "status" in r)
    return {"db": db_url.split(":", 1)[0], "batches": int(lat.size), "batch_windows": batch_windows,
            "clients": clients, "windows_accepted": accepted, "windows_rejected": rejected, "posts_failed": failed,
            "wall_s": wall_s, "windows_per_s": accepted / wall_s if wall_s > 0 else 0.0,
            "post_ms_p50": float(np.percentile(lat, 50)), "post_ms_p99": float(np.percentile(lat, 99)),
            "post_ms_max": float(lat.max()), "cpu_count": os.cpu_count(),
            "direct_windows_per_s": direct, "service_to_direct": (accepted / wall_s) / direct if direct else 0.0,
            "planner_passes": passes[0], "planner_pass_ms_mean": passes[1] / passes[0] * 1e3 if passes[0] else 0.0,
            "target_windows_per_s": TARGET_WINDOWS_PER_S, "target_p99_ms": TARGET_P99_MS,
            "meets_target": bool(accepted / wall_s >= TARGET_WINDOWS_PER_S and np.percentile(lat, 99)
                                 <= TARGET_P99_MS) if wall_s > 0 else False}
