"""Real processes for the sidecar's system tests: `tierplan serve` (killable, restartable on the same port and
database) and `tierplan sidecar`, both started by api/stack.py (logs in a temporary folder), plus a Prometheus
text scrape. Readiness is polled; no test asserts time."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tierplan.api import stack
from tierplan.api.stack import Proc


def start_service(db_url: str, port: int, token: str, log_dir: Path) -> Proc:
    """A new log folder under `log_dir` per start: a restarted service keeps its predecessor's log."""
    logs = Path(tempfile.mkdtemp(prefix="serve-", dir=log_dir))
    return stack.start_service(db_url, token, logs, port=port, extra_args=("--plan-interval-s", "0.1")).proc


def start_sidecar(url: str, socket_path: str, token: str, *args: str) -> tuple[Proc, int]:
    """The sidecar process and its metrics port; its log in a new folder beside the socket."""
    port = stack.free_port()
    logs = Path(tempfile.mkdtemp(prefix="sidecar-", dir=Path(socket_path).parent))
    car = stack.start_sidecar(url, Path(socket_path), token, logs, port, extra_args=args)
    return car.proc, port


def kill(proc: Proc) -> None:
    """SIGKILL: no shutdown handler runs, as when the host loses the process."""
    proc.kill()


def stop(proc: Proc) -> str:
    """SIGTERM and wait; the process's output (the sidecar prints its accounting there)."""
    proc.stop(grace_s=30.0)
    return proc.log_tail()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page, keyed by (name, sorted labels)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))
