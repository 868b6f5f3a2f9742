"""The closed loop as a story: the tiny engine on the CPU replays three phases (light, batch grows, context
grows) with the in-process controller re-splitting one HBM budget every window. Every plan is applied, none
exceeds the budget (as issued, and as measured between steps), the split moves toward KV when the context
grows, and the tokens are the same as with a static split."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierplan.api.demo_loop import KV_GPU_CAPACITY, LoopResult, run_loop_job


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LoopResult, LoopResult]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend
    try:
        d = tmp_path_factory.mktemp("loop")
        # Priors only: no measured time enters a decision, so the same plans on any machine.
        yield run_loop_job(Path(d) / "static", False), run_loop_job(Path(d) / "ctl", True, calibrate=False)
    finally:
        torch.set_num_threads(threads)


def test_tokens_are_identical_with_and_without_the_controller(runs: tuple[LoopResult, LoopResult]) -> None:
    static, ctl = runs
    assert ctl.outputs == static.outputs and sum(len(v) for v in ctl.outputs.values()) > 100


def test_every_plan_is_applied_and_within_the_budget(runs: tuple[LoopResult, LoopResult]) -> None:
    _, ctl = runs
    st = ctl.stats
    assert st["plans"] >= 3 and st["applied"] == st["plans"] and st["rejected"] == 0
    assert st["telemetry_refused"] == 0 and st["planner_errors"] == 0
    assert all(total <= ctl.budget_bytes for total in ctl.plan_totals)
    assert st["peak_over_budget_bytes"] <= 0  # measured between steps, after each applied plan


def test_the_split_follows_the_phases(runs: tuple[LoopResult, LoopResult]) -> None:
    _, ctl = runs
    issued = [d for d in ctl.history if d.outcome.value == "issued"]
    kv = [d.split.kv_blocks for d in issued]
    slots = [sum(d.split.slots) for d in issued]
    peak = kv.index(max(kv))
    assert kv[0] < max(kv) <= KV_GPU_CAPACITY and slots[peak] < max(slots)  # KV took HBM from experts
    assert ctl.phase_at_window.get(issued[peak].window) == "context grows"
    assert all(d.reason for d in ctl.history)
