"""The baselines' tiny CPU point: the tiny preset, a handful of bundled Mooncake requests (lengths scaled to the
CPU), the bundled FLAME-MoE routing sample, one HBM budget for experts + GPU KV (tests only; no ../shared)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tierplan.bench.baselines.base import observe_routes
from tierplan.bench.baselines.kv_tiering import KVTiering

DATA = Path(__file__).resolve().parents[2] / "data"
UNIT_BYTES = 4096  # tiny's KV block; its expert slot is 3 units
BUDGET_BYTES = 40 * UNIT_BYTES  # 16 experts would take 48 units: they never all fit beside the KV
POINT = dict(batch=4, context_tokens=48, hbm_budget_bytes=BUDGET_BYTES, kv_gpu_blocks=32, kv_cpu_blocks=64,
             kv_nvme_blocks=64)


def requests(num: int = 12) -> list[Any]:
    from tierplan.runtime.engine.workloads import load_mooncake, scale_requests

    base = load_mooncake(DATA / "requests/mooncake_conversation_sample.jsonl", limit=40)
    picked = scale_requests(base[:num], 48, 16, block_tokens=16)
    return [dataclasses.replace(r, arrival_s=i * 0.0005) for i, r in enumerate(picked)]


def trace() -> Any:
    from tierplan.runtime.engine.routing_trace import RoutingTrace

    return RoutingTrace.load(DATA / "routing/flame_moe_290m_sample.npz")


def run(baseline: Any, workdir: Path, reqs: list[Any] | None = None, **extra: Any) -> Any:
    from tierplan.bench.baselines.replay import run_point
    from tierplan.runtime.device import Device
    from tierplan.runtime.engine.presets import preset

    return run_point(baseline, preset("tiny"), Device("cpu"), trace(), reqs or requests(), workdir=workdir,
                     **{**POINT, **extra})


def context(workdir: Path, reqs: list[Any] | None = None, **extra: Any) -> Any:
    """The point's context, from an engine built like the run's."""
    from tierplan.bench.baselines.replay import point_context
    from tierplan.runtime.device import Device
    from tierplan.runtime.engine.engine import EngineConfig, ReferenceEngine
    from tierplan.runtime.engine.presets import preset

    eng = ReferenceEngine(preset("tiny"), Device("cpu"), EngineConfig(
        kv_gpu_blocks=POINT["kv_gpu_blocks"], kv_cpu_blocks=POINT["kv_cpu_blocks"],
        kv_nvme_blocks=POINT["kv_nvme_blocks"], workdir=workdir))
    try:
        batch = extra.pop("batch", POINT["batch"])
        return eng, point_context(eng, reqs or requests(), batch, POINT["context_tokens"],
                                  extra.pop("hbm_budget_bytes", BUDGET_BYTES), **extra)
    except BaseException:
        eng.close()
        raise


class CheckedKVTiering(KVTiering):
    """kv_tiering with a route listener: for every decode step, a layer whose experts the step uses could not
    fit its slots at once beside the pins (`capacity_of`, the executor's `fits` test) is kept."""

    def start(self, engine: Any, ctx: Any) -> Any:
        self.engine, self.over, self._now = engine, [], []
        run = super().start(engine, ctx)

        def check(used: Any) -> None:
            self._now = [(m, len(u)) for m, u in enumerate(used)
                         if len(u) > engine.experts.capacity_of(m, sorted(u))]  # pool layer m

        def on_step(batch: Any, step_s: float) -> None:
            if not batch.prefills:
                self.over += self._now

        observe_routes(engine, check)
        run.on_step = on_step
        return run
