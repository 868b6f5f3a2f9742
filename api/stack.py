"""The controller service and a sidecar as real child processes of this one: `tierplan demo`, `tierplan bench
api` and the system tests start them here.

Runs in the user's process (the composition root). Each child is `python -m tierplan.api.cli serve|sidecar ...` with its
output in a log file (never a pipe nobody reads: a chatty child would block on a full pipe), bound to 127.0.0.1
on a free port; readiness is polled with a deadline, and a child that dies first raises `StackError` with its
log tail. Every child is stopped when its block ends (SIGTERM, then SIGKILL after a grace period), on error
too. It never decides or changes a plan.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

LISTENING = "sidecar: agents on"  # what `tierplan sidecar` prints once its socket and /metrics listen


class StackError(RuntimeError):
    """A child did not start or came up unhealthy (its log tail is in the message)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str, status: int = 200) -> Callable[[], bool]:
    """A probe: `url` answers `status` (any connection error is a no)."""
    def probe() -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == status
        except httpx.HTTPError:
            return False

    return probe


class Proc:
    """One `python -m tierplan.api.cli ...` child with its log file."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"{name}.log"
        # The child imports tierplan the way this process does (installed, or PYTHONPATH): same interpreter, same env.
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "tierplan.api.cli", *args], cwd=log_dir, env=full_env,
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else "(no log)"

    def wait_for(self, probe: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not probe():
            if self.proc.poll() is not None:
                raise StackError(f"{self.name} exited with {self.proc.returncode} before {what}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise StackError(f"{self.name}: gave up after {timeout_s:g} s waiting for {what}:\n{self.log_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, as when the host loses the process."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass(frozen=True)
class Service:
    url: str
    proc: Proc


@dataclass(frozen=True)
class SidecarProc:
    socket_path: str
    metrics_url: str
    proc: Proc


def start_service(db_url: str, token: str, log_dir: Path, port: int | None = None,
                  extra_args: Sequence[str] = (), timeout_s: float = 120.0) -> Service:
    """`tierplan serve` on `db_url` with `token` as its bootstrap write token; returns once /readyz is 200."""
    port = port or free_port()
    proc = Proc("service", ["serve", "--db", db_url, "--host", "127.0.0.1", "--port", str(port), *extra_args],
                log_dir, {"TIERPLAN_TOKEN": token})
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for(answers(f"{url}/readyz"), timeout_s, "/readyz to answer 200")
    except BaseException:
        proc.stop()
        raise
    return Service(url, proc)


def start_sidecar(service_url: str, socket_path: Path, token: str, log_dir: Path, metrics_port: int | None = None,
                  extra_args: Sequence[str] = (), timeout_s: float = 120.0) -> SidecarProc:
    """`tierplan sidecar` for agents on `socket_path`, talking to `service_url`; returns once it listens."""
    metrics_port = metrics_port or free_port()
    proc = Proc("sidecar", ["sidecar", "--service", service_url, "--socket", str(socket_path), "--metrics-host",
                            "127.0.0.1", "--metrics-port", str(metrics_port), *extra_args], log_dir,
                {"TIERPLAN_TOKEN": token})
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        # The line it prints once both listen (a socket file alone may be a killed sidecar's leftover).
        proc.wait_for(lambda: LISTENING in proc.log_tail(), timeout_s, "its listening line")
        proc.wait_for(answers(metrics_url), timeout_s, "its /metrics to answer")
    except BaseException:
        proc.stop()
        raise
    return SidecarProc(str(socket_path), metrics_url, proc)


@contextmanager
def service_stack(workdir: Path, token: str, db_url: str | None = None, service_args: Sequence[str] = (),
                  sidecar_args: Sequence[str] = ()) -> Iterator[tuple[Service, SidecarProc]]:
    """The service (SQLite in `workdir` unless `db_url`) and one sidecar beside it, stopped when the block ends."""
    db_url = db_url or f"sqlite:///{workdir / 'tierplan.db'}"
    service = start_service(db_url, token, workdir, extra_args=service_args)
    try:
        sidecar = start_sidecar(service.url, workdir / "agent.sock", token, workdir, extra_args=sidecar_args)
        try:
            yield service, sidecar
        finally:
            sidecar.proc.stop()
    finally:
        service.proc.stop()
