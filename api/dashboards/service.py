"""The "tierplan service" dashboard: is the control plane healthy — ingest, HTTP, and the sidecars' links to it.

Built in the user's shell (`tierplan dashboards export|push`) or a test; pure builder, no network. Panels:
telemetry windows/s (accepted, rejected), ingest latency p50/p99, HTTP requests by status and by route, plan
conflicts between service processes, policy versions; per sidecar: queue depth, windows sent and dropped,
fail-static state and entries, retries and service errors, POST latency p99, plan version, IPC frames. Every
query uses only the contract's metric names (api/dashboards/contract.py).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from tierplan.api.dashboards.panels import (
    AGENT,
    RATE,
    SIDECAR,
    Query,
    agent_variable,
    datasource_variable,
    graph,
    new_board,
    numbered,
    row,
    sidecar_variable,
)

UID = "tierplan-service"


def _quantile(q: float, metric: str, by: str = "", match: str = "") -> str:
    labels = ", ".join(["le", *([by] if by else [])])
    selector = f"{{{match}}}" if match else ""
    return f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket{selector}[{RATE}])))"


def service_dashboard() -> Dashboard:
    """The service dashboard's builder (call `.build()` for the model)."""
    board = (new_board(UID, "tierplan service", "Health of the controller service (telemetry ingest, HTTP, plan "
                       "conflicts) and of the sidecars beside the inference servers.", ["service"])
             .with_variable(datasource_variable()).with_variable(agent_variable())
             .with_variable(sidecar_variable()))
    return numbered(board, [
        row("Service"),
        graph("Telemetry windows/s", "Windows ingested per second, accepted and rejected (a rejected window "
              "carries a reason code in the POST's answer).", "short",
              [Query(f"sum by (result) (rate(tierplan_telemetry_windows_total{{{AGENT}}}[{RATE}]))", "{{result}}")]),
        graph("Ingest latency", "Time to handle one POST /v1/telemetry (validate, store, feed the controller).",
              "s", [Query(_quantile(0.99, "tierplan_telemetry_ingest_seconds"), "p99"),
                    Query(_quantile(0.5, "tierplan_telemetry_ingest_seconds"), "p50")]),
        graph("HTTP requests by status", "Requests per second by status code (4xx: a client's bad request, "
              "never expected: 5xx).", "reqps",
              [Query(f"sum by (status) (rate(tierplan_http_requests_total[{RATE}]))", "{{status}}")]),
        graph("HTTP requests by route", "Requests per second by route and method.", "reqps",
              [Query(f"sum by (route, method) (rate(tierplan_http_requests_total[{RATE}]))", "{{method}} {{route}}")]),
        graph("Plan conflicts", "Plans another service process issued first (this one adopted the stored plan), "
              "per rate window.", "short",
              [Query(f"sum(increase(tierplan_plan_conflicts_total[{RATE}]))", "conflicts")]),
        graph("Policy versions", "Current policy version per agent group (each change is recorded with who and "
              "why).", "none", [Query("max by (group) (tierplan_policy_version)", "{{group}}")]),
        row("Sidecars"),
        graph("Sidecar queue depth", "Telemetry windows waiting in the sidecar's bounded queue.", "short",
              [Query(f"max by (instance) (tierplan_sidecar_queue_depth{{{SIDECAR}}})", "{{instance}}")]),
        graph("Windows sent / dropped", "Windows per second the sidecar posted, and dropped by reason (a full "
              "queue drops the oldest; every drop is counted).", "short",
              [Query(f"sum by (instance) (rate(tierplan_sidecar_windows_sent_total{{{SIDECAR}}}[{RATE}]))",
                     "sent {{instance}}"),
               Query(f"sum by (reason) (rate(tierplan_sidecar_windows_dropped_total{{{SIDECAR}}}[{RATE}]))",
                     "dropped: {{reason}}")]),
        graph("Fail-static", "1 while the sidecar runs without the service (last good plan, then the safe static "
              "plan); entries per rate window by mode.", "short",
              [Query(f"max by (instance) (tierplan_sidecar_fail_static{{{SIDECAR}}})", "fail-static {{instance}}"),
               Query(f"sum by (mode) (increase(tierplan_sidecar_fail_static_total{{{SIDECAR}}}[{RATE}]))",
                     "entered: {{mode}}")]),
        graph("Retries and service errors", "Retries (exponential backoff, full jitter) and errors talking to the "
              "service by kind, per second.", "short",
              [Query(f"sum by (instance) (rate(tierplan_sidecar_retries_total{{{SIDECAR}}}[{RATE}]))",
                     "retries {{instance}}"),
               Query(f"sum by (kind) (rate(tierplan_sidecar_service_errors_total{{{SIDECAR}}}[{RATE}]))",
                     "error: {{kind}}")]),
        graph("Sidecar POST latency", "p99 time of the sidecar's requests to the service.", "s",
              [Query(_quantile(0.99, "tierplan_sidecar_post_seconds", "instance", SIDECAR), "p99 {{instance}}")]),
        graph("Sidecar plan version", "Newest plan version the sidecar holds for its engine.", "none",
              [Query(f"max by (instance) (tierplan_sidecar_plan_version{{{SIDECAR}}})", "{{instance}}")]),
        graph("IPC frames", "Frames per second on the engine <-> sidecar socket, by message type.", "short",
              [Query(f"sum by (type) (rate(tierplan_sidecar_ipc_frames_total{{{SIDECAR}}}[{RATE}]))", "{{type}}")],
              full_width=True),
    ])
