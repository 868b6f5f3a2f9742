"""ControllerHub: one `Controller` per registered agent, fed by the HTTP routes, planned by a background thread.

Runs in the controller service process (built by `create_app`, started and stopped by its lifespan). The
request path (`register`, `ingest`, `ack`) only checks, stores and queues: a window is checked against a
light mirror of the agent (`ControllerState`: sequence, time, plan versions), stored with the repository and
queued; it never plans. The planner thread (`plan_once` every `plan_interval_s`) feeds the queued windows and
acks to each agent's controller, updates the telemetry metrics and the measured outcome of the plan the
windows ran under, and once an agent has `plan_every_windows` new windows runs `step_next`: an issued plan is
stored with optimistic concurrency (`PlanConflict`: another service process issued that version first; the
stored plan is adopted by rebuilding the agent from the database, counted), and each issued or held decision
is stored as a `DecisionRecord`. Agents are rebuilt from the database on start, on a policy change and on a
conflict (api/hub_agent.py). It never applies a plan, and never raises a planner failure into a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tierplan.api.db.errors import Conflict, NotFound, PlanConflict, StoreError
from tierplan.api.db.repo import Repository
from tierplan.api.hub_agent import AgentSlot, build_slot, decision_record
from tierplan.api.hub_config import knobs_misfit
from tierplan.api.service_metrics import ServiceMetrics
from tierplan.controller.protocol import AckStatus, Plan, PlanAck, RejectReason, Telemetry, Tier
from tierplan.controller.protocol_service import (
    AgentRegistration,
    AgentStatus,
    IngestResult,
    PlanRecord,
    PolicyRecord,
    PolicyUpdate,
    TelemetryBatch,
    WindowRejection,
)
from tierplan.controller.state import RejectCode

log = logging.getLogger(__name__)
PRUNE_EVERY_S = 60.0
MAINTAIN_EVERY_S = 1.0  # the planner thread's longest sleep (WAL checkpoint, retention)
UNKNOWN_AGENT_LABEL = "unregistered"  # agent_id label of windows from ids never registered
YIELD_MAX_S = 0.05  # the longest the planner defers a step to ingest requests (then it proceeds anyway)


class KnobsMisfit(ValueError):
    """A policy an agent of its group cannot run with (or an agent its group's policy does not fit): 422."""


class ControllerHub:
    """See the module docstring."""

    def __init__(self, repo: Repository, metrics: ServiceMetrics, clock: Callable[[], float],
                 plan_interval_s: float = 0.2, retention_s: float = 86400.0,
                 checkpoint: Callable[[], None] | None = None) -> None:
        self.repo, self.metrics, self.clock, self.plan_interval_s = repo, metrics, clock, plan_interval_s
        self.retention_s, self.checkpoint = retention_s, checkpoint  # checkpoint: api/hub_wal.py
        self._pruned_s = 0.0
        self._agents: dict[str, AgentSlot] = {}
        self._lock = threading.Lock()  # guards _agents
        self._plan_lock = threading.Lock()  # one planner pass at a time (the thread, or a test calling plan_once)
        self._stop = threading.Event()
        self._idle = threading.Condition()  # notified when the last ingest request in flight finishes
        self._inflight = 0
        self._thread: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def load(self) -> None:
        """Rebuild every registered agent from the database (service start)."""
        for status in self.repo.list_agents():
            self._slot(status.agent_id)
        for pol in self.repo.list_policies():
            self.metrics.policy_version.labels(pol.group).set(pol.version)

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tierplan-planner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def _run(self) -> None:
        """Plan every plan_interval_s; the WAL checkpoint and the retention run at least every MAINTAIN_EVERY_S
        whatever the interval (a long one must not let the write-ahead log grow without bound)."""
        tick_s = min(self.plan_interval_s, MAINTAIN_EVERY_S)
        next_plan_s = time.monotonic() + self.plan_interval_s
        while not self._stop.wait(tick_s):
            try:
                if time.monotonic() >= next_plan_s:
                    next_plan_s = time.monotonic() + self.plan_interval_s
                    self.plan_once()
                self.prune()
                if self.checkpoint is not None:
                    self.yield_to_requests()
                    self.checkpoint()
            except Exception as exc:  # the thread must outlive a database hiccup; counted, retried next pass
                log.exception("planner pass failed")
                self.metrics.planner_errors.labels("*", type(exc).__name__).inc()

    def prune(self) -> int:
        """Drop telemetry windows older than the retention (at most once a minute); how many went."""
        now = self.clock()
        if now - self._pruned_s < PRUNE_EVERY_S:
            return 0
        self._pruned_s = now
        return self.repo.prune_windows(now - self.retention_s)

    # ---- agents -------------------------------------------------------------------------------------------
    def _slot(self, agent_id: str) -> AgentSlot | None:
        """The agent's slot, built from the database on first use (it may have registered with another process)."""
        with self._lock:
            slot = self._agents.get(agent_id)
        if slot is not None:
            return slot
        reg = self.repo.get_registration(agent_id)
        if reg is None:
            return None
        built = build_slot(self.repo, reg)
        self._zero_series(reg, built.policy_version)
        with self._lock:
            return self._agents.setdefault(agent_id, built)

    def _zero_series(self, reg: AgentRegistration, policy_version: int) -> None:
        """Every labelled series an agent can move exists from its first appearance, at 0 (a dashboard shows a
        flat 0, not "no data", for a reason or tier that has not happened yet)."""
        m, agent = self.metrics, reg.agent_id
        for reason in RejectReason:
            m.plans_rejected.labels(agent, reason.value)
        for tier in Tier:
            m.kv_hits.labels(agent, tier.value)
            m.kv_misses.labels(agent, tier.value)
        m.policy_version.labels(reg.group).set(policy_version)

    def register(self, reg: AgentRegistration) -> tuple[AgentStatus, bool]:
        """Store the registration (Conflict if the agent is known with another shape) and build its controller;
        KnobsMisfit, storing nothing, when its group's policy cannot drive it."""
        why = knobs_misfit(reg, self.repo.get_policy(reg.group).knobs)
        if why is not None:
            raise KnobsMisfit(f"group {reg.group!r}'s policy does not fit this agent: {why}")
        _, created = self.repo.register_agent(reg)
        self._slot(reg.agent_id)
        status = self.repo.agent_status(reg.agent_id)
        if status is None:
            raise NotFound(f"agent {reg.agent_id!r} vanished right after registering")
        return status, created

    # ---- telemetry ----------------------------------------------------------------------------------------
    def ingest(self, batch: TelemetryBatch) -> IngestResult:
        """Check, store and queue each window; per-window rejections name the rule (RejectCode values)."""
        with self.busy():
            return self._ingest(batch)

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Mark an ingest request in flight (the route holds it from the body's validation on)."""
        with self._idle:
            self._inflight += 1
        try:
            yield
        finally:
            with self._idle:
                self._inflight -= 1
                if not self._inflight:
                    self._idle.notify_all()

    def yield_to_requests(self) -> None:
        """The planner's courtesy: wait (at most YIELD_MAX_S) while an ingest request is in flight. Both share one
        GIL, and every time a request returns from SQLite or its socket it would otherwise wait for the planner's
        switch interval (dozens of times a request)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._inflight, timeout=YIELD_MAX_S)

    def _ingest(self, batch: TelemetryBatch) -> IngestResult:
        rejected: list[WindowRejection] = []
        by_agent: dict[str, list[tuple[int, Telemetry]]] = {}
        for i, tel in enumerate(batch.windows):
            by_agent.setdefault(tel.agent_id, []).append((i, tel))
        num_accepted = 0
        for agent_id, items in by_agent.items():
            slot = self._slot(agent_id)
            if slot is None:
                rejected += [WindowRejection(index=i, agent_id=agent_id, window_seq=t.window_seq,
                                             code=RejectCode.UNKNOWN_AGENT.value,
                                             message=f"agent {agent_id!r} is not registered (POST /v1/agents first)")
                             for i, t in items]
                # one label for every unregistered id: a client's typos must not grow the series without bound
                self.metrics.windows.labels(UNKNOWN_AGENT_LABEL, "rejected").inc(len(items))
                continue
            accepted, refused = self._ingest_agent(slot, items)
            rejected += refused
            num_accepted += accepted
            self.metrics.windows.labels(agent_id, "accepted").inc(accepted)
            if refused:
                self.metrics.windows.labels(agent_id, "rejected").inc(len(refused))
        return IngestResult(accepted=num_accepted, rejected=tuple(sorted(rejected, key=lambda r: r.index)))

    def _ingest_agent(self, slot: AgentSlot, items: list[tuple[int, Telemetry]]) -> tuple[int, list[WindowRejection]]:
        with slot.lock:
            if slot.gate_stale:  # a store failed after the mirror moved: take it from the database again first
                slot.reload_gate(self.repo)
                slot.gate_stale = False
            ok, refused = slot.check_windows(items, self.repo)
            if not ok:
                return 0, refused
            try:  # the mirror moved in check_windows: a failure to store marks it stale (reloaded first next time)
                ok, refused = self._store(slot, ok, refused)
            except BaseException:
                slot.gate_stale = True
                raise
            slot.pending.extend(t for _, t in ok)
            return len(ok), refused

    def _store(self, slot: AgentSlot, ok: list[tuple[int, Telemetry]],
               refused: list[WindowRejection]) -> tuple[list[tuple[int, Telemetry]], list[WindowRejection]]:
        """Store the checked windows; on a Conflict, one at a time (those already stored: seq_not_increasing)."""
        try:
            self.repo.add_windows([t for _, t in ok])
        except Conflict:
            # Some were stored already (a retried batch, or another process): reload the mirror from the
            # database and take the windows one at a time, refusing those it already has.
            slot.reload_gate(self.repo)
            ok2, refused2 = [], []
            for item in ok:
                good, bad = slot.check_windows([item])
                if good:
                    try:
                        self.repo.add_windows([item[1]])
                        ok2 += good
                    except Conflict as exc:
                        slot.reload_gate(self.repo)
                        refused2.append(WindowRejection(index=item[0], agent_id=item[1].agent_id,
                                                        window_seq=item[1].window_seq,
                                                        code=RejectCode.SEQ_NOT_INCREASING.value,
                                                        message=str(exc)[:4000]))
                refused2 += bad
            ok, refused = ok2, refused + refused2
        return ok, refused

    # ---- acks ---------------------------------------------------------------------------------------------
    def ack(self, ack: PlanAck) -> PlanRecord:
        """Store the ack (NotFound: no such plan; Conflict: acked before) and queue it for the controller."""
        slot = self._slot(ack.agent_id)
        if slot is None:
            raise NotFound(f"agent {ack.agent_id!r} is not registered")
        with slot.lock:
            rec = self.repo.record_ack(ack)
            slot.pending.append(ack)
        if ack.status is AckStatus.APPLIED:
            self.metrics.plan_version.labels(ack.agent_id, "applied").set(ack.version)
        else:
            reason = ack.reason_code.value if ack.reason_code is not None else "other"
            self.metrics.plans_rejected.labels(ack.agent_id, reason).inc()
        return rec

    # ---- policies -----------------------------------------------------------------------------------------
    def put_policy(self, group: str, update: PolicyUpdate, author: str) -> PolicyRecord:
        """Check the knobs against every agent of the group (KnobsMisfit), store them (PolicyConflict on a stale
        expected_version) and rebuild the group's controllers on the planner's next pass."""
        for status in self.repo.list_agents():
            if status.group != group:
                continue
            reg = self.repo.get_registration(status.agent_id)
            why = knobs_misfit(reg, update.knobs) if reg is not None else None
            if why is not None:
                raise KnobsMisfit(f"knobs.{why}")
        rec = self.repo.put_policy(group, update, author)
        self.metrics.policy_version.labels(group).set(rec.version)
        with self._lock:
            slots = [s for s in self._agents.values() if s.reg.group == group]
        for slot in slots:
            slot.needs_rebuild = True
        return rec

    # ---- planning (the planner thread) --------------------------------------------------------------------
    def plan_once(self) -> int:
        """One planner pass over every agent; returns how many decisions (issued or held) were stored."""
        with self._plan_lock:
            start = time.perf_counter()
            with self._lock:
                slots = list(self._agents.values())
            try:
                return sum(self._plan_agent(slot) for slot in slots)
            finally:
                self.metrics.planner_pass_s.observe(time.perf_counter() - start)

    def _plan_agent(self, slot: AgentSlot) -> int:
        agent_id = slot.reg.agent_id
        try:
            # first: the metrics and measured outcomes of what is queued
            slot.feed(self.repo, self.metrics, pause=self.yield_to_requests)
            if slot.needs_rebuild:
                slot.rebuild(self.repo)
            if slot.new_windows < slot.knobs.plan_every_windows:
                return 0
            self.yield_to_requests()
            plan = slot.controller.step_next()
        except Exception as exc:  # a failed plan (infeasible budget, solver status) is counted, never raised
            log.warning("planner: agent %s: %s: %s", agent_id, type(exc).__name__, exc)
            self.metrics.planner_errors.labels(agent_id, type(exc).__name__).inc()
            return 0
        decisions = slot.controller.pop_decisions()
        if decisions:
            slot.new_windows = 0
        if plan is not None:
            try:
                self.repo.insert_plan(agent_id, plan)
            except PlanConflict:
                self.metrics.plan_conflicts.inc()
                slot.needs_rebuild = True  # adopt what the other process issued: rebuilt on the next pass
                return 0
            except StoreError as exc:  # not stored: the controller believes it issued it, so reload from the DB
                self.metrics.planner_errors.labels(agent_id, type(exc).__name__).inc()
                slot.needs_rebuild = True
                return 0
            with slot.lock:
                if plan.version > slot.gate.issued_version:  # a reload may have brought it in already
                    slot.gate.record_issued(plan)
            self._plan_metrics(agent_id, plan, slot)
        if slot.controller.shadow is not None:
            promoted = len(slot.controller.shadow.promotions)
            if promoted > slot.promotions_seen:
                self.metrics.shadow_promotions.labels(agent_id).inc(promoted - slot.promotions_seen)
                slot.promotions_seen = promoted
        for d in decisions:
            rec = decision_record(slot, d, self.clock())
            self.repo.add_decision(rec)
            self.metrics.decision_step_s.labels(agent_id, "predicted").set(rec.predicted_step_ms / 1e3)
        return len(decisions)

    def _plan_metrics(self, agent_id: str, plan: Plan, slot: AgentSlot) -> None:
        m = self.metrics
        m.plans_issued.labels(agent_id).inc()
        m.plan_version.labels(agent_id, "issued").set(plan.version)
        slot_bytes = slot.reg.split.slot_bytes
        for layer in slot.reg.shape.moe_layers:
            m.split_slots.labels(agent_id, str(layer)).set(plan.expert_bytes_per_layer[layer] // slot_bytes)
        for tier, blocks in plan.kv_blocks_per_tier.items():
            m.split_kv.labels(agent_id, tier.value).set(blocks)

