"""Real processes for the sidecar's system tests: `tierplan serve` (killable, restartable on the same port and
database) and `tierplan sidecar`, plus a Prometheus text scrape. Readiness is polled; no test asserts time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.agent.sidecar.helpers import wait_until

ROOT = Path(__file__).resolve().parents[3]


def _env(token: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TIERPLAN_TOKEN": token}


def start_service(db_url: str, port: int, token: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--db", db_url, "--port", str(port),
                             "--plan-interval-s", "0.1"], env=_env(token), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"tierplan serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, "tierplan serve answers /readyz", limit_s=120)
    return proc


def start_sidecar(url: str, socket_path: str, token: str, *args: str) -> tuple[subprocess.Popen, int]:
    """The sidecar process and its metrics port (from the line it prints when it listens)."""
    proc = subprocess.Popen([sys.executable, "-m", "api.cli", "sidecar", "--service", url, "--socket", socket_path,
                             "--metrics-port", "0", *args], env=_env(token), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("sidecar: agents on"):
        proc.kill()
        raise AssertionError(f"tierplan sidecar did not start: {line!r} {proc.stderr.read()[-2000:]}")
    port = int(line.split("metrics on http://")[1].split("/")[0].rsplit(":", 1)[1])
    return proc, port


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL: no shutdown handler runs, as when the host loses the process."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def stop(proc: subprocess.Popen) -> str:
    """SIGTERM and wait; the process's stdout (the sidecar prints its accounting there)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page, keyed by (name, sorted labels)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))
