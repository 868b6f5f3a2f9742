"""One agent inside the ControllerHub: its request-path mirror, its controller and the queue between them.

Runs in the controller service process. `AgentSlot.gate` is a light `ControllerState` the request path checks
windows against (sequence, time, plan versions) under `lock`; `controller` is touched only by the planner
thread (`feed`, then the hub's `step_next`); `pending` carries the stored windows and acks from one to the
other in order. `build_slot` / `rebuild` load an agent from the database (its newest plans, recent windows
and acks), so a restarted service, a policy change or another process's plan picks up where the database
is. It never plans (the hub does) and never talks HTTP.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tierplan.api.db.errors import StoreError
from tierplan.api.db.repo import Repository
from tierplan.api.hub_config import controller_config, knobs_misfit
from tierplan.api.service_metrics import ServiceMetrics
from tierplan.controller.loop import Controller, Decision
from tierplan.controller.protocol import PlanAck, Telemetry, Tier
from tierplan.controller.protocol_service import (
    AgentRegistration,
    DecisionOutcome,
    DecisionRecord,
    PolicyKnobs,
    SplitView,
    WindowRejection,
)
from tierplan.controller.state import ControllerState, ModelInfo, RejectCode, TelemetryRejected

log = logging.getLogger(__name__)

PLAN_HISTORY = 16  # plans reloaded on a rebuild (the controller state keeps as many)
REPLAY_WINDOWS = 32  # recent windows a rebuilt controller learns from again
MEASURED_VERSIONS = 8  # plan versions whose measured step time is still being averaged
LEARN_PER_PASS = 8  # windows per agent a planner pass learns from (the newest; see AgentSlot.feed)
PAUSE_EVERY = 16  # queued windows counted between two pauses of a pass


def _gate_state(reg: AgentRegistration) -> ControllerState:
    s = reg.shape
    return ControllerState(ModelInfo(s.name, s.num_layers, s.num_experts, s.moe_layers), history=1)


class WindowTally:
    """A planner pass's windows summed per metric label, then added to the metrics in one go (a label lookup
    per window and counter cost more than learning from the window did). Fallbacks arrive as the agent's
    running counters: the increase is added (a lower value means the agent restarted: all of it)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], float] = {}  # (metric attribute, label) -> amount
        self.last: Telemetry | None = None
        self.expert_lookups = [0, 0]  # hits, misses over the pass's windows (a window can have no lookups at all)

    def add(self, tel: Telemetry, last_fallbacks: dict[str, int]) -> None:
        c = self.counts
        for tier, n in tel.kv.hits_per_tier.items():
            c["kv_hits", tier.value] = c.get(("kv_hits", tier.value), 0) + n
        for tier, n in tel.kv.misses_per_tier.items():
            c["kv_misses", tier.value] = c.get(("kv_misses", tier.value), 0) + n
        for stall in tel.stalls:
            c["stall_s", stall.cause.value] = c.get(("stall_s", stall.cause.value), 0) + stall.total_ms / 1e3
        for link in tel.links:
            c["link_bytes", link.link.value] = c.get(("link_bytes", link.link.value), 0) + link.bytes
        for name, n in tel.fallbacks.items():
            before = last_fallbacks.get(name, 0)
            c["fallbacks", name] = c.get(("fallbacks", name), 0) + (n - before if n >= before else n)
            last_fallbacks[name] = n
        self.expert_lookups[0] += tel.expert_hits
        self.expert_lookups[1] += tel.expert_misses
        self.last = tel

    def flush(self, metrics: ServiceMetrics, agent_id: str) -> None:
        for (attr, label), amount in self.counts.items():  # inc(0) too: a label reported only as 0 gets its series
            getattr(metrics, attr).labels(agent_id, label).inc(amount)
        tel = self.last
        if tel is None:
            return
        hits, misses = self.expert_lookups
        if hits + misses:
            metrics.hit_rate.labels(agent_id).set(hits / (hits + misses))
        metrics.step_s.labels(agent_id, "p50").set(tel.step_timings_ms.p50 / 1e3)
        metrics.step_s.labels(agent_id, "p99").set(tel.step_timings_ms.p99 / 1e3)


