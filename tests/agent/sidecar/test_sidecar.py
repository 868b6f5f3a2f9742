"""agent/sidecar.py in process: a ServiceLink and a Sidecar (fake service behind httpx.MockTransport) carry
registration, windows and acks up and plans down; a client sending garbage on the socket is counted and
dropped without disturbing the agent; the metrics port serves the contract's names; a second sidecar on a
live socket path is refused, a stale one is taken over."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from tests.agent.sidecar.helpers import (
    AGENT,
    FakeService,
    ack,
    balanced_link,
    plan,
    registration,
    telemetry,
    wait_until,
)
from tierplan.agent.service_link import ServiceLink
from tierplan.agent.sidecar import Sidecar, SidecarSettings
from tierplan.agent.sidecar_backoff import Backoff
from tierplan.agent.sidecar_ipc import HEADER
from tierplan.agent.sidecar_server import SocketInUse

CONTRACT_NAMES = ("tierplan_sidecar_windows_sent_total", "tierplan_sidecar_windows_dropped_total",
                  "tierplan_sidecar_queue_depth", "tierplan_sidecar_fail_static",
                  "tierplan_sidecar_fail_static_total", "tierplan_sidecar_service_errors_total",
                  "tierplan_sidecar_retries_total", "tierplan_sidecar_plan_version", "tierplan_sidecar_post_seconds",
                  "tierplan_sidecar_ipc_frames_total")


def settings(path: Path, **kw: object) -> SidecarSettings:
    return SidecarSettings(service_url="http://svc", socket_path=str(path), metrics_port=0, flush_s=0.05,
                           poll_s=0.05, **kw)  # type: ignore[arg-type]


def test_windows_up_plans_down_acks_up(tmp_path: Path) -> None:
    svc = FakeService()
    car = Sidecar(settings(tmp_path / "a.sock"), transport=svc.transport())
    car.start()
    link = ServiceLink(str(tmp_path / "a.sock"), registration(), reconnect=Backoff(0.005, 0.05))
    try:
        for seq in range(40):
            link.sync_from(telemetry(seq))
        wait_until(lambda: len(svc.windows) == 40, "all windows reached the service")
        assert svc.registrations == 1
        svc.plans.append(plan(1))
        wait_until(lambda: link.stats()["plans_received"] == 1, "the plan was pushed to the agent")
        assert link.step_next() == plan(1)
        link.record_ack(ack(1))
        wait_until(lambda: len(svc.acks) == 1, "the ack reached the service")
        st, cs = link.stats(), car.stats()
        assert st["sent"] == 40 and balanced_link(st) and st["engine_thread_io"] == 0
        assert cs["received"] == 40 and cs["sent"] == 40 and cs["acks_sent"] == 1 and cs["mode"] == "online"
        text = httpx.get(f"http://127.0.0.1:{car.metrics_port}/metrics").text
        for name in CONTRACT_NAMES:
            assert name in text, name
        assert 'tierplan_sidecar_ipc_frames_total{type="Telemetry"} 40.0' in text
        assert "tierplan_sidecar_plan_version 1.0" in text
    finally:
        link.close()
        car.stop()


def test_garbage_on_the_socket_costs_that_client_only(tmp_path: Path) -> None:
    svc = FakeService()
    car = Sidecar(settings(tmp_path / "g.sock"), transport=svc.transport())
    car.start()
    link = ServiceLink(str(tmp_path / "g.sock"), registration(), reconnect=Backoff(0.005, 0.05))
    try:
        rogue = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        rogue.connect(str(tmp_path / "g.sock"))
        bad = b'{"type":"Telemetry","body":{"agent_id":""}}'
        rogue.sendall(HEADER.pack(len(bad)) + bad + b"\xff" * 64)  # one bad frame, then out of step
        assert rogue.recv(10) == b""  # the sidecar hung up on it
        rogue.close()
        for seq in range(5):
            link.sync_from(telemetry(seq))
        wait_until(lambda: len(svc.windows) == 5, "the real agent's windows still flow")
        get = car.metrics.registry.get_sample_value
        assert get("tierplan_sidecar_ipc_frames_total", {"type": "invalid"}) == 2
    finally:
        link.close()
        car.stop()


def test_a_reconnecting_agent_gets_the_cached_plan(tmp_path: Path) -> None:
    svc = FakeService(plans=[plan(3)])
    car = Sidecar(settings(tmp_path / "c.sock"), transport=svc.transport())
    car.start()
    first = ServiceLink(str(tmp_path / "c.sock"), registration(), reconnect=Backoff(0.005, 0.05))
    try:
        wait_until(lambda: car.stats()["plan_versions"] == {AGENT: 3}, "the sidecar cached plan 3")
        first.close()
        late = ServiceLink(str(tmp_path / "c.sock"), registration(), reconnect=Backoff(0.005, 0.05))
        wait_until(lambda: late.stats()["plans_received"] == 1, "the late agent asked and got it")
        assert late.step_next() == plan(3)
        late.close()
    finally:
        car.stop()


def test_a_live_socket_is_refused_and_a_stale_one_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    car = Sidecar(settings(path), transport=FakeService().transport())
    car.start()
    try:
        with pytest.raises(SocketInUse, match="another process is listening"):
            Sidecar(settings(path), transport=FakeService().transport()).start()
    finally:
        car.stop()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # bound, never listening: what a killed sidecar leaves behind
    stale.close()
    again = Sidecar(settings(path), transport=FakeService(down=True).transport())
    again.start()
    again.uplink.add_window(telemetry(0))  # held for a service that never answers
    again.stop()
    assert again.stats()["dropped"] == {"shutdown": 1} and again.stats()["queued"] == 0
    (tmp_path / "file").write_text("x")
    with pytest.raises(SocketInUse, match="is not a unix socket"):
        Sidecar(settings(tmp_path / "file"), transport=FakeService().transport()).start()
