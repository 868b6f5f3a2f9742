"""The controller service's Prometheus metrics (`tierplan_*`, units in names), on the app's own registry.

Built once per app by `create_app` (never at import, never on the global registry, so two apps in one test
process do not collide) and served at `/metrics`. The hub and the routes update it; it decides nothing.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Per-request ingest latency buckets (seconds): the target is p99 <= 20 ms for 64 windows.
INGEST_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServiceMetrics:
    """Every metric of the service; `render()` is the /metrics body."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.windows = Counter("tierplan_telemetry_windows", "Telemetry windows received, by result",
                               ["agent_id", "result"], registry=r)
        self.ingest_s = Histogram("tierplan_telemetry_ingest_seconds", "Time to ingest one telemetry batch",
                                  buckets=INGEST_BUCKETS_S, registry=r)
        self.plans_issued = Counter("tierplan_plans_issued", "Plans issued", ["agent_id"], registry=r)
        self.plan_version = Gauge("tierplan_plan_version", "Newest plan version, issued or applied",
                                  ["agent_id", "kind"], registry=r)
        self.plans_rejected = Counter("tierplan_plans_rejected", "Plans an agent rejected, by reason",
                                      ["agent_id", "reason"], registry=r)
        self.plan_conflicts = Counter("tierplan_plan_conflicts", "Plans another service process issued first "
                                      "(the stored plan was adopted)", registry=r)
        self.split_slots = Gauge("tierplan_split_expert_slots", "Expert slots of the newest plan, per layer",
                                 ["agent_id", "layer"], registry=r)
        self.split_kv = Gauge("tierplan_split_kv_blocks", "KV blocks of the newest plan, per tier",
                              ["agent_id", "tier"], registry=r)
        self.hit_rate = Gauge("tierplan_expert_hit_rate", "Expert hit rate over the last planner pass's windows",
                              ["agent_id"],
                              registry=r)
        self.kv_hits = Counter("tierplan_kv_hits", "KV block hits", ["agent_id", "tier"], registry=r)
        self.kv_misses = Counter("tierplan_kv_misses", "KV block misses", ["agent_id", "tier"], registry=r)
        self.stall_s = Counter("tierplan_stall_seconds", "Engine stall time, by cause", ["agent_id", "cause"],
                               registry=r)
        self.link_bytes = Counter("tierplan_link_bytes", "Bytes moved per link", ["agent_id", "link"], registry=r)
        self.fallbacks = Counter("tierplan_fallbacks", "Fallbacks the agent took, by name", ["agent_id", "name"],
                                 registry=r)
        self.step_s = Gauge("tierplan_step_seconds", "Engine step time of the last window", ["agent_id", "quantile"],
                            registry=r)
        self.decision_step_s = Gauge("tierplan_decision_step_seconds", "Step time of the newest decision: the cost "
                                     "model's prediction and the measured mean", ["agent_id", "kind"], registry=r)
        self.http = Counter("tierplan_http_requests", "HTTP requests by route, method and status",
                            ["route", "method", "status"], registry=r)
        self.policy_version = Gauge("tierplan_policy_version", "Current policy version per group", ["group"],
                                    registry=r)
        self.planner_errors = Counter("tierplan_planner_errors", "Planner passes that failed for an agent, by "
                                      "exception type", ["agent_id", "kind"], registry=r)
        self.planner_pass_s = Histogram("tierplan_planner_pass_seconds", "Time of one planner pass over all agents",
                                        buckets=INGEST_BUCKETS_S, registry=r)
        self.windows_skipped = Counter("tierplan_planner_windows_skipped", "Queued windows the planner counted "
                                       "but did not learn from (more than it learns from per pass)", ["agent_id"],
                                       registry=r)
        self.shadow_promotions = Counter("tierplan_shadow_promotions", "Shadow curve sources promoted",
                                         ["agent_id"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
