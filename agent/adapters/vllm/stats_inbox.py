"""vLLM's own scheduler and cache stats, from the stat logger (API server process) to the rank's agent
(engine-core process), over one unix datagram socket.

The datagram is controller.protocol_service's `EngineStats` (JSON; unknown fields refused): counts since the
sender's previous datagram, plus the GPU KV blocks in use now. `StatsInbox` (engine-core process, its own daemon
thread) binds the socket and hands each valid datagram to `on_stats`; a malformed one is counted in `bad`.
`send_stats` (stat logger) never blocks: the socket is non-blocking and a datagram nobody receives (no agent
yet, a full buffer) is dropped and counted by the caller. Datagrams keep the message whole or not at all, so
a reader never sees half a message. Nothing here touches the engine.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from tierplan.controller.protocol_service import EngineStats

MAX_DATAGRAM_BYTES = 4096


def send_stats(sock: socket.socket, path: str, stats: EngineStats) -> None:
    """One datagram to `path`; OSError (no receiver, full buffer) is the caller's to count."""
    sock.sendto(stats.model_dump_json().encode(), path)


def stats_socket() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    return sock


class StatsInbox:
    def __init__(self, path: str, on_stats: Callable[[int, int, int], None]) -> None:
        self.path, self.on_stats = path, on_stats
        self.received = 0
        self.bad = 0
        self._closing = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(FileNotFoundError):
            Path(path).unlink()  # a previous engine's leftover: datagram sockets have no listener to ask
        self._sock.bind(path)
        self._sock.settimeout(0.5)
        self._thread = threading.Thread(target=self._run, name="tierplan-vllm-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM_BYTES)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                st = EngineStats.model_validate_json(data)
            except ValidationError:
                self.bad += 1
                continue
            self.received += 1
            self.on_stats(st.gpu_hit_blocks, st.gpu_miss_blocks, st.gpu_blocks)

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=2.0)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
