"""The sidecar's unix-socket server: the agents' `ServiceLink`s connect here (sidecar process).

One accept thread, one reader thread per connection. Frames from an agent go to the `Uplink` (registration,
telemetry windows, acks: memory only) or are answered at once (`PlanRequest`: the cached plan, when
fail-static still serves it and it is newer). `push` sends a plan to every connection of its agent (the
uplink thread calls it; a send that fails or times out closes that connection, the agent reconnects). Every
frame is counted by type; a frame that does not decode counts as `invalid` and is skipped, and a fatal one
(out of step) closes that connection only. It must never let one agent's garbage or slowness stop another
agent, the uplink, or the process; and it never talks HTTP.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
from dataclasses import dataclass, field

from tierplan.agent.sidecar_ipc import MAX_FRAME_BYTES, FrameDecoder, FrameError, FrameType, encode_frame
from tierplan.agent.sidecar_metrics import SidecarMetrics
from tierplan.agent.sidecar_uplink import Uplink
from tierplan.controller.protocol import Plan

RECV_BYTES = 1 << 16


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    agent_id: str | None = None
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class SocketInUse(OSError):
    """Another process is listening on the socket path (a second sidecar for the same agent)."""


def _claim_path(path: str) -> None:
    """Remove a stale socket file left by a dead sidecar; refuse a live one or a file that is not a socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketInUse(f"{path} exists and is not a unix socket; expected a free path for the agent socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody answers: stale
        return
    finally:
        probe.close()
    raise SocketInUse(f"{path}: another process is listening there (a second sidecar?)")


class AgentServer:
    def __init__(self, path: str, uplink: Uplink, metrics: SidecarMetrics, send_timeout_s: float = 1.0,
                 max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.path, self.uplink, self.metrics = path, uplink, metrics
        self.send_timeout_s, self.max_frame_bytes = send_timeout_s, max_frame_bytes
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self.num_connections = 0
        self.last_error = ""

    def start(self) -> None:
        _claim_path(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        os.chmod(self.path, 0o600)  # only the inference server's user talks to this sidecar
        listener.listen(16)
        listener.settimeout(0.5)  # so `close` is noticed without a connection
        self._listener = listener
        self._accept_thread = threading.Thread(target=self._accept_loop, name="tierplan-sidecar-accept", daemon=True)
        self._accept_thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept at once
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5.0)
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            self._hang_up(conn)

    def push(self, agent_id: str, plan: Plan) -> int:
        """Send `plan` to every connection of `agent_id`; returns how many got it."""
        data = encode_frame(plan, self.max_frame_bytes)
        with self._lock:
            targets = [c for c in self._conns if c.agent_id == agent_id]
        num_sent = 0
        for conn in targets:
            if self._send(conn, data):
                num_sent += 1
        return num_sent

    def _send(self, conn: _Conn, data: bytes) -> bool:
        try:
            with conn.send_lock:
                conn.sock.sendall(data)
        except OSError as exc:  # a stuck or gone agent: drop it, it reconnects and asks again
            self.last_error = f"push to agent {conn.agent_id}: {exc}"
            self._hang_up(conn)
            return False
        self.metrics.ipc_frames.labels(type=FrameType.PLAN.value).inc()
        return True

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                self.last_error = f"accept: {exc}"
                continue
            sock.settimeout(self.send_timeout_s)
            conn = _Conn(sock)
            with self._lock:
                self._conns.add(conn)
                self.num_connections += 1
            threading.Thread(target=self._read_loop, args=(conn,), name="tierplan-sidecar-conn", daemon=True).start()

    def _read_loop(self, conn: _Conn) -> None:
        decoder = FrameDecoder(self.max_frame_bytes)
        try:
            while not self._stop.is_set():
                try:
                    data = conn.sock.recv(RECV_BYTES)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                for frame in decoder.feed(data):
                    if isinstance(frame, FrameError):
                        self.metrics.ipc_frames.labels(type="invalid").inc()
                        self.last_error = f"agent {conn.agent_id}: {frame}"
                        if frame.fatal:
                            return
                        continue
                    self._handle(conn, frame.type, frame.body)
        finally:
            self._hang_up(conn)

    def _handle(self, conn: _Conn, kind: FrameType, body: object) -> None:
        if kind is not FrameType.PLAN:
            self.metrics.ipc_frames.labels(type=kind.value).inc()
        if kind is FrameType.AGENT_REGISTRATION:
            conn.agent_id = body.agent_id  # type: ignore[attr-defined]
            self.uplink.add_registration(body)  # type: ignore[arg-type]
        elif kind is FrameType.TELEMETRY:
            self.uplink.add_window(body)  # type: ignore[arg-type]
        elif kind is FrameType.PLAN_ACK:
            self.uplink.add_ack(body)  # type: ignore[arg-type]
        elif kind is FrameType.PLAN_REQUEST:
            conn.agent_id = conn.agent_id or body.agent_id  # type: ignore[attr-defined]
            plan = self.uplink.current_plan(body.agent_id, body.since_version)  # type: ignore[attr-defined]
            if plan is not None:
                self._send(conn, encode_frame(plan, self.max_frame_bytes))
        else:  # a Plan sent to the sidecar: plans only flow the other way
            self.metrics.ipc_frames.labels(type="invalid").inc()
            self.last_error = f"agent {conn.agent_id}: sent a {kind.value} frame; plans flow sidecar -> agent only"

    def _hang_up(self, conn: _Conn) -> None:
        with self._lock:
            if conn not in self._conns:
                return
            self._conns.discard(conn)
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
        conn.sock.close()
