"""agent/closed_loop.py: whatever the plan source's planner raises is this window's counted planner error (with
its type), never a telemetry build failure, and the telemetry still reached the source."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent import flame_trace, tiny_engine
from tierplan.agent.closed_loop import InProcessLoop
from tierplan.controller.protocol import Plan, PlanAck, Telemetry
from tierplan.runtime.engine.runner import ForcedRouter, Runner
from tierplan.runtime.engine.scheduler import Scheduler
from tierplan.runtime.engine.workloads import Request

DATA = Path(__file__).parents[2] / "data"


class FailingPlanner:
    """Accepts every window, then fails to plan with the given exception (a solver's status, a bug)."""

    def __init__(self, exc: Exception) -> None:
        self.exc, self.synced = exc, 0

    def sync_from(self, telemetry: Telemetry) -> None:
        self.synced += 1

    def step_next(self) -> Plan | None:
        raise self.exc

    def record_ack(self, ack: PlanAck) -> None:
        raise AssertionError("no plan was issued, so nothing can be acked")


@pytest.mark.parametrize("exc", [RuntimeError("HiGHS returned time_limit for the split MILP"),
                                 IndexError("list index out of range")])
def test_any_planner_exception_is_a_counted_planner_error(tmp_path: Path, exc: Exception) -> None:
    eng = tiny_engine(tmp_path)
    bt = eng.cfg.block_tokens
    source = FailingPlanner(exc)
    try:
        loop = InProcessLoop(eng, source, window_steps=4)
        reqs = [Request(i, 0.0, 10 + 3 * i, 6, (), "test") for i in range(4)]
        trace = flame_trace()
        Runner(eng, Scheduler(8, bt, max_batch=4), ForcedRouter(trace, eng), on_step=loop.on_step).run(reqs)
        loop.finish()
    finally:
        eng.close()
    windows = len(loop.telemetry)
    assert windows >= 2 and source.synced == windows
    assert loop.adapter.outbox.failed == 0  # not mistaken for a window that failed to build
    assert loop.planner_errors == [f"{type(exc).__name__}: {exc}"] * windows
    st = loop.stats()
    assert st["planner_errors"] == windows and st["plans"] == 0 and st["telemetry_refused"] == 0
