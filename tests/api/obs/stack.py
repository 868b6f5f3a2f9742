"""The processes of the end-to-end observability test: `tierplan serve` on SQLite and `tierplan sidecar`, each a
real subprocess (`python -m api.cli ...`) on free ports, with its log in the test's tmp dir.

Test code (the pytest process starts and stops them). Only 127.0.0.1 is bound; every process is stopped on
teardown (SIGTERM, then SIGKILL after a grace period) and its log tail goes into any start-up error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]


class StackError(Exception):
    """A process of the stack did not start or came up unhealthy (its log tail included)."""


class Proc:
    """One `python -m api.cli ...` child with its log; `ready` polls a probe until it holds or the process dies."""

    def __init__(self, name: str, args: list[str], workdir: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.log = name, workdir / f"{name}.log"
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "api.cli", *args], cwd=workdir, env=full_env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else "(no log)"

    def ready(self, probe: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not probe():
            if self.proc.poll() is not None:
                raise StackError(f"{self.name} exited with {self.proc.returncode} before {what}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise StackError(f"{self.name}: gave up after {timeout_s:g} s waiting for {what}:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def answers(url: str, status: int = 200) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == status
        except httpx.HTTPError:
            return False

    return probe


def start_service(workdir: Path, port: int, token: str) -> Proc:
    """`tierplan serve` on a SQLite file in `workdir`, the bootstrap write token from TIERPLAN_TOKEN."""
    db = f"sqlite:///{workdir / 'tierplan.db'}"
    proc = Proc("service", ["serve", "--db", db, "--host", "127.0.0.1", "--port", str(port)], workdir,
                {"TIERPLAN_TOKEN": token})
    proc.ready(answers(f"http://127.0.0.1:{port}/readyz"), 60.0, "/readyz to answer 200")
    return proc


def start_sidecar(workdir: Path, service_url: str, socket_path: str, metrics_port: int, token: str) -> Proc:
    """`tierplan sidecar` beside the engine: its unix socket, short flush and poll intervals, its /metrics."""
    proc = Proc("sidecar", ["sidecar", "--service", service_url, "--socket", socket_path, "--metrics-port",
                            str(metrics_port), "--flush-s", "0.05", "--poll-s", "0.1"], workdir,
                {"TIERPLAN_TOKEN": token})
    proc.ready(answers(f"http://127.0.0.1:{metrics_port}/metrics"), 60.0, "its /metrics to answer")
    proc.ready(lambda: Path(socket_path).exists(), 30.0, f"its socket {socket_path}")
    return proc
