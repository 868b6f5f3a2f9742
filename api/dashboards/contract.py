"""The metric names of issue 15's service contract: what the service and the sidecar export, by kind and label.

Imported by the dashboard builder (every panel query must use only these names) and by tests (the harness
self-test serves them; the static check compares panel queries against them). Plain data: it must never
register a metric or build a prometheus-client object at import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class MetricKind(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Source(StrEnum):
    SERVICE = "service"
    SIDECAR = "sidecar"


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its full name (counters end in `_total`), kind, labels and which process has it."""

    name: str
    kind: MetricKind
    labels: tuple[str, ...]
    source: Source


def _m(name: str, kind: MetricKind, labels: tuple[str, ...] = (), source: Source = Source.SERVICE) -> MetricSpec:
    return MetricSpec(name, kind, labels, source)


_C, _G, _H = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM
_SIDE = Source.SIDECAR

CONTRACT_METRICS: tuple[MetricSpec, ...] = (
    _m("tierplan_telemetry_windows_total", _C, ("agent_id", "result")),
    _m("tierplan_telemetry_ingest_seconds", _H),
    _m("tierplan_plans_issued_total", _C, ("agent_id",)),
    _m("tierplan_plan_version", _G, ("agent_id", "kind")),
    _m("tierplan_plans_rejected_total", _C, ("agent_id", "reason")),
    _m("tierplan_plan_conflicts_total", _C),
    _m("tierplan_split_expert_slots", _G, ("agent_id", "layer")),
    _m("tierplan_split_kv_blocks", _G, ("agent_id", "tier")),
    _m("tierplan_expert_hit_rate", _G, ("agent_id",)),
    _m("tierplan_kv_hits_total", _C, ("agent_id", "tier")),
    _m("tierplan_kv_misses_total", _C, ("agent_id", "tier")),
    _m("tierplan_stall_seconds_total", _C, ("agent_id", "cause")),
    _m("tierplan_link_bytes_total", _C, ("agent_id", "link")),
    _m("tierplan_fallbacks_total", _C, ("agent_id", "name")),
    _m("tierplan_step_seconds", _G, ("agent_id", "quantile")),
    _m("tierplan_decision_step_seconds", _G, ("agent_id", "kind")),
    _m("tierplan_http_requests_total", _C, ("route", "method", "status")),
    _m("tierplan_policy_version", _G, ("group",)),
    _m("tierplan_sidecar_windows_sent_total", _C, (), _SIDE),
    _m("tierplan_sidecar_windows_dropped_total", _C, ("reason",), _SIDE),
    _m("tierplan_sidecar_queue_depth", _G, (), _SIDE),
    _m("tierplan_sidecar_fail_static", _G, (), _SIDE),
    # Typed gauge (it only goes up): as a prometheus-client Counter its family would be
    # `tierplan_sidecar_fail_static`, the gauge above, and one registry refuses the pair.
    _m("tierplan_sidecar_fail_static_total", _G, ("mode",), _SIDE),
    _m("tierplan_sidecar_service_errors_total", _C, ("kind",), _SIDE),
    _m("tierplan_sidecar_retries_total", _C, (), _SIDE),
    _m("tierplan_sidecar_plan_version", _G, (), _SIDE),
    _m("tierplan_sidecar_post_seconds", _H, (), _SIDE),
    _m("tierplan_sidecar_ipc_frames_total", _C, ("type",), _SIDE),
)

_SERIES_SUFFIXES = {MetricKind.HISTOGRAM: ("_bucket", "_sum", "_count")}
_NAME = re.compile(r"\btierplan_[a-z0-9_]+")


def series_names() -> dict[str, MetricSpec]:
    """Every series name a scrape shows (a histogram's `_bucket`, `_sum`, `_count`) -> the metric it belongs to."""
    out: dict[str, MetricSpec] = {}
    for spec in CONTRACT_METRICS:
        for suffix in _SERIES_SUFFIXES.get(spec.kind, ("",)):
            out[spec.name + suffix] = spec
    return out


def names_in(expr: str) -> list[str]:
    """The `tierplan_*` series names a PromQL expression reads, in order of appearance."""
    return _NAME.findall(expr)
