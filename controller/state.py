"""What the controller knows of its agents: a versioned mirror of their telemetry and acks (controller process).

`ControllerState.sync_from(telemetry)` checks a window against what is already registered (the model's shape,
the agent's last window, the plans this controller issued) and only then records it: per agent and rank the
last window's sequence number and span, the applied plan version, activations per layer (last window and
totals), KV stats, link stats, stalls, step timings, fallbacks, plus a short history of recent windows.
A window that does not fit is refused with `TelemetryRejected` (a code and a message naming what, where and
what was expected) and changes nothing. `record_issued(plan)` and `record_ack(ack)` keep the plan side.
It decides nothing (the `Controller` in loop.py does) and never imports torch, runtime or agent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tierplan.controller.protocol import (
    AckStatus,
    Footprint,
    KVStats,
    Link,
    LinkStats,
    Plan,
    PlanAck,
    ProtocolError,
    RejectReason,
    Stall,
    StepTimings,
    Telemetry,
    parse,
)

AgentKey = tuple[str, int]  # (agent_id, rank)


class RejectCode(StrEnum):
    MALFORMED = "malformed"  # not a valid Telemetry message at all
    MODEL_MISMATCH = "model_mismatch"  # model name, num_layers or num_experts differ from the registered model
    DENSE_LAYER = "dense_layer"  # activation counts for a layer the registered model says is dense
    SEQ_NOT_INCREASING = "seq_not_increasing"  # window_seq repeats or goes backwards
    TIME_BACKWARDS = "time_backwards"  # the window starts before the agent's last window ended
    PLAN_VERSION_AHEAD = "plan_version_ahead"  # applied_plan_version was never issued by this controller
    PLAN_VERSION_BACKWARDS = "plan_version_backwards"  # applied_plan_version below what the agent applied before
    UNKNOWN_AGENT = "unknown_agent"  # an ack from an agent rank that never sent telemetry


class TelemetryRejected(ValueError):
    """A report the state refused; `code` says which rule, the text says what, where and what was expected."""

    def __init__(self, code: RejectCode, message: str) -> None:
        super().__init__(f"telemetry rejected ({code.value}): {message}")
        self.code, self.message = code, message


@dataclass(frozen=True)
class ModelInfo:
    name: str
    num_layers: int
    num_experts: int
    moe_layers: tuple[int, ...]  # model layers holding experts, ascending


@dataclass
class AgentRecord:
    """One agent rank as last reported. Plain values (tuples, dicts, frozen messages): deep-comparable."""

    agent_id: str
    rank: int
    num_windows: int = 0
    last_window_seq: int = -1  # before the first window; the first accepted one may have any seq >= 0
    last_window_end_s: float = 0.0
    applied_plan_version: int = 0
    activations: dict[int, tuple[int, ...]] = field(default_factory=dict)  # layer -> last window's counts
    activations_total: dict[int, tuple[int, ...]] = field(default_factory=dict)  # layer -> all windows' counts
    tokens_total: dict[int, int] = field(default_factory=dict)  # layer -> tokens over all windows
    kv: KVStats | None = None
    links: dict[Link, LinkStats] = field(default_factory=dict)
    stalls: tuple[Stall, ...] = ()
    step_timings_ms: StepTimings | None = None
    expert_hits_total: int = 0
    expert_misses_total: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)  # as reported (the agent's running counters)
    acked_version: int = 0  # highest version this agent acked as applied (may lead its telemetry by a window)
    footprint: Footprint | None = None  # from the last ack
    last_ack: PlanAck | None = None
    recent: deque[Telemetry] = field(default_factory=deque)  # newest last, at most `history` windows


def _add(a: tuple[int, ...] | None, b: tuple[int, ...]) -> tuple[int, ...]:
    return b if a is None else tuple(x + y for x, y in zip(a, b, strict=True))


class ControllerState:
    """See the module docstring. `version` rises by one with every accepted telemetry window or ack."""

    def __init__(self, model: ModelInfo | None = None, history: int = 16, issued_version: int = 0) -> None:
        if history < 1:
            raise ValueError(f"ControllerState: history must be >= 1, got {history}")
        self.model, self.history = model, history
        self.version = 0
        self.issued_version = issued_version  # highest plan version this controller handed out
        self.plans: dict[int, Plan] = {}  # issued plans by version (the last `history` of them)
        self.rejected: dict[int, RejectReason] = {}  # versions an agent refused, with its first reason code
        self.agents: dict[AgentKey, AgentRecord] = {}

    # ---- checks (read only) -----------------------------------------------------------------------
    def _check_model(self, tel: Telemetry) -> None:
        m = self.model
        if m is None:
            return
        for name, got, want in (("model", tel.model, m.name), ("num_layers", tel.num_layers, m.num_layers),
                                ("num_experts", tel.num_experts, m.num_experts)):
            if got != want:
                raise TelemetryRejected(RejectCode.MODEL_MISMATCH, f"{tel.agent_id} rank {tel.rank} window "
                                        f"{tel.window_seq}: {name}={got!r}, the registered model has {want!r}")
        moe = set(m.moe_layers)
        for i, row in enumerate(tel.layers):
            if row.layer not in moe:
                raise TelemetryRejected(RejectCode.DENSE_LAYER, f"layers.{i}.layer: layer {row.layer} is dense in "
                                        f"the registered model (MoE layers: {m.moe_layers})")

    def _check_agent(self, tel: Telemetry) -> None:
        who = f"{tel.agent_id} rank {tel.rank}"
        rec = self.agents.get((tel.agent_id, tel.rank))
        if tel.applied_plan_version > self.issued_version:
            known = "" if rec is not None else " (an agent not seen before)"
            raise TelemetryRejected(RejectCode.PLAN_VERSION_AHEAD, f"{who}{known}: applied_plan_version="
                                    f"{tel.applied_plan_version}, but the highest plan version issued is "
                                    f"{self.issued_version}")
        if rec is None:
            return
        if tel.window_seq <= rec.last_window_seq:
            how = "repeats" if tel.window_seq == rec.last_window_seq else "goes back from"
            raise TelemetryRejected(RejectCode.SEQ_NOT_INCREASING, f"{who}: window_seq={tel.window_seq} {how} the "
                                    f"last accepted window_seq={rec.last_window_seq} (expected > it)")
        if tel.window_start_s < rec.last_window_end_s:
            raise TelemetryRejected(RejectCode.TIME_BACKWARDS, f"{who} window {tel.window_seq}: window_start_s="
                                    f"{tel.window_start_s} is before the last window's window_end_s="
                                    f"{rec.last_window_end_s}")
        if tel.applied_plan_version < rec.applied_plan_version:
            raise TelemetryRejected(RejectCode.PLAN_VERSION_BACKWARDS, f"{who} window {tel.window_seq}: "
                                    f"applied_plan_version={tel.applied_plan_version} is below the "
                                    f"{rec.applied_plan_version} it reported before")

    # ---- mirroring (after every check passed) -----------------------------------------------------
    def sync_from(self, telemetry: Telemetry | Mapping[str, Any] | str | bytes) -> AgentRecord:
        """Record one window (a message, or its JSON / decoded mapping); TelemetryRejected leaves all as it was."""
        if isinstance(telemetry, Telemetry):
            tel = telemetry
        else:
            try:
                tel = parse(Telemetry, telemetry)
            except ProtocolError as exc:
                raise TelemetryRejected(RejectCode.MALFORMED, str(exc)) from None
        self._check_model(tel)
        self._check_agent(tel)
        if self.model is None:
            self.model = ModelInfo(tel.model, tel.num_layers, tel.num_experts,
                                   tuple(sorted(row.layer for row in tel.layers)))
        key = (tel.agent_id, tel.rank)
        rec = self.agents.get(key) or AgentRecord(tel.agent_id, tel.rank)
        rec.num_windows += 1
        rec.last_window_seq, rec.last_window_end_s = tel.window_seq, tel.window_end_s
        rec.applied_plan_version = tel.applied_plan_version
        for row in tel.layers:
            rec.activations[row.layer] = row.activation_counts
            rec.activations_total[row.layer] = _add(rec.activations_total.get(row.layer), row.activation_counts)
            rec.tokens_total[row.layer] = rec.tokens_total.get(row.layer, 0) + row.num_tokens
        rec.kv, rec.stalls, rec.step_timings_ms = tel.kv, tel.stalls, tel.step_timings_ms
        rec.links = {s.link: s for s in tel.links}
        rec.expert_hits_total += tel.expert_hits
        rec.expert_misses_total += tel.expert_misses
        rec.fallbacks = dict(tel.fallbacks)
        rec.recent.append(tel)
        while len(rec.recent) > self.history:
            rec.recent.popleft()
        self.agents[key] = rec
        self.version += 1
        return rec

    def record_issued(self, plan: Plan) -> None:
        """A plan this controller hands out; versions must rise (ValueError otherwise, nothing recorded)."""
        if plan.version <= self.issued_version:
            raise ValueError(f"record_issued: plan {plan.plan_id} has version {plan.version}, not above the last "
                             f"issued version {self.issued_version}")
        self.issued_version = plan.version
        self.plans[plan.version] = plan
        for v in sorted(self.plans)[: max(0, len(self.plans) - self.history)]:
            del self.plans[v]
        for v in [v for v in self.rejected if v not in self.plans]:
            del self.rejected[v]

    def record_ack(self, ack: PlanAck) -> AgentRecord:
        """Mirror an agent's answer to a plan (its measured footprint, a refusal's reason code);
        TelemetryRejected, changing nothing, for a version never issued or an agent that never sent telemetry
        (it would join `applied_version`'s minimum at 0 and hold every later plan back)."""
        who = f"{ack.agent_id} rank {ack.rank}"
        if ack.version > self.issued_version:
            raise TelemetryRejected(RejectCode.PLAN_VERSION_AHEAD, f"{who}: ack for plan "
                                    f"version {ack.version}, but the highest issued is {self.issued_version}")
        key = (ack.agent_id, ack.rank)
        rec = self.agents.get(key)
        if rec is None:
            known = ", ".join(f"{a} rank {r}" for a, r in sorted(self.agents)) or "none"
            raise TelemetryRejected(RejectCode.UNKNOWN_AGENT, f"{who}: ack for plan version {ack.version} from "
                                    f"an agent that sent no telemetry (expected one of: {known})")
        rec.footprint, rec.last_ack = ack.footprint, ack
        if ack.status is AckStatus.APPLIED:
            rec.acked_version = max(rec.acked_version, ack.version)
        elif ack.reason_code is not None:
            self.rejected.setdefault(ack.version, ack.reason_code)
        self.agents[key] = rec
        self.version += 1
        return rec

    # ---- reading ----------------------------------------------------------------------------------
    def applied_version(self) -> int:
        """The plan version every agent has applied, by telemetry or ack (the lowest of them; 0 before any)."""
        return min((max(r.applied_plan_version, r.acked_version) for r in self.agents.values()), default=0)

    def last_issued_rejected(self) -> bool:
        """Whether an agent refused the newest plan issued (the controller may then issue another)."""
        return self.issued_version in self.rejected

    def recent_windows(self) -> list[Telemetry]:
        """Every agent's recent windows, oldest first by window end."""
        return sorted((t for r in self.agents.values() for t in r.recent), key=lambda t: t.window_end_s)
