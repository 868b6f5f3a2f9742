"""The "tierplan overview" dashboard: what the controller decided and what it bought, per agent.

Built in the user's shell (`tierplan dashboards export|push`) or a test; pure builder, no network. Panels: the
HBM split (expert slots per layer, KV blocks per tier) over time, expert and KV hit rates, stalls by cause,
link bytes/s, step times (measured and as the cost model predicted them), plan versions issued and applied,
plans issued, rejected plans by reason, fallbacks by name. Every query uses only the contract's metric names
(api/dashboards/contract.py) and the `$agent_id` variable.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from tierplan.api.dashboards.panels import (
    AGENT,
    RATE,
    Query,
    agent_variable,
    datasource_variable,
    graph,
    new_board,
    numbered,
    row,
)

UID = "tierplan-overview"


def _kv_hit_rate() -> str:
    hits = f"sum by (tier) (rate(tierplan_kv_hits_total{{{AGENT}}}[{RATE}]))"
    misses = f"sum by (tier) (rate(tierplan_kv_misses_total{{{AGENT}}}[{RATE}]))"
    return f"{hits} / ({hits} + {misses})"


def overview_dashboard() -> Dashboard:
    """The overview dashboard's builder (call `.build()` for the model)."""
    board = (new_board(UID, "tierplan overview", "The controller's HBM split, what it bought (hit rates, stalls, "
                       "link traffic, step time) and its plans, per agent.", ["overview"])
             .with_variable(datasource_variable()).with_variable(agent_variable()))
    return numbered(board, [
        row("HBM split"),
        graph("Expert slots per layer", "Expert weight slots the applied plan gives each MoE layer (stacked: the "
              "expert share of the HBM budget).", "short",
              [Query(f"sum by (layer) (tierplan_split_expert_slots{{{AGENT}}})", "layer {{layer}}")], stacked=True),
        graph("KV blocks per tier", "KV cache blocks per tier in the applied plan (gpu = the KV share of HBM).",
              "short", [Query(f"sum by (tier) (tierplan_split_kv_blocks{{{AGENT}}})", "{{tier}}")], stacked=True),
        row("What the split buys"),
        graph("Expert hit rate", "Share of routed experts found resident in HBM, last telemetry window.",
              "percentunit", [Query(f"max by (agent_id) (tierplan_expert_hit_rate{{{AGENT}}})", "{{agent_id}}")]),
        graph("KV hit rate per tier", "KV block lookups served by each tier: hits / (hits + misses).",
              "percentunit", [Query(_kv_hit_rate(), "{{tier}}")]),
        graph("Stalls by cause", "Seconds the engine waited per second of telemetry, by cause (expert miss, KV "
              "miss, both).", "s",
              [Query(f"sum by (cause) (rate(tierplan_stall_seconds_total{{{AGENT}}}[{RATE}]))", "{{cause}}")]),
        graph("Link traffic", "Bytes moved per second on each link (host->device, disk->host, ...).", "Bps",
              [Query(f"sum by (link) (rate(tierplan_link_bytes_total{{{AGENT}}}[{RATE}]))", "{{link}}")]),
        graph("Step time", "Decode step time of the last telemetry window, p50 and p99.", "s",
              [Query(f"max by (agent_id, quantile) (tierplan_step_seconds{{{AGENT}}})", "{{agent_id}} {{quantile}}")]),
        graph("Step time: predicted vs measured", "The cost model's prediction for the newest decision next to the "
              "step time measured once the plan was applied.", "s",
              [Query(f"max by (agent_id, kind) (tierplan_decision_step_seconds{{{AGENT}}})",
                     "{{agent_id}} {{kind}}")]),
        row("Plans"),
        graph("Plan versions issued / applied", "Newest plan version the controller issued and the one the agent "
              "acknowledged as applied; a gap that stays open means plans are not landing.", "none",
              [Query(f"max by (agent_id, kind) (tierplan_plan_version{{{AGENT}}})", "{{agent_id}} {{kind}}")]),
        graph("Plans issued", "Plans issued per minute.", "short",
              [Query(f"60 * sum by (agent_id) (rate(tierplan_plans_issued_total{{{AGENT}}}[{RATE}]))",
                     "{{agent_id}}")]),
        graph("Rejected plans by reason", "Plans the agent refused, by reason code, per rate window.", "short",
              [Query(f"sum by (reason) (increase(tierplan_plans_rejected_total{{{AGENT}}}[{RATE}]))", "{{reason}}")]),
        graph("Fallbacks by name", "Fallbacks the agent took (every one is counted), per rate window.", "short",
              [Query(f"sum by (name) (increase(tierplan_fallbacks_total{{{AGENT}}}[{RATE}]))", "{{name}}")]),
    ])
