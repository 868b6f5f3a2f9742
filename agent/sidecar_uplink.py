"""The sidecar's uplink: queues what the agents sent and moves it to the controller service (sidecar process).

Agent-socket threads call `add_registration`, `add_window`, `add_ack` (memory only, under a short lock) and
`current_plan`; one uplink thread runs `tick()` (or `run`), which does the HTTP work in order:
1. register every agent not registered since the last failure (so a service that returns is told again);
2. send windows and acks in the order they arrived: windows in `TelemetryBatch`es of at most
   `max_batch_windows` / `max_batch_bytes`, when a batch is full, `flush_s` passed, or an ack waits behind them;
3. poll each registered agent's plan (`since_version` + ETag) every `poll_s`; a new plan is cached and pushed.
A request the service does not answer puts the batch back at the queue's front, counts the error by kind,
moves fail-static on (`FailStatic`), marks every agent for re-registration and waits a full-jitter backoff;
a refused one (4xx) is dropped and counted, never retried forever. Queues are bounded: the oldest window
(or ack) is dropped with a counter. Accounting, exact at any instant: received == sent + dropped (by
reason) + queued + in flight. A window the service may already have stored (the answer was lost) and then
refuses as `seq_not_increasing` on the retry counts as sent (`redelivered`); windows refused as
`unknown_agent` (a service on a fresh database) go back once, after a new registration. Clock, RNG, client, metrics
and the push callback come in through the constructor. It must never block an agent-socket thread on HTTP.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from tierplan.agent.sidecar_backoff import Backoff
from tierplan.agent.sidecar_client import PollStatus, ServiceClient, ServiceRefused, ServiceUnavailable
from tierplan.agent.sidecar_failstatic import FailStatic, Mode
from tierplan.agent.sidecar_metrics import SidecarMetrics
from tierplan.controller.protocol import Plan, PlanAck, Telemetry
from tierplan.controller.protocol_service import MAX_BATCH_WINDOWS, AgentRegistration

# controller.state.RejectCode values (the agent may import only the protocol)
REDELIVERED_CODE = "seq_not_increasing"
UNKNOWN_AGENT_CODE = "unknown_agent"


@dataclass(frozen=True)
class UplinkConfig:
    flush_s: float = 1.0
    poll_s: float = 1.0
    plan_ttl_s: float = 30.0
    max_batch_windows: int = MAX_BATCH_WINDOWS
    max_batch_bytes: int = 3 << 20  # under the service's default 4 MiB request limit
    max_queued_windows: int = 16384
    max_queued_acks: int = 256
    backoff_base_s: float = 0.2
    backoff_cap_s: float = 10.0


@dataclass
class _Window:
    seq: int  # arrival order among windows and acks
    agent_id: str
    text: bytes  # the window's JSON, as it goes into the batch
    maybe_delivered: bool = False
    resent_unknown: bool = False  # already sent again once after the service said it did not know the agent


@dataclass
class _Ack:
    seq: int
    ack: PlanAck


@dataclass
class _Agent:
    reg: AgentRegistration
    registered: bool = False
    refused: str = ""  # the service's reason when it refused this registration (not retried)


@dataclass
class UplinkCounts:
    received: int = 0
    sent: int = 0
    redelivered: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    acks_received: int = 0
    acks_sent: int = 0
    acks_dropped: Counter[str] = field(default_factory=Counter)
    plans_pulled: int = 0
    registrations: int = 0


class Uplink:
    def __init__(self, client: ServiceClient, metrics: SidecarMetrics, config: UplinkConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 push: Callable[[str, Plan], None] | None = None) -> None:
        self.client, self.metrics, self.config, self.clock = client, metrics, config or UplinkConfig(), clock
        c = self.config
        self.push = push or (lambda agent_id, plan: None)
        self.backoff = Backoff(c.backoff_base_s, c.backoff_cap_s, rng or random.Random())
        self.fail = FailStatic(c.plan_ttl_s, clock(), self._mode_changed)
        self.counts = UplinkCounts()
        self.last_error = ""
        self._lock = threading.Lock()
        self._kick = threading.Event()
        self._seq = count()
        self._windows: deque[_Window] = deque()
        self._acks: deque[_Ack] = deque()
        self._in_flight = 0
        self._agents: dict[tuple[str, int], _Agent] = {}
        self._plans: dict[str, Plan] = {}
        self._etags: dict[str, str] = {}
        self._retry_at_s: float | None = None
        self._flush_requested = False
        self._reregister_first = False
        self._last_flush_s = clock()
        self._next_poll_s = clock()

    # ---- agent-socket threads: memory only -------------------------------------------------------------
    def add_registration(self, reg: AgentRegistration) -> None:
        with self._lock:
            key = (reg.agent_id, reg.rank)
            known = self._agents.get(key)
            if known is None or known.reg != reg or known.refused:
                self._agents[key] = _Agent(reg)
        self._kick.set()

    def add_window(self, tel: Telemetry) -> None:
        with self._lock:
            self.counts.received += 1
            if len(self._windows) >= self.config.max_queued_windows:
                self._windows.popleft()
                self._drop("queue_full")
            self._windows.append(_Window(next(self._seq), tel.agent_id, tel.model_dump_json().encode()))
            depth = len(self._windows)
        self.metrics.windows_received.inc()
        self.metrics.queue_depth.set(depth)
        if depth >= self.config.max_batch_windows:
            self._kick.set()

    def add_ack(self, ack: PlanAck) -> None:
        with self._lock:
            self.counts.acks_received += 1
            if len(self._acks) >= self.config.max_queued_acks:
                self._acks.popleft()
                self._drop_ack("queue_full")
            self._acks.append(_Ack(next(self._seq), ack))
        self._kick.set()

    def current_plan(self, agent_id: str, since_version: int) -> Plan | None:
        """The cached plan when it is newer than `since_version` and fail-static still serves it."""
        plan = self._plans.get(agent_id)  # one dict read: atomic, no lock needed
        ok = plan is not None and plan.version > since_version and self.fail.serves_cached_plan
        return plan if ok else None

    # ---- the uplink thread ------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            delay_s = self.tick()
            self._kick.wait(delay_s)
            self._kick.clear()

    def stop_waiting(self) -> None:
        self._kick.set()

    def request_flush(self) -> None:
        """Send what is queued on the next tick, batch timer or not (the sidecar is stopping)."""
        self._flush_requested = True
        self._kick.set()

    def tick(self) -> float:
        """Do the work that is due; return the seconds until more may be due."""
        now = self.clock()
        self.fail.age(now)
        if self._retry_at_s is not None and now < self._retry_at_s:
            return self._wait_s(now, self._retry_at_s)
        self._retry_at_s = None
        try:
            self._register_pending()
            self._send_queued(now)
            self._poll(now)
        except Exception as exc:  # unanswered, or a bug in handling an answer: counted, retried after a backoff
            kind = exc.kind.value if isinstance(exc, ServiceUnavailable) else "internal"
            self.last_error = str(exc) if kind != "internal" else f"{type(exc).__name__}: {exc}"
            self.metrics.service_errors.labels(kind=kind).inc()
            self.fail.unreachable(now)
            with self._lock:
                for agent in self._agents.values():
                    agent.registered = False
            delay_s = self.backoff.next_delay_s()
            self.metrics.retries.inc()
            self._retry_at_s = now + delay_s
            return self._wait_s(now, self._retry_at_s)
        self.backoff.reset()
        due = min(self._next_poll_s, self._last_flush_s + self.config.flush_s)
        return self._wait_s(now, due)

    def _wait_s(self, now: float, until: float) -> float:
        if self.fail.mode is Mode.LAST_GOOD:  # wake when the TTL runs out, to switch to safe static on time
            until = min(until, self.fail.last_ok_s + self.fail.ttl_s)
        return max(0.0, until - now)

    def _answered(self) -> None:
        self.fail.answered(self.clock())

    def _refused(self, exc: ServiceRefused) -> None:
        self._answered()
        self.last_error = str(exc)
        self.metrics.service_errors.labels(kind="http_4xx").inc()

    def _register_pending(self) -> None:
        with self._lock:
            pending = [a for a in self._agents.values() if not a.registered and not a.refused]
        for agent in pending:
            try:
                self.client.register(agent.reg)
            except ServiceRefused as exc:  # e.g. 409: this agent id runs another model; its telemetry is refused
                self._refused(exc)
                agent.refused = exc.detail
                continue
            self._answered()
            agent.registered = True
            self.counts.registrations += 1
            self.metrics.registrations.inc()
            self._next_poll_s = self.clock()  # a (re-)registered agent's plan is polled at once

    def _send_queued(self, now: float) -> None:
        """Acks and windows in arrival order. Windows go when a flush is due (a full batch, `flush_s` passed,
        an ack behind them, a requested flush): then everything queued at that moment goes, batch by batch."""
        c = self.config
        until_seq: int | None = None  # while flushing: the newest window to send in this flush
        self._reregister_first = False
        while not self._reregister_first:
            with self._lock:
                ack = self._acks[0] if self._acks else None
                head = self._windows[0] if self._windows else None
                num_windows = len(self._windows)
                newest = self._windows[-1].seq if self._windows else None
            if ack is not None and (head is None or ack.seq < head.seq):
                self._send_ack(ack)
                continue
            if head is None or (until_seq is not None and head.seq > until_seq):
                if head is None:
                    self._last_flush_s = now
                self._flush_requested = False
                return
            if until_seq is None:
                if not (num_windows >= c.max_batch_windows or now - self._last_flush_s >= c.flush_s
                        or self._flush_requested or ack is not None):
                    return
                until_seq, self._last_flush_s = newest, now
            limit = until_seq if ack is None else min(until_seq, ack.seq)
            self._send_batch(limit)

    def _send_ack(self, item: _Ack) -> None:
        try:
            self.client.post_ack(item.ack)
        except ServiceRefused as exc:  # 404 unknown plan, 409 second ack: the service will never take it
            self._refused(exc)
            with self._lock:
                self._acks.popleft()
                self._drop_ack(f"http_{exc.status}")
            return
        self._answered()
        with self._lock:
            self._acks.popleft()
            self.counts.acks_sent += 1
        self.metrics.acks_sent.inc()

    def _send_batch(self, until_seq: int) -> None:
        """POST the oldest windows up to `until_seq`, at most a batch (windows and bytes)."""
        c = self.config
        with self._lock:
            batch: list[_Window] = []
            num_bytes = 0
            while self._windows and len(batch) < c.max_batch_windows:
                w = self._windows[0]
                if w.seq > until_seq or (batch and num_bytes + len(w.text) > c.max_batch_bytes):
                    break
                batch.append(self._windows.popleft())
                num_bytes += len(w.text) + 1
            self._in_flight = len(batch)
        body = b'{"schema_version":1,"windows":[' + b",".join(w.text for w in batch) + b"]}"
        t0 = time.perf_counter()
        try:
            result = self.client.post_telemetry(body)
        except ServiceRefused as exc:  # 413, 422, 401...: the same batch would be refused again
            self._refused(exc)
            with self._lock:
                self._in_flight = 0
                self._drop(f"http_{exc.status}", len(batch))
            return
        except BaseException as exc:  # unanswered (or a bug): the batch goes back, nothing is lost here
            self._put_back(batch, getattr(exc, "maybe_delivered", True))
            raise
        finally:
            self.metrics.post_seconds.observe(time.perf_counter() - t0)
        self._answered()
        self._settle(batch, result.rejected)

    def _settle(self, batch: list[_Window], rejected: Any) -> None:
        refused = {r.index: r.code for r in rejected if 0 <= r.index < len(batch)}
        with self._lock:
            self._in_flight = 0
            num_sent = 0
            again: list[_Window] = []
            for i, w in enumerate(batch):
                code = refused.get(i)
                if code is None:
                    num_sent += 1
                elif code == REDELIVERED_CODE and w.maybe_delivered:
                    num_sent += 1
                    self.counts.redelivered += 1
                elif code == UNKNOWN_AGENT_CODE and not w.resent_unknown:
                    w.resent_unknown = True  # the service lost the registration (a fresh database): once more
                    again.append(w)
                    for agent in self._agents.values():
                        if agent.reg.agent_id == w.agent_id:
                            agent.registered = False
                else:
                    self._drop(f"rejected_{code}")
            self.counts.sent += num_sent
            depth = len(self._windows)
        self.metrics.windows_sent.inc(num_sent)
        self.metrics.queue_depth.set(depth)
        if again:
            self._put_back(again, maybe_delivered=False)
            self._reregister_first = True  # stop this flush: register on the next tick, then send these
            self._kick.set()

    def _put_back(self, batch: list[_Window], maybe_delivered: bool) -> None:
        with self._lock:
            self._in_flight = 0
            room = self.config.max_queued_windows - len(self._windows)
            keep = batch[len(batch) - max(0, room):] if room < len(batch) else batch  # the oldest go first
            self._drop("queue_full", len(batch) - len(keep))
            for w in reversed(keep):
                w.maybe_delivered = w.maybe_delivered or maybe_delivered
                self._windows.appendleft(w)

    def _poll(self, now: float) -> None:
        if now < self._next_poll_s:
            return
        with self._lock:
            agent_ids = sorted({a.reg.agent_id for a in self._agents.values() if a.registered})
        for agent_id in agent_ids:
            cached = self._plans.get(agent_id)
            try:
                poll = self.client.get_plan(agent_id, cached.version if cached else 0, self._etags.get(agent_id))
            except ServiceRefused as exc:
                self._refused(exc)
                continue
            self._answered()
            if poll.status is PollStatus.NEW and poll.plan is not None and (cached is None
                                                                            or poll.plan.version > cached.version):
                with self._lock:
                    self._plans[agent_id] = poll.plan
                    if poll.etag:
                        self._etags[agent_id] = poll.etag
                self.counts.plans_pulled += 1
                self.metrics.plan_version.set(poll.plan.version)
                self.push(agent_id, poll.plan)
        self._next_poll_s = now + self.config.poll_s

    def abandon(self) -> None:
        """The sidecar is exiting: what is still queued will never be sent; counted as dropped (`shutdown`)."""
        with self._lock:
            self._drop("shutdown", len(self._windows))
            self._drop_ack("shutdown", len(self._acks))
            self._windows.clear()
            self._acks.clear()
        self.metrics.queue_depth.set(0)

    # ---- accounting -------------------------------------------------------------------------------------
    def _drop(self, reason: str, n: int = 1) -> None:
        if n > 0:
            self.counts.dropped[reason] += n
            self.metrics.windows_dropped.labels(reason=reason).inc(n)

    def _drop_ack(self, reason: str, n: int = 1) -> None:
        if n > 0:
            self.counts.acks_dropped[reason] += n
            self.metrics.acks_dropped.labels(reason=reason).inc(n)

    def _mode_changed(self, old: Mode, new: Mode) -> None:
        self.metrics.fail_static.set(0 if new is Mode.ONLINE else 1)
        if new is not Mode.ONLINE:
            self.metrics.fail_static_transitions.labels(mode=new.value).inc()
        else:
            self._next_poll_s = self.clock()  # back: poll at once

    def stats(self) -> dict[str, Any]:
        """received == sent + sum(dropped) + queued + in_flight, read under one lock."""
        with self._lock:
            c = self.counts
            return {"mode": self.fail.mode.value, "received": c.received, "sent": c.sent,
                    "redelivered": c.redelivered, "dropped": dict(c.dropped), "queued": len(self._windows),
                    "in_flight": self._in_flight, "acks_received": c.acks_received, "acks_sent": c.acks_sent,
                    "acks_dropped": dict(c.acks_dropped), "acks_queued": len(self._acks),
                    "plans_pulled": c.plans_pulled, "registrations": c.registrations,
                    "fail_static_entries": {m.value: n for m, n in self.fail.entries.items()},
                    "plan_versions": {a: p.version for a, p in self._plans.items()}, "last_error": self.last_error}
