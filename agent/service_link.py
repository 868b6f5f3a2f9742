"""`ServiceLink`: the agent's end of the unix socket to its sidecar, a `PlanSource` for `InProcessLoop`.

Runs in the inference process. The engine-facing methods (`sync_from`, `step_next`, `record_ack`, called on
the outbox and engine threads) only touch in-memory queues under a lock held for a few instructions: they
never wait on the socket, the sidecar or the network. Telemetry and acks go to bounded queues that a sender
thread drains into the socket in the order they were made; when a queue is full its oldest entry is dropped
and counted (a dead, slow or missing sidecar costs the engine a counter, nothing more). A reader thread
takes the plans the sidecar pushes; `step_next` hands out the newest one newer than the last handed out.
The sender reconnects with backoff; on each connection it first sends the agent's registration and a `PlanRequest`.

Accounting, exact at any instant (`stats()` reads it under the lock): every window given to `sync_from` is
sent, dropped (by reason) or still queued/in flight. A frame whose send failed goes back to the queue's
front (the sidecar drops a half-received frame with the connection), so a reconnect loses nothing by itself.
`engine_thread_io` counts socket operations (connect, send, receive: the socket object itself reports each)
made from any thread but the link's own two: the guard that the hot path never does I/O (tests assert 0).
It must never build or change a plan, nor raise into the engine.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections import Counter, deque
from collections.abc import Callable
from enum import StrEnum
from itertools import count
from typing import Any

from tierplan.agent.sidecar_backoff import Backoff
from tierplan.agent.sidecar_ipc import MAX_FRAME_BYTES, FrameDecoder, FrameError, FrameType, encode_frame
from tierplan.controller.protocol import Plan, PlanAck, ProtocolModel, Telemetry
from tierplan.controller.protocol_service import PlanRequest

RECV_BYTES = 1 << 16


class DropReason(StrEnum):
    QUEUE_FULL = "queue_full"  # the oldest entry made room for a newer one
    TOO_LARGE = "too_large"  # over the frame limit: it can never be sent
    CLOSED = "closed"  # still queued when the link closed


class LinkState(StrEnum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    CLOSED = "closed"


class ServiceLink:
    """See the module docstring. `registration` is the agent's `AgentRegistration` (any message with
    `agent_id` and `rank`); `connect` opens the socket (a test injects a failing or slow one)."""

    def __init__(self, socket_path: str, registration: ProtocolModel, max_queued_windows: int = 1024,
                 max_queued_acks: int = 64, send_timeout_s: float = 2.0, reconnect: Backoff | None = None,
                 max_frame_bytes: int = MAX_FRAME_BYTES,
                 connect: Callable[[str, float], socket.socket] | None = None) -> None:
        if max_queued_windows < 1 or max_queued_acks < 1:
            raise ValueError(f"ServiceLink: queue bounds must be >= 1, got {max_queued_windows}, {max_queued_acks}")
        self.socket_path, self.registration = socket_path, registration
        self.agent_id, self.rank = registration.agent_id, registration.rank  # type: ignore[attr-defined]
        self.send_timeout_s, self.max_frame_bytes = send_timeout_s, max_frame_bytes
        self._connect = connect or _connect_unix
        self._backoff = reconnect or Backoff(base_s=0.05, cap_s=2.0, rng=random.Random())
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._seq = count()  # arrival order: the sidecar must see windows and acks in the order they were made
        self._windows: deque[tuple[int, Telemetry]] = deque()
        self._acks: deque[tuple[int, PlanAck]] = deque()
        self._max_windows, self._max_acks = max_queued_windows, max_queued_acks
        self._in_flight: tuple[int, Telemetry | PlanAck] | None = None
        self._latest: Plan | None = None  # newest plan the sidecar pushed
        self._handed_version = 0  # newest version step_next handed out
        self._sock: _Guarded | None = None
        self._closing = threading.Event()
        self._io_threads: set[int] = set()
        self.state = LinkState.CONNECTING
        self.counts: Counter[str] = Counter()  # produced, sent, acks_*, plans_*, connects, ... (see stats)
        self.dropped: Counter[DropReason] = Counter()
        self.acks_dropped: Counter[DropReason] = Counter()
        self.last_error = ""
        self._sender = threading.Thread(target=self._send_loop, name="tierplan-link-sender", daemon=True)
        self._sender.start()

    # ---- engine-facing (outbox / engine threads): memory only ------------------------------------------
    def sync_from(self, telemetry: Telemetry) -> None:
        with self._wake:
            self.counts["produced"] += 1
            if len(self._windows) >= self._max_windows:
                self._windows.popleft()
                self.dropped[DropReason.QUEUE_FULL] += 1
            self._windows.append((next(self._seq), telemetry))
            self._wake.notify()

    def step_next(self) -> Plan | None:
        with self._lock:
            plan = self._latest
            if plan is None or plan.version <= self._handed_version:
                return None
            self._handed_version = plan.version
            self.counts["plans_handed_out"] += 1
            return plan

    def record_ack(self, ack: PlanAck) -> None:
        with self._wake:
            self.counts["acks_produced"] += 1
            if len(self._acks) >= self._max_acks:
                self._acks.popleft()
                self.acks_dropped[DropReason.QUEUE_FULL] += 1
            self._acks.append((next(self._seq), ack))
            self._wake.notify()

    # ---- lifecycle and accounting -----------------------------------------------------------------------
    def drain(self, timeout_s: float) -> bool:
        """Wait (never on the engine thread: at the end of a run) until both queues are sent; True if they were."""
        with self._wake:
            return self._wake.wait_for(lambda: not (self._windows or self._acks or self._in_flight), timeout_s)

    def close(self) -> None:
        """Stop the threads; what is still queued is counted as dropped (CLOSED), never forgotten."""
        self._closing.set()
        with self._wake:
            self._wake.notify_all()
        self._sender.join(timeout=self.send_timeout_s + 5.0)
        self._hang_up()
        with self._lock:
            self.dropped[DropReason.CLOSED] += len(self._windows)
            self.acks_dropped[DropReason.CLOSED] += len(self._acks)
            self._windows.clear()
            self._acks.clear()
            self.state = LinkState.CLOSED

    def stats(self) -> dict[str, Any]:
        """One consistent snapshot: produced == sent + dropped + queued + in_flight (windows and acks alike)."""
        with self._lock:
            c = self.counts
            flight = self._in_flight[1] if self._in_flight is not None else None
            return {"state": self.state.value, "produced": c["produced"], "sent": c["sent"],
                    "dropped": {r.value: n for r, n in self.dropped.items()}, "queued": len(self._windows),
                    "in_flight": int(isinstance(flight, Telemetry)), "acks_produced": c["acks_produced"],
                    "acks_sent": c["acks_sent"], "acks_dropped": {r.value: n for r, n in self.acks_dropped.items()},
                    "acks_queued": len(self._acks), "acks_in_flight": int(isinstance(flight, PlanAck)),
                    "plans_received": c["plans_received"], "plans_handed_out": c["plans_handed_out"],
                    "bad_frames": c["bad_frames"], "connects": c["connects"],
                    "connect_failures": c["connect_failures"], "disconnects": c["disconnects"],
                    "send_failures": c["send_failures"], "engine_thread_io": c["engine_thread_io"],
                    "max_queued_windows": self._max_windows, "last_error": self.last_error}

    # ---- the link's own threads -------------------------------------------------------------------------
    def _io(self) -> None:
        """Called before every socket operation: counts one made from a thread that is not the link's own."""
        if threading.get_ident() not in self._io_threads:
            with self._lock:
                self.counts["engine_thread_io"] += 1

    def _send_loop(self) -> None:
        self._io_threads.add(threading.get_ident())
        while not self._closing.is_set():
            sock = self._sock
            if sock is None:
                if not self._open():
                    self._closing.wait(self._backoff.next_delay_s())
                continue
            entry = self._take()
            if entry is None:
                continue
            item = entry[1]
            try:
                data = encode_frame(item, self.max_frame_bytes)
            except FrameError as exc:
                self._settle(item, sent=False, reason=DropReason.TOO_LARGE, error=str(exc))
                continue
            try:
                sock.sendall(data)
            except OSError as exc:  # timeout (a slow sidecar), reset, closed by the reader: reconnect
                self._requeue(entry, exc)
                self._hang_up(sock)
                continue
            self._settle(item, sent=True)

    def _open(self) -> bool:
        try:
            self._io()
            sock = _Guarded(self._connect(self.socket_path, self.send_timeout_s), self._io)
            hello = PlanRequest(agent_id=self.agent_id, rank=self.rank, since_version=self._handed_version)
            sock.sendall(encode_frame(self.registration, self.max_frame_bytes)
                         + encode_frame(hello, self.max_frame_bytes))
        except (OSError, FrameError) as exc:
            with self._lock:
                self.counts["connect_failures"] += 1
                self.last_error = f"connect {self.socket_path}: {exc}"
            return False
        self._backoff.reset()
        with self._lock:
            self._sock = sock
            self.counts["connects"] += 1
            self.state = LinkState.CONNECTED
        threading.Thread(target=self._read_loop, args=(sock,), name="tierplan-link-reader", daemon=True).start()
        return True

    def _take(self) -> tuple[int, Telemetry | PlanAck] | None:
        """The next frame to send: the older of the two queues' heads (arrival order, as they were made)."""
        with self._wake:
            self._wake.wait_for(lambda: self._acks or self._windows or self._closing.is_set()
                                or self._sock is None, timeout=0.5)
            if self._closing.is_set() or self._sock is None:
                return None
            if not (self._acks or self._windows):
                return None
            use_ack = bool(self._acks) and (not self._windows or self._acks[0][0] < self._windows[0][0])
            self._in_flight = (self._acks if use_ack else self._windows).popleft()  # type: ignore[assignment]
            return self._in_flight

    def _settle(self, item: Telemetry | PlanAck, sent: bool, reason: DropReason | None = None,
                error: str = "") -> None:
        with self._wake:
            self._in_flight = None
            is_ack = isinstance(item, PlanAck)
            if sent:
                self.counts["acks_sent" if is_ack else "sent"] += 1
            else:
                (self.acks_dropped if is_ack else self.dropped)[reason or DropReason.TOO_LARGE] += 1
                self.last_error = error
            self._wake.notify_all()

    def _requeue(self, entry: tuple[int, Telemetry | PlanAck], exc: OSError) -> None:
        with self._wake:
            self._in_flight = None
            self.counts["send_failures"] += 1
            self.last_error = f"send to {self.socket_path}: {exc}"
            queue, bound, drops = ((self._acks, self._max_acks, self.acks_dropped) if isinstance(entry[1], PlanAck)
                                   else (self._windows, self._max_windows, self.dropped))
            if len(queue) >= bound:  # newer entries filled the queue meanwhile: this one is now the oldest
                drops[DropReason.QUEUE_FULL] += 1
            else:
                queue.appendleft(entry)  # type: ignore[arg-type]
            self._wake.notify_all()

    def _hang_up(self, sock: _Guarded | None = None) -> None:
        """Drop the connection `sock` (or whichever is open); the sender reconnects."""
        with self._wake:
            if self._sock is None or (sock is not None and sock is not self._sock):
                return
            sock, self._sock = self._sock, None
            self.counts["disconnects"] += 1
            if self.state is not LinkState.CLOSED:
                self.state = LinkState.CONNECTING
            self._wake.notify_all()
        with contextlib.suppress(OSError):  # already reset by the peer
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    def _read_loop(self, sock: _Guarded) -> None:
        self._io_threads.add(threading.get_ident())
        decoder = FrameDecoder(self.max_frame_bytes)
        try:
            while not self._closing.is_set():
                try:
                    data = sock.recv(RECV_BYTES)
                except TimeoutError:
                    continue  # an idle sidecar: the timeout is for sends, a quiet read is fine
                except OSError:
                    break
                if not data:
                    break
                for frame in decoder.feed(data):
                    if isinstance(frame, FrameError) or frame.type is not FrameType.PLAN:
                        with self._lock:
                            self.counts["bad_frames"] += 1
                            self.last_error = (str(frame) if isinstance(frame, FrameError)
                                               else f"unexpected {frame.type.value} frame from the sidecar")
                        if isinstance(frame, FrameError) and frame.fatal:
                            return
                        continue
                    self._offer(frame.body)
        finally:
            self._io_threads.discard(threading.get_ident())
            self._hang_up(sock)

    def _offer(self, plan: Plan) -> None:
        with self._lock:
            self.counts["plans_received"] += 1
            if self._latest is None or plan.version > self._latest.version:
                self._latest = plan


class _Guarded:
    """The link's socket: every operation first reports to the guard (`ServiceLink._io`), whoever calls it."""

    def __init__(self, sock: socket.socket, on_io: Callable[[], None]) -> None:
        self._sock, self._on_io = sock, on_io

    def sendall(self, data: bytes) -> None:
        self._on_io()
        self._sock.sendall(data)

    def recv(self, num_bytes: int) -> bytes:
        self._on_io()
        return self._sock.recv(num_bytes)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)  # from any thread: closing never waits

    def close(self) -> None:
        self._sock.close()


def _connect_unix(path: str, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock
