"""Building blocks of the tierplan dashboards: the Prometheus datasource reference, template variables, panels.

Used by overview.py and service.py in the user's shell or a test. Pure builders over grafana-foundation-sdk:
they must never reach Grafana or Prometheus. Every query reads the datasource variable `${datasource}`, so one
exported dashboard works against any Prometheus a Grafana has.
"""

from __future__ import annotations

from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.models import common, dashboard

DATASOURCE_VAR = "datasource"
AGENT_VAR = "agent_id"
SIDECAR_VAR = "sidecar"
RATE = "$__rate_interval"  # Grafana's window for rate(): at least four scrape intervals
AGENT = f'agent_id=~"${AGENT_VAR}"'
SIDECAR = f'instance=~"${SIDECAR_VAR}"'

_DS = dashboard.DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")
_FULL_W, _HALF_W, _H = 24, 12, 8


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a panel and the legend each of its series gets."""

    expr: str
    legend: str


def datasource_variable() -> dash_b.DatasourceVariable:
    """`$datasource`: any Prometheus datasource of the Grafana (the provisioned one by default)."""
    return (dash_b.DatasourceVariable(DATASOURCE_VAR).label("Prometheus").type("prometheus")
            .description("The Prometheus that scrapes the tierplan service and its sidecars."))


def label_variable(name: str, label: str, metric: str, what: str) -> dash_b.QueryVariable:
    """A multi-select variable over the values of `label` on `metric`; "All" matches every value (`.*`)."""
    return (dash_b.QueryVariable(name).label(what).datasource(_DS)
            .query({"query": f"label_values({metric}, {label})", "refId": f"{name}-values"})
            .refresh(dashboard.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dashboard.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(dashboard.VariableOption(selected=True, text="All", value="$__all")))


def agent_variable() -> dash_b.QueryVariable:
    """`$agent_id`: the agents the service has received telemetry from."""
    return label_variable(AGENT_VAR, "agent_id", "tierplan_telemetry_windows_total", "Agent")


def sidecar_variable() -> dash_b.QueryVariable:
    """`$sidecar`: the scrape instances of the sidecars (a sidecar serves one agent; its metrics carry no agent_id)."""
    return label_variable(SIDECAR_VAR, "instance", "tierplan_sidecar_queue_depth", "Sidecar")


def row(title: str) -> dash_b.Row:
    """A section header; its panels follow it at the top level (an expanded row in Grafana's JSON model)."""
    return dash_b.Row(title).collapsed(False)


def _targets(panel: timeseries.Panel, queries: list[Query]) -> None:
    for i, q in enumerate(queries):
        panel.with_target(prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
                          .datasource(_DS).range())


def graph(title: str, description: str, unit: str, queries: list[Query], *, stacked: bool = False,
          full_width: bool = False) -> timeseries.Panel:
    """A time series panel; `stacked` draws the series as a stacked area (a split that sums to a budget)."""
    panel = (timeseries.Panel().title(title).description(description).datasource(_DS).unit(unit)
             .height(_H).span(_FULL_W if full_width else _HALF_W).line_width(1)
             .legend(common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True)))
    if stacked:
        panel = panel.fill_opacity(40).stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    else:
        panel = panel.fill_opacity(0)
    _targets(panel, queries)
    return panel


def numbered(board: dash_b.Dashboard, parts: list[dash_b.Row | timeseries.Panel]) -> dash_b.Dashboard:
    """Adds rows and panels in order with ids 1, 2, ... (stable ids keep the exported JSON byte-identical)."""
    for i, part in enumerate(parts, start=1):
        part.id(i)
        board = board.with_row(part) if isinstance(part, dash_b.Row) else board.with_panel(part)
    return board


def new_board(uid: str, title: str, description: str, tags: list[str]) -> dash_b.Dashboard:
    """A dashboard with tierplan's common settings: last 30 minutes, 10 s refresh, shared crosshair, UTC."""
    return (dash_b.Dashboard(title).uid(uid).description(description).tags(["tierplan", *tags])
            .time("now-30m", "now").refresh("10s").timezone("utc").editable()
            .tooltip(dashboard.DashboardCursorSync.CROSSHAIR)
            .timepicker(dash_b.TimePicker().refresh_intervals(["5s", "10s", "30s", "1m", "5m"])))
