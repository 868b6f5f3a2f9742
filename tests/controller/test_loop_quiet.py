"""Quiet windows: a split that held is held again without planning while the windows look like the last one
planned (controller/loop.py, `QUIET_AFTER_HELD`), a few in a row at most, and a window that differs is planned at
once. The controller and windows of test_loop_steady.py (qwen3-sized, routed by the bundled real trace)."""

from __future__ import annotations

import dataclasses

import numpy as np

from tests.controller.test_loop_steady import BLOCK_BYTES, EXPERTS, KV_MAX, LAYERS, TOP_K, TRACE, _controller, _window
from tierplan.controller.loop import Controller, Outcome
from tierplan.controller.protocol import AckStatus, Footprint, PlanAck, Telemetry, Tier
from tierplan.runtime.engine.routing_trace import RoutingTrace


def _ids() -> np.ndarray:
    return RoutingTrace.load(TRACE).routes(2048, LAYERS, TOP_K, EXPERTS)[0]


def _feed(ctl: Controller, windows: list[Telemetry]) -> list[str]:
    """Each window synced and decided, the plans acked as applied: per window "issued", "held" or "quiet"."""
    out = []
    for tel in windows:
        ctl.sync_from(tel)
        before_quiet, before = ctl.windows_quiet, len(ctl.history)
        plan = ctl.step_next()
        if plan is not None:
            kv = plan.kv_blocks_per_tier[Tier.GPU]
            ctl.record_ack(PlanAck(agent_id="a", rank=0, plan_id=plan.plan_id, version=plan.version,
                                   status=AckStatus.APPLIED, applied_s=0.0, footprint=Footprint(
                                       expert_bytes_per_layer=plan.expert_bytes_per_layer,
                                       kv_blocks_per_tier={Tier.GPU: kv},
                                       total_hbm_bytes=sum(plan.expert_bytes_per_layer) + kv * BLOCK_BYTES)))
        out.append("quiet" if ctl.windows_quiet > before_quiet else
                   ctl.history[-1].outcome.value if len(ctl.history) > before else "none")
    return out


def _window_at(seq: int, ids: np.ndarray, ctl: Controller) -> Telemetry:
    """The steady test's window `seq`, reporting the split the controller's applied plan set (its start before)."""
    applied = ctl.state.applied_version() if seq else 0
    plan = ctl.state.plans.get(applied)
    kv = plan.kv_blocks_per_tier[Tier.GPU] if plan is not None else KV_MAX
    return _window(seq, ids, kv, applied)


def _run(ctl: Controller, n: int, ids: np.ndarray, change: dict[int, dict[str, int]] | None = None,
         start: int = 0) -> list[str]:
    got = []
    for seq in range(start, start + n):
        tel = _window_at(seq, ids, ctl)
        if change and seq in change:
            tel = tel.model_copy(update=change[seq])
        got += _feed(ctl, [tel])
    return got


def test_a_held_split_goes_unplanned_a_few_windows_at_most_then_is_planned_again() -> None:
    ids, ctl = _ids(), _controller()
    got = _run(ctl, 24, ids)
    assert got[0] == "issued" and got[1:3] == ["held", "held"], got
    assert "issued" not in got[1:] and got.count("quiet") >= 12, got
    runs = "".join("q" if g == "quiet" else "." for g in got).split(".")
    assert max(len(r) for r in runs) == ctl.config.quiet_windows, got  # then a window is planned again
    assert ctl.stats()["windows_quiet"] == got.count("quiet")


def test_a_window_unlike_the_last_planned_is_planned_at_once() -> None:
    """After a quiet window, one whose KV demand fell by half (the queue drained; a fall, so the demand is not
    "rising") is planned in that window, where it would have been the second quiet one."""
    ids, ctl = _ids(), _controller()
    base = _run(ctl, 8, ids)
    assert base[-1] == "quiet", base
    assert _run(_controller(), 9, ids)[-1] == "quiet"  # unchanged, the ninth window goes unplanned
    got = _run(ctl, 1, ids, {8: {"queued_kv_blocks": 0}}, start=8)
    assert got[-1] in ("held", "issued"), got


def test_with_quiet_windows_off_every_window_is_planned() -> None:
    ids = _ids()
    ctl = _controller()
    ctl.config = dataclasses.replace(ctl.config, quiet_windows=0)
    got = _run(ctl, 12, ids)
    assert "quiet" not in got and got.count("held") == 11 and ctl.windows_quiet == 0, got
    assert all(d.outcome in (Outcome.HELD, Outcome.ISSUED) for d in ctl.history)
