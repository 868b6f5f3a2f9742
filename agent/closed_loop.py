"""The closed loop in one process: the reference adapter's telemetry goes to a plan source every window and the
plan it answers with is applied between steps (inference process, engine thread; the HTTP service comes later).

`InProcessLoop.on_step` is the runner's hook. At each window's end it waits for the window's Telemetry to be
built and handed to the source (`sync_from`, then `step_next`), applies the plan it returned (if any) through
the adapter's enforcer, and hands the ack back (`record_ack`). Waiting for the build keeps the loop
deterministic (the same plans at the same steps on every run); it costs the engine a window build per window,
acceptable in process, never over a network. With `wait_for_plans=False` the engine never waits: the window is
built and planned on the outbox thread while decode goes on, and a plan is applied at the first window end after
it is ready (a window later, as a sidecar's plans arrive); every call into the source then runs on the outbox
thread (acks are queued and handed over before the next window), so the source needs no lock. A planner behind
decode catches up: a window with newer ones closed behind it is synced but not planned from (`windows_unplanned`;
at most MAX_UNPLANNED in a row), as a plan priced on it would land after a newer one was seen. Plans then
depend on timing: runs are not repeatable step for step. Telemetry the source refuses is counted, never
dropped silently; so is any other exception the source raises (`planner_errors`, with the type name).
A policy's starting plan, which the source never issued, goes in with `apply_initial` before the first step
(applied and booked like any other; its ack stays with the loop). After an applied plan `on_applied(plan)`
runs (the demo's scheduler follows the plan's GPU KV blocks there).
Between steps, experts over an applied plan's per-layer caps are evicted (`trimmed` counts them): the budget
a plan sets must hold until the next one, whatever the engine loaded on demand during the step.

The source is any object with `sync_from`, `step_next` and `record_ack` (the controller's `Controller`): the
agent imports only `controller.protocol`. It must never build a plan itself or touch the network.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from tierplan.agent.adapters.reference import ReferenceAdapter
from tierplan.controller.protocol import AckStatus, Plan, PlanAck, Telemetry
from tierplan.runtime.engine.engine import ReferenceEngine

# wait_for_plans=False: windows in a row synced without a plan while newer ones queue behind them. A planner that
# cannot keep up even with syncing still plans every this many windows. Phase run 62 (H100, b8 1K 56 GiB): with
# every queued window planned in turn (a solve took ~0.5 s on a 2-core CPU box; the H100's decode windows ~32 ms),
# the first plan applied 128 steps after its window.
MAX_UNPLANNED = 8


class PlanSource(Protocol):
    def sync_from(self, telemetry: Telemetry) -> Any: ...

    def step_next(self) -> Plan | None: ...

    def record_ack(self, ack: PlanAck) -> None: ...


class InProcessLoop:
    """See the module docstring. `adapter_kwargs` go to `ReferenceAdapter` (budget, clock, agent id...)."""

    def __init__(self, engine: ReferenceEngine, source: PlanSource, window_steps: int = 8,
                 on_applied: Callable[[Plan], None] | None = None, wait_for_plans: bool = True,
                 local_predictor: bool = True, **adapter_kwargs: Any) -> None:
        """local_predictor: attach the agent's layer-ahead predictor (a per-layer host copy of the routes; only
        policies whose plans carry its table use it)."""
        self.source, self.on_applied, self.wait_for_plans = source, on_applied, wait_for_plans
        self._lock = threading.Lock()
        self._pending: Plan | None = None
        self._acks_out: list[PlanAck] = []  # wait_for_plans=False: acks for the outbox thread to hand over
        self.telemetry: list[Telemetry] = []
        self.refused: list[str] = []  # telemetry the source refused (its messages)
        self.planner_errors: list[str] = []  # windows the source could not plan from (e.g. an infeasible budget)
        self.plans: list[Plan] = []
        self.acks: list[PlanAck] = []
        self.trimmed = 0
        self.peak_over_budget_bytes = 0  # most bytes a between-steps footprint exceeded the applied plan's budget
        # How far behind decode the source plans (wait_for_plans=False): each window's sync_from + step_next on
        # the outbox thread (seconds), the windows still queued behind it when it started, and for each applied
        # plan the steps from the end of the window it answers to its application. A plan landing many windows
        # after its window was priced on a batch and a queue that have moved on.
        self.planner_s: list[float] = []
        self.windows_queued: list[int] = []
        self.windows_unplanned = 0
        self._unplanned_run = 0  # windows synced without a plan since the last one planned from
        self.plan_lag_steps: list[int] = []
        self._answered: dict[int, int] = {}  # plan version -> the step its window ended at
        self.adapter = ReferenceAdapter(engine, window_steps=window_steps, sink=self._sink,
                                        local_predictor=local_predictor, **adapter_kwargs)
        self._applied: Plan | None = None

    def _sink(self, tel: Telemetry) -> None:
        """Outbox thread: the window goes to the source; a plan it answers with waits for the engine thread."""
        self.telemetry.append(tel)
        ws = self.adapter.window_steps
        ended = min((tel.window_seq + 1) * ws, self.adapter.steps)  # window k closes at step (k + 1) * ws
        queued = max(0, self.adapter.steps // ws - tel.window_seq - 1)
        self.windows_queued.append(queued)
        plan = queued == 0 or self._unplanned_run >= MAX_UNPLANNED
        self._unplanned_run = 0 if plan else self._unplanned_run + 1
        self.windows_unplanned += not plan
        t0 = time.perf_counter()
        try:
            self._plan_from(tel, ended, plan)
        finally:
            self.planner_s.append(time.perf_counter() - t0)

    def _plan_from(self, tel: Telemetry, ended: int, plan_it: bool = True) -> None:
        """Outbox thread: hand over the queued acks and the window, ask for a plan unless `plan_it` is False
        (`ended`: its window's last step)."""
        with self._lock:
            acks, self._acks_out = self._acks_out, []
        try:
            for ack in acks:  # wait_for_plans=False: the engine thread's acks, in order, before the next window
                self.source.record_ack(ack)
            self.source.sync_from(tel)
        except ValueError as exc:  # TelemetryRejected and ProtocolError are ValueErrors: counted, kept
            self.refused.append(str(exc))
            return
        except Exception as exc:  # the source itself failed (a planner's process that hung or died): counted
            self.planner_errors.append(f"{type(exc).__name__}: {exc}")
            return
        if not plan_it:
            return
        try:
            plan = self.source.step_next()
        except Exception as exc:  # any planner failure (InfeasibleError, a solver's RuntimeError, a bug):
            # this window's planner error, counted by type; the telemetry itself was delivered
            self.planner_errors.append(f"{type(exc).__name__}: {exc}")
            return
        if plan is not None:
            with self._lock:
                if self._pending is not None:  # replaced before the engine thread took it: never applied
                    self._answered.pop(self._pending.version, None)
                self._pending = plan
                self._answered[plan.version] = ended

    def on_step(self, batch: object, step_s: float) -> None:
        a = self.adapter
        a.on_step(batch, step_s)
        if a.steps % a.window_steps == 0:
            if self.wait_for_plans:
                a.outbox.join()  # the window just closed is built and with the source now
            with self._lock:
                plan, self._pending = self._pending, None
            if plan is not None:
                self._apply(plan)
        self._trim()

    def apply_initial(self, plan: Plan) -> PlanAck:
        """Apply a plan the source did not issue (a policy's starting split, before the first step): through the
        enforcer and the loop's books like any other, but its ack is not handed to the source."""
        return self._apply(plan, tell_source=False)

    def _apply(self, plan: Plan, tell_source: bool = True) -> PlanAck:
        with self._lock:
            ended = self._answered.pop(plan.version, None)
        ack = self.adapter.apply(plan)
        if ended is not None and ack.status is AckStatus.APPLIED:
            self.plan_lag_steps.append(self.adapter.steps - ended)
        self.plans.append(plan)
        self.acks.append(ack)
        if tell_source and self.wait_for_plans:
            self.source.record_ack(ack)
        elif tell_source:
            with self._lock:
                self._acks_out.append(ack)
        if ack.status is AckStatus.APPLIED:
            self._applied = plan
            if self.on_applied is not None:
                self.on_applied(plan)
        return ack

    def _trim(self) -> None:
        if self._applied is None:
            return
        policy, experts = self.adapter.policy, self.adapter.engine.experts
        for layer in range(self.adapter.engine.pool.layout.num_layers):
            for key in policy.over_cap_victims(layer):
                experts.evict(*key)
                self.trimmed += 1
        total = self.adapter.enforcer.footprint().total_hbm_bytes
        self.peak_over_budget_bytes = max(self.peak_over_budget_bytes, total - self._applied.hbm_budget_bytes)

    def finish(self) -> None:
        """After the run: the last partial window goes to the source too, then the outbox stops."""
        self.adapter.flush()
        self.adapter.close()

    def stats(self) -> dict[str, Any]:
        pred = self.adapter.predictor.stats() if self.adapter.predictor is not None else {}
        applied = sum(a.status is AckStatus.APPLIED for a in self.acks)
        return {"windows": len(self.telemetry), "plans": len(self.plans), "applied": applied,
                "rejected": len(self.acks) - applied, "telemetry_refused": len(self.refused),
                "planner_errors": len(self.planner_errors), "planner_s": list(self.planner_s),
                "windows_queued": list(self.windows_queued), "windows_unplanned": self.windows_unplanned,
                "plan_lag_steps": list(self.plan_lag_steps),
                "trimmed": self.trimmed, "peak_over_budget_bytes": self.peak_over_budget_bytes,
                "prefetch": pred}
