"""agent/closed_loop.py: whatever the plan source's planner raises is this window's counted planner error (with
its type), never a telemetry build failure, and the telemetry still reached the source."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.agent import flame_trace, tiny_engine
from tierplan.agent.closed_loop import InProcessLoop
from tierplan.controller.protocol import Plan, PlanAck, Telemetry
from tierplan.runtime.engine.runner import ForcedRouter, Runner
from tierplan.runtime.engine.scheduler import Scheduler
from tierplan.runtime.engine.workloads import Request

DATA = Path(__file__).parents[2] / "data"


def _run_four(eng, make_loop: Callable[[], InProcessLoop]) -> InProcessLoop:
    """Four requests through the loop `make_loop` builds on `eng`, its last window handed over; `eng` closed."""
    try:
        loop = make_loop()
        reqs = [Request(i, 0.0, 10 + 3 * i, 6, (), "test") for i in range(4)]
        Runner(eng, Scheduler(8, eng.cfg.block_tokens, max_batch=4), ForcedRouter(flame_trace(), eng),
               on_step=loop.on_step).run(reqs)
        loop.finish()
    finally:
        eng.close()
    return loop


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
    source = FailingPlanner(exc)
    loop = _run_four(eng, lambda: InProcessLoop(eng, source, window_steps=4))
    windows = len(loop.telemetry)
    assert windows >= 2 and source.synced == windows
    assert loop.adapter.outbox.failed == 0  # not mistaken for a window that failed to build
    assert loop.planner_errors == [f"{type(exc).__name__}: {exc}"] * windows
    st = loop.stats()
    assert st["planner_errors"] == windows and st["plans"] == 0 and st["telemetry_refused"] == 0


class DeadSource(FailingPlanner):
    """A source that cannot take telemetry at all (a planner's process that hung and was killed, or died)."""

    def sync_from(self, telemetry: Telemetry) -> None:
        self.synced += 1
        raise self.exc


@pytest.mark.parametrize("exc", [TimeoutError("sync_from: the controller's process gave no answer within 120 s"),
                                 RuntimeError("sync_from: the controller's process ended (exit code -9)")])
@pytest.mark.parametrize("wait", [True, False])
def test_a_source_that_fails_to_take_telemetry_is_a_counted_planner_error(tmp_path: Path, exc: Exception,
                                                                          wait: bool) -> None:
    """Not refused telemetry (a ValueError), not a window that failed to build: this window's planner error."""
    eng = tiny_engine(tmp_path)
    source = DeadSource(exc)
    loop = _run_four(eng, lambda: InProcessLoop(eng, source, window_steps=4, wait_for_plans=wait))
    windows = len(loop.telemetry)
    assert windows >= 2 and source.synced == windows and loop.adapter.outbox.failed == 0
    assert loop.planner_errors == [f"{type(exc).__name__}: {exc}"] * windows and loop.refused == []


class ThreadRecordingSource:
    """Issues one plan (after the first window), blocks its first `step_next` until `release` is set, and
    records which thread made each call into it."""

    def __init__(self, plan: Plan) -> None:
        import threading

        self.plan, self.release, self.calls = plan, threading.Event(), []
        self.acks: list[PlanAck] = []
        self.issued = False

    def _note(self, name: str) -> None:
        import threading

        self.calls.append((name, threading.current_thread() is threading.main_thread()))

    def sync_from(self, telemetry: Telemetry) -> None:
        self._note("sync_from")

    def step_next(self) -> Plan | None:
        self._note("step_next")
        if not self.release.wait(30):
            raise AssertionError("the test never released the planner")
        if self.issued:
            return None
        self.issued = True
        return self.plan

    def record_ack(self, ack: PlanAck) -> None:
        self._note("record_ack")
        self.acks.append(ack)


def _tiny_plan(eng) -> Plan:
    from tierplan.controller.protocol import Tier

    stride, block = eng.pool.layout.stride_bytes, eng.cache.block_bytes
    return Plan(plan_id="p1", version=1, base_version=0, created_s=0.0,
                hbm_budget_bytes=eng.pool.num_slots * stride + 8 * block,
                expert_bytes_per_layer=tuple(4 * stride if m in eng.spec.moe_layers else 0
                                             for m in range(eng.spec.num_layers)),
                kv_blocks_per_tier={Tier.GPU: 8, Tier.CPU: 8, Tier.NVME: 16}, reason="test plan")


def test_without_waiting_for_plans_the_engine_runs_on_while_the_planner_is_busy(tmp_path: Path) -> None:
    """wait_for_plans=False: the whole replay runs while the planner is stuck on the first window (waiting would
    hang here); every call into the source is made on the outbox thread, acks included, and the plan issued
    once the planner is released is applied at a later window end and acked."""
    eng = tiny_engine(tmp_path)
    bt = eng.cfg.block_tokens
    source = ThreadRecordingSource(_tiny_plan(eng))
    try:
        loop = InProcessLoop(eng, source, window_steps=2, wait_for_plans=False,
                             hbm_budget_bytes=_tiny_plan(eng).hbm_budget_bytes)
        reqs = [Request(i, 0.0, 10 + 3 * i, 6, (), "test") for i in range(4)]
        router = ForcedRouter(flame_trace(), eng)
        runner = Runner(eng, Scheduler(8, bt, max_batch=4), router, on_step=loop.on_step)
        runner.run(reqs)  # the planner is still blocked on window 1: the engine did not wait for it
        assert loop.plans == [] and len(source.calls) <= 2
        source.release.set()
        later = Runner(eng, Scheduler(8, bt, max_batch=4), router, on_step=loop.on_step)
        later.run([Request(10 + i, 0.0, 8, 6, (), "test") for i in range(3)])  # its window ends apply the plan
        before_finish = list(source.calls)
        loop.finish()  # the last partial window is handed over here, on the calling thread
    finally:
        eng.close()
    assert [p.plan_id for p in loop.plans] == ["p1"] and loop.acks[0].status.value == "applied"
    assert [a.plan_id for a in source.acks] == ["p1"], "the ack reached the source"
    assert before_finish and not any(on_main for _name, on_main in before_finish), before_finish
    # how far behind decode it planned: every window timed, windows piled up behind the stuck one, and the plan
    # applied steps after the end of the window it answers (the whole first replay ran meanwhile)
    st = loop.stats()
    assert len(st["planner_s"]) == len(loop.telemetry) and max(st["planner_s"]) > 0
    assert max(st["windows_queued"]) >= 1
    assert len(st["plan_lag_steps"]) == 1 and st["plan_lag_steps"][0] >= 4, st
    # windows that queued behind the stuck one were synced, never planned from: the planner caught up
    planned = sum(name == "step_next" for name, _ in source.calls)
    assert st["windows_unplanned"] >= 1 and planned == len(loop.telemetry) - st["windows_unplanned"], st
    assert sum(name == "sync_from" for name, _ in source.calls) == len(loop.telemetry)


class OnePlan:
    """Issues `plan` from the first window, nothing after; keeps the acks."""

    def __init__(self, plan: Plan) -> None:
        self.plan, self.acks = plan, []

    def sync_from(self, telemetry: Telemetry) -> None:
        return None

    def step_next(self) -> Plan | None:
        plan, self.plan = self.plan, None
        return plan

    def record_ack(self, ack: PlanAck) -> None:
        self.acks.append(ack)


@pytest.mark.parametrize("base_version", [0, 5])  # 5: built on a plan this agent never applied -> rejected
def test_a_plans_lag_is_counted_only_once_it_applies(tmp_path: Path, base_version: int) -> None:
    eng = tiny_engine(tmp_path)
    plan = _tiny_plan(eng).model_copy(update={"base_version": base_version})
    source = OnePlan(plan)
    loop = _run_four(eng, lambda: InProcessLoop(eng, source, window_steps=2, hbm_budget_bytes=plan.hbm_budget_bytes))
    applied = [a.status.value for a in source.acks] == ["applied"]
    assert applied == (base_version == 0), source.acks
    # waiting for plans, a window's plan applies at that window's own end: no lag
    assert loop.stats()["plan_lag_steps"] == ([0] if applied else [])
