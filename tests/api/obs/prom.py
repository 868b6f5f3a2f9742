"""A throwaway Prometheus server for tests: the distribution's `prometheus` binary on a free port.

Runs in the pytest process (the server is a child process). Writes a scrape config for the targets it is
given (fast scrape interval), keeps its data in the test's tmp dir, waits until it is ready and every target
is up, answers PromQL through the HTTP API, and is stopped on teardown. It never uses the system service,
its config or its data, and never binds anything but 127.0.0.1.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tierplan.api.stack import free_port

T = TypeVar("T")


class PrometheusError(Exception):
    """Prometheus did not start, a target did not come up, or a query was refused (the reason included)."""


@dataclass(frozen=True)
class ScrapeJob:
    """One scrape job: its name (the `job` label) and `host:port` targets."""

    name: str
    targets: tuple[str, ...]
    metrics_path: str = "/metrics"


def prometheus_binary() -> str | None:
    """The distribution's prometheus binary, or None when it is not installed."""
    return shutil.which("prometheus") or (p if Path(p := "/usr/bin/prometheus").exists() else None)


def scrape_config(jobs: Sequence[ScrapeJob], interval_s: float) -> str:
    """prometheus.yml for `jobs` (YAML by hand: the format is fixed and tiny, no YAML library needed)."""
    ms = max(100, int(interval_s * 1000))
    lines = ["global:", f"  scrape_interval: {ms}ms", f"  scrape_timeout: {ms}ms", f"  evaluation_interval: {ms}ms",
             "scrape_configs:"]
    for job in jobs:
        targets = ", ".join(f"'{t}'" for t in job.targets)
        lines += [f"  - job_name: '{job.name}'", f"    metrics_path: '{job.metrics_path}'",
                  "    static_configs:", f"      - targets: [{targets}]"]
    return "\n".join(lines) + "\n"


class PrometheusServer:
    """One Prometheus child process; `start`, then `wait_targets_up`, `query`, `wait_for`; `stop` on teardown."""

    def __init__(self, workdir: Path, jobs: Sequence[ScrapeJob], scrape_interval_s: float = 0.5,
                 binary: str | None = None) -> None:
        self.workdir = workdir
        self.jobs = list(jobs)
        self.scrape_interval_s = scrape_interval_s
        self.binary = binary or prometheus_binary() or "prometheus"
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        config = self.workdir / "prometheus.yml"
        config.write_text(scrape_config(self.jobs, self.scrape_interval_s))
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        self.port = free_port()
        cmd = [self.binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
               f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
               "--log.level=warn"]
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        self._poll(lambda: self._ready(), timeout_s, "Prometheus to answer /-/ready")

    def _ready(self) -> bool | None:
        if self._proc is not None and self._proc.poll() is not None:
            raise PrometheusError(f"prometheus exited with {self._proc.returncode}: {self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2.0).status_code == 200 or None
        except httpx.HTTPError:
            return None

    def log_tail(self, num_chars: int = 2000) -> str:
        return self._log.read_text(errors="replace")[-num_chars:] if self._log.exists() else "(no log)"

    def _poll(self, probe: Callable[[], T | None], timeout_s: float, what: str,
              last: Callable[[], str] = lambda: "") -> T:
        deadline = time.monotonic() + timeout_s
        while True:
            got = probe()
            if got is not None and got is not False:
                return got
            if time.monotonic() > deadline:
                raise PrometheusError(f"gave up waiting {timeout_s:g} s for {what}. {last()} Log: {self.log_tail()}")
            time.sleep(0.1)

    def targets(self) -> list[dict[str, Any]]:
        return self._api("targets", {})["activeTargets"]

    def wait_targets_up(self, timeout_s: float = 30.0) -> None:
        """Until every configured target has been scraped successfully (health "up")."""
        expected = sum(len(j.targets) for j in self.jobs)

        def all_up() -> bool:
            active = self.targets()
            return len(active) == expected and all(t["health"] == "up" for t in active)

        def states() -> str:
            return "; ".join(f"{t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}" for t in self.targets())

        self._poll(all_up, timeout_s, f"{expected} targets up", states)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant PromQL query at now; the result vector (empty: no data). Bad PromQL raises PrometheusError."""
        data = self._api("query", {"query": expr})
        return list(data["result"]) if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def label_values(self, label: str, metric: str) -> list[str]:
        """What Grafana's `label_values(metric, label)` lists (the values of `label` on series of `metric`)."""
        return list(self._api(f"label/{label}/values", {"match[]": metric}))

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Until `expr` returns data (e.g. a metric has been scraped since it appeared)."""
        return self._poll(lambda: self.query(expr) or None, timeout_s, f"data for {expr!r}")

    def _api(self, endpoint: str, params: dict[str, str]) -> Any:
        try:
            resp = httpx.get(f"{self.url}/api/v1/{endpoint}", params=params, timeout=10.0)
            body = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PrometheusError(f"/api/v1/{endpoint} {params}: {exc}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"/api/v1/{endpoint} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
