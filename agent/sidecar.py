"""The sidecar process beside an inference server: agents' unix socket in, the controller service over HTTP.

`Sidecar` composes the pieces (`tierplan sidecar` runs one; tests run one in process or as a subprocess):
the agent socket (`AgentServer`: length-prefixed JSON frames, agent/sidecar_ipc.py), the uplink thread
(`Uplink`: registration, batched telemetry, plan polling with ETag/since_version, acks, fail-static,
backoff with full jitter, bounded queues), and the `/metrics` server on its own registry. Plans the uplink
pulls are pushed to the agents' connections; an agent that connects later asks for the cached one. Settings
come in through the constructor (built in the CLI's `main`), nothing at import. It must never sit on an
engine's hot path: the agent's `ServiceLink` queues for it and does not wait for it.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tierplan.agent.sidecar_client import ServiceClient
from tierplan.agent.sidecar_metrics import SidecarMetrics
from tierplan.agent.sidecar_server import AgentServer
from tierplan.agent.sidecar_uplink import Uplink, UplinkConfig


def default_socket_path(agent_id: str) -> str:
    """`$XDG_RUNTIME_DIR/tierplan-<agent>.sock`, else the same name in the temp folder."""
    folder = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return str(Path(folder) / f"tierplan-{agent_id}.sock")


@dataclass(frozen=True)
class SidecarSettings:
    service_url: str
    socket_path: str
    token: str | None = None
    metrics_port: int = 9464  # 0: a free port (see Sidecar.metrics_port)
    metrics_host: str = "127.0.0.1"
    plan_ttl_s: float = 30.0
    flush_s: float = 1.0
    poll_s: float = 1.0
    http_timeout_s: float = 5.0
    max_queued_windows: int = 16384
    backoff_base_s: float = 0.2
    backoff_cap_s: float = 10.0


class Sidecar:
    def __init__(self, settings: SidecarSettings, transport: httpx.BaseTransport | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        s = settings
        self.settings = s
        self.metrics = SidecarMetrics()
        self.client = ServiceClient(s.service_url, s.token, s.http_timeout_s, transport)
        config = UplinkConfig(flush_s=s.flush_s, poll_s=s.poll_s, plan_ttl_s=s.plan_ttl_s,
                              max_queued_windows=s.max_queued_windows, backoff_base_s=s.backoff_base_s,
                              backoff_cap_s=s.backoff_cap_s)
        self.uplink = Uplink(self.client, self.metrics, config, clock=clock, rng=rng, push=self._push)
        self.server = AgentServer(s.socket_path, self.uplink, self.metrics)
        self._stop = threading.Event()
        self._uplink_thread = threading.Thread(target=self.uplink.run, args=(self._stop,),
                                               name="tierplan-sidecar-uplink", daemon=True)
        self._metrics_server: Any = None

    @property
    def metrics_port(self) -> int:
        return self._metrics_server.server_port if self._metrics_server is not None else 0

    def start(self) -> None:
        """Listen on the agent socket and the metrics port, start the uplink; OSError if a port/path is taken."""
        if self.settings.metrics_port >= 0:
            self._metrics_server = self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
        try:
            self.server.start()
        except OSError:
            self._close_metrics()
            raise
        self._uplink_thread.start()

    def stop(self, flush_timeout_s: float = 2.0) -> None:
        """Stop taking frames, give the uplink `flush_timeout_s` to send what is queued, then stop it; what is
        left is counted as dropped (`shutdown`)."""
        self.server.close()
        deadline = time.monotonic() + flush_timeout_s
        while time.monotonic() < deadline and self.uplink.stats()["queued"] and self.uplink.fail.mode == "online":
            self.uplink.request_flush()
            time.sleep(0.05)
        self._stop.set()
        self.uplink.stop_waiting()
        if self._uplink_thread.is_alive():
            self._uplink_thread.join(timeout=self.settings.http_timeout_s + 5.0)
        self.uplink.abandon()
        self.client.close()
        self._close_metrics()

    def _close_metrics(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None

    def _push(self, agent_id: str, plan: Any) -> None:
        self.server.push(agent_id, plan)

    def stats(self) -> dict[str, Any]:
        return {**self.uplink.stats(), "connections": self.server.num_connections}