@dataclass
class AgentSlot:
    reg: AgentRegistration
    knobs: PolicyKnobs
    policy_version: int
    controller: Controller
    gate: ControllerState
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: deque[Telemetry | PlanAck] = field(default_factory=deque)
    new_windows: int = 0  # windows fed to the controller since its last decision
    needs_rebuild: bool = False
    gate_stale: bool = False  # a store failed after the gate had mirrored the windows: reload it before use
    promotions_seen: int = 0
    measured: dict[int, tuple[float, int]] = field(default_factory=dict)  # version -> (sum of p50 ms, windows)
    fallbacks: dict[str, int] = field(default_factory=dict)

    # ---- request path (under `lock`) ----------------------------------------------------------------------
    def check_windows(self, items: list[tuple[int, Telemetry]],
                      repo: Repository | None = None) -> tuple[list[tuple[int, Telemetry]], list[WindowRejection]]:
        """Mirror each window into the gate; the refused ones as rejections. A window naming a plan version
        the gate has not seen reloads it from `repo` once (another service process may have issued it)."""
        ok, refused = [], []
        for i, tel in items:
            try:
                self.gate.sync_from(tel)
            except TelemetryRejected as exc:
                if exc.code is RejectCode.PLAN_VERSION_AHEAD and repo is not None:
                    self.reload_gate(repo)
                    repo = None
                    try:
                        self.gate.sync_from(tel)
                        ok.append((i, tel))
                        continue
                    except TelemetryRejected as again:
                        exc = again
                refused.append(WindowRejection(index=i, agent_id=tel.agent_id, window_seq=tel.window_seq,
                                               code=exc.code.value, message=exc.message[:4000]))
            else:
                ok.append((i, tel))
        return ok, refused

    def reload_gate(self, repo: Repository) -> None:
        gate = _gate_state(self.reg)
        for rec in reversed(repo.plan_history(self.reg.agent_id, limit=PLAN_HISTORY)):
            gate.record_issued(rec.plan)
        for tel in repo.recent_windows(self.reg.agent_id, REPLAY_WINDOWS):
            try:
                gate.sync_from(tel)
            except TelemetryRejected:
                continue
        self.gate = gate

    # ---- planner thread -----------------------------------------------------------------------------------
    def rebuild(self, repo: Repository) -> None:
        """Reload policy, plans, windows and acks from the database (under `lock`: ingest waits meanwhile); the
        queue is dropped, since everything in it is in the database already."""
        with self.lock:
            fresh = build_slot(repo, self.reg)
            self.knobs, self.policy_version = fresh.knobs, fresh.policy_version
            self.controller, self.gate = fresh.controller, fresh.gate
            # The queued windows were replayed from the database: they still count towards the next decision.
            self.new_windows += sum(isinstance(item, Telemetry) for item in self.pending)
            self.pending.clear()
            self.needs_rebuild, self.promotions_seen = False, 0

    def feed(self, repo: Repository, metrics: ServiceMetrics, learn_limit: int = LEARN_PER_PASS,
             pause: Callable[[], None] = lambda: None) -> None:
        """Hand the queued windows and acks to the controller; store the measured step time of the plans run.
        Only the newest `learn_limit` windows of a pass are learned from (its demand models are decayed
        averages, and learning costs ~1 ms a window: a fast sender must not starve ingest of the CPU); the
        older ones still count in the metrics, the measured outcomes and `plan_every_windows`, and each is
        counted in tierplan_planner_windows_skipped_total. `pause` runs between steps (the hub lets ingest
        requests in flight go first)."""
        with self.lock:
            items = list(self.pending)
            self.pending.clear()
        agent_id, touched, tally = self.reg.agent_id, set(), WindowTally()
        skip = max(0, sum(isinstance(item, Telemetry) for item in items) - learn_limit)
        if skip:
            metrics.windows_skipped.labels(agent_id).inc(skip)
        for k, item in enumerate(items):
            if k % PAUSE_EVERY == 0:
                pause()
            try:
                if isinstance(item, PlanAck):
                    self.controller.record_ack(item)
                    continue
                if skip:
                    skip -= 1
                else:
                    pause()
                    self.controller.sync_from(item)
            except TelemetryRejected as exc:  # the gate let it through, so the controller lags: counted
                metrics.planner_errors.labels(agent_id, f"controller_{exc.code.value}").inc()
                continue
            self.new_windows += 1
            tally.add(item, self.fallbacks)
            v = item.applied_plan_version
            if v > 0 and item.step_timings_ms.num_steps > 0:  # a window of no steps measured nothing
                total, n = self.measured.get(v, (0.0, 0))
                self.measured[v] = (total + item.step_timings_ms.p50, n + 1)
                touched.add(v)
        tally.flush(metrics, agent_id)
        for v in sorted(self.measured)[:-MEASURED_VERSIONS]:
            del self.measured[v]
        for v in sorted(touched & set(self.measured)):
            total, n = self.measured[v]
            try:
                repo.set_measured(agent_id, v, total / n)
            except StoreError:  # a plan another process issued and decided: its decision lives there
                continue
            metrics.decision_step_s.labels(agent_id, "measured").set(total / n / 1e3)


