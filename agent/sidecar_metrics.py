"""The sidecar's Prometheus metrics (`tierplan_sidecar_*`, names from the service contract), on its own registry.

Runs in the sidecar process. Built by `Sidecar` (never at import, never the global registry, so two sidecars in
one test process keep apart) and served on `--metrics-port` by prometheus-client's own HTTP server thread.
Counters only go up; the gauges say the sidecar's state now. It must never block the agent's socket reads.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tierplan.agent.sidecar_client import ErrorKind

POST_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class SidecarMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.windows_received = Counter("tierplan_sidecar_windows_received_total",
                                        "Telemetry windows received from agents over the socket", registry=r)
        self.windows_sent = Counter("tierplan_sidecar_windows_sent_total",
                                    "Telemetry windows the service stored (accepted, or already stored)", registry=r)
        self.windows_dropped = Counter("tierplan_sidecar_windows_dropped_total",
                                       "Telemetry windows that will never reach the service, by reason",
                                       ["reason"], registry=r)
        self.queue_depth = Gauge("tierplan_sidecar_queue_depth", "Telemetry windows waiting to be sent", registry=r)
        self.fail_static = Gauge("tierplan_sidecar_fail_static",
                                 "1 while the service is unreachable and the sidecar runs fail-static", registry=r)
        # Only goes up, but typed gauge: as a Counter its family would be `tierplan_sidecar_fail_static`, the
        # gauge above (the client refuses the clash, a scrape could not tell the two apart). rate() works alike.
        self.fail_static_transitions = Gauge("tierplan_sidecar_fail_static_total",
                                             "Entries into each fail-static mode (monotonic)", ["mode"], registry=r)
        self.service_errors = Counter("tierplan_sidecar_service_errors_total",
                                      "Failed requests to the service, by kind", ["kind"], registry=r)
        self.retries = Counter("tierplan_sidecar_retries_total",
                               "Backoff waits before retrying the service", registry=r)
        self.plan_version = Gauge("tierplan_sidecar_plan_version", "Version of the cached plan (0: none)",
                                  registry=r)
        self.post_seconds = Histogram("tierplan_sidecar_post_seconds", "Duration of one telemetry batch POST",
                                      buckets=POST_BUCKETS_S, registry=r)
        self.ipc_frames = Counter("tierplan_sidecar_ipc_frames_total", "Frames on the agent socket, by type "
                                  "(invalid: frames that did not decode)", ["type"], registry=r)
        self.acks_sent = Counter("tierplan_sidecar_acks_sent_total", "Plan acks the service recorded", registry=r)
        self.acks_dropped = Counter("tierplan_sidecar_acks_dropped_total", "Plan acks never recorded, by reason",
                                    ["reason"], registry=r)
        self.registrations = Counter("tierplan_sidecar_registrations_total",
                                     "Agent registrations the service answered", registry=r)
        # every series exists from the start: a scrape shows 0, not none
        for mode in ("last_good", "safe_static"):
            self.fail_static_transitions.labels(mode=mode)
        for kind in ErrorKind:
            self.service_errors.labels(kind=kind.value)
        for reason in ("queue_full", "shutdown"):  # the reasons that need no answer from the service to happen
            self.windows_dropped.labels(reason=reason)
            self.acks_dropped.labels(reason=reason)

    def serve(self, port: int, host: str = "127.0.0.1") -> WSGIServer:
        """Start the /metrics HTTP server (its own daemon thread); `port` 0 picks a free one (server_port)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
