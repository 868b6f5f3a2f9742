"""A stand-in exporter serving every contract metric with one labelled sample, for the Prometheus harness's
self-test only (the real end-to-end test scrapes the real service and sidecar).

Runs in the pytest process (prometheus-client's HTTP server thread, its own registry, 127.0.0.1 only). A
`skip` set leaves metrics out, so a test can show the dashboards check noticing a missing metric.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tierplan.api.dashboards.contract import CONTRACT_METRICS, MetricKind, Source

_LABEL_VALUES = {"result": "accepted", "kind": "issued", "reason": "stale_version", "layer": "0", "tier": "gpu",
                 "cause": "expert_miss", "link": "h2d", "name": "on_demand_load", "quantile": "p50",
                 "route": "/v1/telemetry", "method": "POST", "status": "200", "group": "default",
                 "mode": "last_good", "type": "Telemetry"}


@dataclass
class FakeExporter:
    """One source's metrics on its own port; `tick()` moves every counter and histogram (so rate() sees change)."""

    port: int
    metrics: list[tuple[Any, dict[str, str]]]
    server: Any

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def tick(self) -> None:
        for metric, labels in self.metrics:
            child = metric.labels(**labels) if labels else metric
            if isinstance(metric, Counter):
                child.inc()
            elif isinstance(metric, Histogram):
                child.observe(0.003)
            else:
                child.set(1.0)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve(source: Source, port: int, agent_id: str, skip: Iterable[str] = ()) -> FakeExporter:
    """Starts an exporter of `source`'s contract metrics (minus `skip`) on 127.0.0.1:`port`."""
    registry = CollectorRegistry()
    metrics = []
    for spec in CONTRACT_METRICS:
        if spec.source is not source or spec.name in skip:
            continue
        kind = {MetricKind.COUNTER: Counter, MetricKind.GAUGE: Gauge, MetricKind.HISTOGRAM: Histogram}[spec.kind]
        name = spec.name.removesuffix("_total") if spec.kind is MetricKind.COUNTER else spec.name
        metric = kind(name, f"fake {spec.name}", list(spec.labels), registry=registry)
        labels = {k: (agent_id if k == "agent_id" else _LABEL_VALUES[k]) for k in spec.labels}
        metrics.append((metric, labels))
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    exporter = FakeExporter(port, metrics, server)
    exporter.tick()
    return exporter
