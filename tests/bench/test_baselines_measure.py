"""Every baseline through the phase runner's own `measure()` (bench/phase_run.py), the path the bench runs: the
quick sweep's tiny model over its shared pinned store and forced router, a quick grid point's context and
requests, the runner's engine config, scheduler and InProcessLoop. Each plan is APPLIED, the footprint stays
within the budget on every step, every request finishes, and no live planner fails a window. Then the review's
cases on this path: fluxmoe where everything fits (hit rate and budget kept), kv_tiering's KV tiers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.bench import baseline_point as bp
from tests.bench.conftest import controllers_running
from tierplan.bench.baselines import BASELINES, make, oracle_splits
from tierplan.bench.baselines.oracle import RecordingPass
from tierplan.bench.phase_grid import QUICK, Point
from tierplan.bench.phase_run import ModelHandle, Outcome, measure, open_model, point_context
from tierplan.controller.protocol import AckStatus, Tier
from tierplan.runtime.device import Device

LIVE = ("fluxmoe", "mv_wsa", "tierplan")
MID = Point("tiny", 2, 2, batch=4, context=32, budget_label_gib=0.0, budget_frac=0.7)  # the CI smoke point
FITS = Point("tiny", 2, 2, batch=4, context=128, budget_label_gib=0.0, budget_frac=1.0)  # the review's item 5


@pytest.fixture(scope="module")
def model() -> Iterator[ModelHandle]:
    h = open_model("tiny", 2, 2, Device("cpu"), lambda _msg: None)
    try:
        yield h
    finally:
        h.close()


def _baseline(name: str) -> Any:
    b = make(name)
    if hasattr(b, "calibrate"):
        b.calibrate = False  # priors only: no wall-clock time enters a live decision
    return b


def _measure(h: ModelHandle, point: Point, name: str, workdir: Path) -> tuple[Outcome, Any, Any]:
    """(outcome, the baseline object, the point's context); the oracle after its recording pass at its
    largest candidate split, as the runner does it."""
    ctx, prefix = point_context(h, point, QUICK)
    if name != "oracle":
        b = _baseline(name)
        return measure(h, ctx, b, QUICK, workdir, prefix), b, ctx
    split = oracle_splits(ctx, QUICK.oracle_max_splits)[-1]
    rec = RecordingPass(split)
    measure(h, ctx, rec, QUICK, workdir, prefix)
    b = make("oracle")
    ctx = dataclasses.replace(ctx, future=rec.future(), split=split)
    return measure(h, ctx, b, QUICK, workdir, prefix), b, ctx


@pytest.fixture(scope="module")
def mid(model: ModelHandle, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Outcome, Any, Any]]:
    return {name: _measure(model, MID, name, tmp_path_factory.mktemp(name)) for name in BASELINES}


@pytest.mark.parametrize("name", BASELINES)
def test_every_baseline_runs_through_the_runners_measure(mid: dict[str, tuple[Outcome, Any, Any]],
                                                         name: str) -> None:
    out, _, ctx = mid[name]
    assert out.acks and all(a.status is AckStatus.APPLIED for a in out.acks), [a.reason for a in out.acks]
    assert out.extra["over_budget_steps"] == 0
    assert 0 < out.extra["peak_hbm_bytes"] <= ctx.hbm_budget_bytes
    # Every request finished or was left by the run's stop (phase_grid.RunStop), counted.
    assert len(out.report.requests) + out.report.unfinished == len(ctx.requests) > out.report.unfinished
    assert out.report.steps > QUICK.warm_steps
    assert out.loop_stats["peak_over_budget_bytes"] == 0
    if name in LIVE:  # re-plans every window; no window's planner failed (the row would read "degraded")
        assert out.extra["planner_errors"] == [], out.extra["planner_errors"]
        # the start, then the allocator's plans; tierplan's own only where they beat its start by the margin
        assert out.loop_stats["windows"] >= 3 and out.loop_stats["applied"] >= (1 if name == "tierplan" else 2), \
            out.loop_stats
        if name == "tierplan":
            history = mid[name][1].controller.history
            assert history and all(d.reason for d in history)
        # in a child process, as beside a deployed engine, stopped once the run is over
        assert type(mid[name][1].controller).__name__ == "ProcessPlanSource" and not controllers_running()


def test_the_oracle_follows_its_record_on_the_runners_path(mid: dict[str, tuple[Outcome, Any, Any]]) -> None:
    out, oracle, _ = mid["oracle"]
    assert oracle.order.diverged_steps == 0 and oracle.order.rankings > 0
    assert out.report.steps == oracle.order.future.num_steps  # the run took exactly the recorded steps


def test_fluxmoe_where_everything_fits_keeps_its_experts_and_the_budget(model: ModelHandle, tmp_path: Path) -> None:
    """The review's case (b4/c128/f1): KV at the batch's demand leaves room for every expert; the rho rule
    must not hand expert memory to KV that cannot use it (the hit rate fell to 0.06, 27% of the budget idle)."""
    flux, b, ctx = _measure(model, FITS, "fluxmoe", tmp_path / "f")
    resident, _, _ = _measure(model, FITS, "resident", tmp_path / "r")
    assert flux.extra["planner_errors"] == [] and flux.loop_stats["applied"] >= 2
    every_slots = len(ctx.moe_layers) * ctx.num_experts
    assert sum(flux.initial_plan.expert_bytes_per_layer) == every_slots * ctx.expert_stride_bytes
    decided = b.controller.history
    assert decided
    for d in decided:  # every split the rule chose keeps every expert, and KV takes what is left
        left = ctx.hbm_budget_bytes - every_slots * ctx.expert_stride_bytes - d.split.kv_blocks * ctx.kv_block_bytes
        assert sum(d.split.slots) == every_slots, d.reason
        assert 0 <= left < ctx.kv_block_bytes, (d.split, left)
    hits = flux.report.expert_hits / max(1, flux.report.expert_hits + flux.report.expert_misses)
    ref = resident.report.expert_hits / max(1, resident.report.expert_hits + resident.report.expert_misses)
    assert hits >= ref - 0.05, (hits, ref)


def test_kv_tiering_on_the_runners_path_keeps_kv_small_and_pins_experts(model: ModelHandle, tmp_path: Path) -> None:
    from tierplan.bench.baselines.base import kv_floor_blocks

    point = dataclasses.replace(MID, batch=1, budget_frac=0.4)  # tight: experts cannot all be resident
    ctx, prefix = point_context(model, point, QUICK)
    tiering = bp.CheckedKVTiering()
    out = measure(model, ctx, tiering, QUICK, tmp_path, prefix)
    assert tiering.over == []  # every decode step's experts fit its layer's slots beside the pins
    plan = out.initial_plan
    assert plan.kv_blocks_per_tier[Tier.GPU] <= kv_floor_blocks(ctx) + 2  # the floor, plus what no slot fits
    assert plan.kv_blocks_per_tier[Tier.CPU] == ctx.kv_cpu_blocks and plan.kv_blocks_per_tier[Tier.NVME] > 0
    assert plan.pinned_experts  # static: the hottest experts beyond each layer's union room
    assert out.extra["over_budget_steps"] == 0