def build_slot(repo: Repository, reg: AgentRegistration) -> AgentSlot:
    """An agent's slot as the database has it: its group's policy, its newest plans, windows and acks."""
    policy = repo.get_policy(reg.group)
    knobs = policy.knobs
    why = knobs_misfit(reg, knobs)
    if why is not None:  # only a race with a policy change can get here (both paths check the fit)
        log.warning("agent %s: group %r policy v%d does not fit (%s); running the default knobs", reg.agent_id,
                    reg.group, policy.version, why)
        knobs = PolicyKnobs()
    ctl = Controller(controller_config(reg, knobs), reg.agent_id)
    gate = _gate_state(reg)
    history = list(reversed(repo.plan_history(reg.agent_id, limit=PLAN_HISTORY)))  # oldest first
    for rec in history:
        ctl.state.record_issued(rec.plan)
        gate.record_issued(rec.plan)
    for tel in repo.recent_windows(reg.agent_id, REPLAY_WINDOWS):
        for target in (ctl, gate):
            try:
                target.sync_from(tel)
            except TelemetryRejected:
                continue
    for rec in history:
        if rec.ack is not None:
            try:
                ctl.record_ack(rec.ack)
            except TelemetryRejected:
                continue
    ctl.pop_decisions()
    return AgentSlot(reg, knobs, policy.version, ctl, gate)


def decision_record(slot: AgentSlot, d: Decision, now_s: float) -> DecisionRecord:
    """A controller Decision as the stored record (id 0: the repository assigns it)."""
    split, reg = d.split, slot.reg
    kv = {Tier.GPU: split.kv_blocks, Tier.CPU: reg.split.kv_cpu_blocks, Tier.NVME: reg.split.kv_nvme_blocks}
    view = SplitView(expert_slots_per_layer=split.slots, expert_bytes=sum(split.slots) * reg.split.slot_bytes,
                     kv_blocks_per_tier=kv, kv_gpu_bytes=split.kv_blocks * reg.split.kv_block_bytes)
    return DecisionRecord(id=0, agent_id=reg.agent_id, created_s=now_s, outcome=DecisionOutcome(d.outcome.value),
                          version=d.version, window=d.window, policy_version=slot.policy_version,
                          batch_tokens=max(0.0, d.batch_tokens), kv_demand_blocks=max(0.0, d.kv_demand_blocks),
                          split=view, predicted_step_ms=max(0.0, d.step_ms), reason=d.reason[:4000])
