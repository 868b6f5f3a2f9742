"""A real `tierplan sidecar` process SIGKILLed under a producing ServiceLink: every call keeps returning, the
link queues (bounded, dropping the oldest with a count), reconnects to the sidecar that replaces it on the
same (stale) socket path, and delivers what it held; the new sidecar's metrics count exactly those windows."""

from __future__ import annotations

from pathlib import Path

from tests.agent.sidecar.helpers import balanced_link, registration, telemetry, wait_until
from tests.agent.sidecar.procs import kill, scrape, start_sidecar, stop, total
from tierplan.agent.service_link import LinkState, ServiceLink
from tierplan.agent.sidecar_backoff import Backoff
from tierplan.api.stack import free_port


def test_a_killed_sidecar_costs_the_engine_nothing_and_its_successor_gets_the_queue(tmp_path: Path) -> None:
    sock, dead_service = str(tmp_path / "k.sock"), f"http://127.0.0.1:{free_port()}"  # nobody serves there
    first, _ = start_sidecar(dead_service, sock, "tok", "--backoff-cap-s", "0.2")
    link = ServiceLink(sock, registration(), max_queued_windows=30, reconnect=Backoff(0.01, 0.1))
    second = None
    try:
        for seq in range(10):
            link.sync_from(telemetry(seq))
        wait_until(lambda: link.stats()["sent"] == 10, "the first sidecar took 10 windows")
        kill(first)
        wait_until(lambda: link.stats()["state"] == LinkState.CONNECTING, "the link saw the sidecar die")
        for seq in range(10, 60):  # 50 more while nobody listens: 30 kept, the 20 oldest dropped
            link.sync_from(telemetry(seq))
            assert link.stats()["queued"] <= 30 and balanced_link(link.stats())
        st = link.stats()
        assert st["sent"] == 10 and st["queued"] == 30 and st["dropped"] == {"queue_full": 20}
        second, port = start_sidecar(dead_service, sock, "tok", "--backoff-cap-s", "0.2")
        wait_until(lambda: link.stats()["sent"] == 40, "the link reconnected and sent what it held")
        wait_until(lambda: total(scrape(port), "tierplan_sidecar_windows_received_total") == 30,
                   "the new sidecar counted the 30 windows")
        st = link.stats()
        # >= 2: a reconnect can land in the dying sidecar's listen backlog before the kernel closes it
        assert st["connects"] >= 2 and st["engine_thread_io"] == 0 and balanced_link(st)
        m = scrape(port)
        assert total(m, "tierplan_sidecar_ipc_frames_total", type="AgentRegistration") == 1  # told who it is again
        assert total(m, "tierplan_sidecar_fail_static") == 1  # its service is unreachable too: counted there
    finally:
        link.close()
        kill(first)
        if second is not None:
            stop(second)
