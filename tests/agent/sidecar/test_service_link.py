"""agent/service_link.py never makes the engine wait: with the sidecar missing, stuck (never reading) or
handing back garbage, every call returns at once, the queue stays within its bound, the oldest windows are
dropped and counted, and produced == sent + dropped + queued + in flight at every look. No socket operation
runs on a caller's thread (`engine_thread_io` stays 0; a test proves that counter counts). Plans the sidecar
pushes are handed out newest first, each once."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from tests.agent.sidecar.helpers import ack, balanced_link, plan, registration, telemetry, wait_until
from tierplan.agent.service_link import LinkState, ServiceLink
from tierplan.agent.sidecar_backoff import Backoff
from tierplan.agent.sidecar_ipc import HEADER, FrameDecoder, FrameType, PlanRequest, encode_frame


def fast_reconnect() -> Backoff:
    return Backoff(base_s=0.005, cap_s=0.05)


def test_a_missing_sidecar_costs_the_engine_a_counter(tmp_path: Path) -> None:
    link = ServiceLink(str(tmp_path / "nobody.sock"), registration(), max_queued_windows=50,
                       reconnect=fast_reconnect())
    try:
        for seq in range(500):
            link.sync_from(telemetry(seq))
            assert balanced_link(link.stats()) and link.stats()["queued"] <= 50
        link.record_ack(ack(1))
        assert link.step_next() is None
        wait_until(lambda: link.stats()["connect_failures"] >= 2, "the link retried connecting")
        st = link.stats()
        assert st["produced"] == 500 and st["sent"] == 0 and st["queued"] == 50
        assert st["dropped"] == {"queue_full": 450} and st["engine_thread_io"] == 0
        assert st["state"] == LinkState.CONNECTING and "nobody.sock" in st["last_error"]
    finally:
        link.close()
    st = link.stats()
    assert st["dropped"] == {"queue_full": 450, "closed": 50} and st["acks_dropped"] == {"closed": 1}
    assert balanced_link(st)


def test_the_guard_counts_socket_work_on_a_callers_thread(tmp_path: Path) -> None:
    """The counter the other tests assert to be 0 is live: I/O from this (the engine's) thread shows in it."""
    link = ServiceLink(str(tmp_path / "nobody.sock"), registration(), reconnect=fast_reconnect())
    try:
        link._io()
        assert link.stats()["engine_thread_io"] == 1
    finally:
        link.close()


class StuckSidecar:
    """Accepts connections and never reads them: the kernel buffers fill and the link's sends time out."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            self.conns.append(conn)

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()


def small_buffer_connect(path: str, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)  # a few dozen windows, then stuck
    sock.settimeout(timeout_s)
    sock.connect(path)
    return sock


def test_a_stuck_sidecar_fills_the_queue_not_the_engine(tmp_path: Path) -> None:
    path = str(tmp_path / "stuck.sock")
    stuck = StuckSidecar(path)
    link = ServiceLink(path, registration(), max_queued_windows=64, send_timeout_s=0.05,
                       reconnect=fast_reconnect(), connect=small_buffer_connect)
    try:
        seq = 0
        while link.stats()["send_failures"] < 2:  # produce until the sender has hit the stuck socket twice
            link.sync_from(telemetry(seq))
            seq += 1
            st = link.stats()
            assert st["queued"] <= 64 and balanced_link(st)
            if seq % 64 == 0:
                wait_until(lambda: link.stats()["queued"] < 64 or link.stats()["send_failures"] >= 1,
                           "the sender took a window or hit the stuck socket", limit_s=60)
        st = link.stats()
        assert st["dropped"]["queue_full"] > 0 and st["sent"] > 0 and st["connects"] >= 2
        assert st["engine_thread_io"] == 0 and balanced_link(st)
    finally:
        link.close()
        stuck.close()
    assert balanced_link(link.stats())


class ScriptedSidecar:
    """Takes one connection, records the frames it gets, and sends back what the test scripts."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.frames: list = []
        self.conn: socket.socket | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.conn, _ = self.listener.accept()
        dec = FrameDecoder()
        while data := self.conn.recv(65536):
            self.frames += dec.feed(data)

    def send(self, data: bytes) -> None:
        assert self.conn is not None
        self.conn.sendall(data)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


def test_pushed_plans_are_handed_out_newest_first_each_once_and_garbage_is_counted(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    car = ScriptedSidecar(path)
    link = ServiceLink(path, registration(), reconnect=fast_reconnect())
    try:
        wait_until(lambda: len(car.frames) >= 2, "registration and plan request arrived")
        assert [f.type for f in car.frames[:2]] == [FrameType.AGENT_REGISTRATION, FrameType.PLAN_REQUEST]
        assert car.frames[1].body == PlanRequest(agent_id="agent-t", since_version=0)
        car.send(encode_frame(plan(2)))
        wait_until(lambda: link.stats()["plans_received"] == 1, "plan 2 arrived")
        assert link.step_next() == plan(2) and link.step_next() is None
        bad = b'{"type":"Plan","body":{"version":"x"}}'
        car.send(HEADER.pack(len(bad)) + bad + encode_frame(plan(1)) + encode_frame(ack(1)) + encode_frame(plan(4))
                 + encode_frame(plan(3)))
        wait_until(lambda: link.stats()["plans_received"] == 4, "plans 1, 4, 3 arrived")
        assert link.step_next() == plan(4) and link.step_next() is None  # 1 and 3 are older than what it has
        st = link.stats()
        assert st["bad_frames"] == 2 and st["plans_handed_out"] == 2 and st["state"] == LinkState.CONNECTED
        link.sync_from(telemetry(0))
        link.record_ack(ack(4))
        wait_until(lambda: len(car.frames) == 4, "the window and the ack reached the sidecar")
        assert [f.type for f in car.frames[2:]] == [FrameType.TELEMETRY, FrameType.PLAN_ACK]
        assert link.stats()["engine_thread_io"] == 0
    finally:
        link.close()
        car.close()


def test_a_fatal_frame_from_the_sidecar_drops_the_connection_and_the_link_reconnects(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    car = ScriptedSidecar(path)
    link = ServiceLink(path, registration(), reconnect=fast_reconnect())
    try:
        wait_until(lambda: len(car.frames) >= 2, "first connection")
        car.listener.listen(1)  # room for the reconnect
        car.send(b"HTTP/1.1 200 OK\r\n\r\n")  # not this protocol: out of step
        wait_until(lambda: link.stats()["disconnects"] >= 1, "the link hung up")
        assert link.stats()["bad_frames"] == 1 and "out of step" in link.stats()["last_error"]
    finally:
        link.close()
        car.close()
