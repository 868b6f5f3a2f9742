"""The dashboards as code: the committed files are exactly a fresh export, and every panel speaks the contract.

Static checks over the built JSON (no Prometheus): only the contract's metric names, the template variables
the contract's labels need, the datasource variable everywhere, stable ids and layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierplan.api.cli import app
from tierplan.api.dashboards.contract import names_in, series_names
from tierplan.api.dashboards.export import all_dashboards, exported_files
from tierplan.api.dashboards.queries import expand, panel_queries

REPO = Path(__file__).resolve().parents[3]
COMMITTED = REPO / "dashboards"


def test_committed_files_equal_a_fresh_export(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["dashboards", "export", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    committed = {p.relative_to(COMMITTED): p.read_bytes() for p in COMMITTED.rglob("*")
                 if p.is_file() and p.suffix in (".json", ".yaml")}  # README.md is written by hand
    assert sorted(fresh) == sorted(committed)
    stale = [str(rel) for rel in fresh if fresh[rel] != committed[rel]]
    assert stale == [], "run `tierplan dashboards export` and commit dashboards/"


def test_export_is_deterministic() -> None:
    assert exported_files() == exported_files()


def test_the_two_dashboards_and_their_variables() -> None:
    boards = all_dashboards()
    assert sorted(b["uid"] for b in boards.values()) == ["tierplan-overview", "tierplan-service"]
    for board in boards.values():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert variables["agent_id"]["query"]["query"] == "label_values(tierplan_telemetry_windows_total, agent_id)"
        assert variables["agent_id"]["allValue"] == ".*"


@pytest.mark.parametrize("stem", ["tierplan-overview", "tierplan-service"])
def test_every_panel_query_uses_only_contract_metrics(stem: str) -> None:
    known = series_names()
    queries = panel_queries(all_dashboards()[stem])
    assert queries
    for q in queries:
        names = names_in(q.expr)
        assert names, q.where
        assert [n for n in names if n not in known] == [], q.where


def test_the_dashboards_cover_the_issue_panels() -> None:
    titles = {q.panel_title for b in all_dashboards().values() for q in panel_queries(b)}
    assert {"Expert slots per layer", "KV blocks per tier", "Expert hit rate", "Stalls by cause", "Link traffic",
            "Plan versions issued / applied", "Rejected plans by reason", "Fallbacks by name",
            "Telemetry windows/s", "Ingest latency", "HTTP requests by status", "Sidecar queue depth",
            "Windows sent / dropped", "Fail-static", "Retries and service errors"} <= titles
    read = {n for b in all_dashboards().values() for q in panel_queries(b) for n in names_in(q.expr)}
    unused = {spec.name for spec in series_names().values()} - {series_names()[n].name for n in read}
    assert unused == set()


def test_panels_read_the_datasource_variable_and_have_unique_ids() -> None:
    for board in all_dashboards().values():
        ids = [p["id"] for p in board["panels"]]
        assert ids == list(range(1, len(ids) + 1))
        for panel in board["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_agent_filtered_panels_filter_on_the_agent() -> None:
    by_agent = {n for spec in series_names().values() if "agent_id" in spec.labels for n in [spec.name]}
    for board in all_dashboards().values():
        for q in panel_queries(board):
            if any(series_names()[n].name in by_agent for n in names_in(q.expr)):
                assert 'agent_id=~"$agent_id"' in q.expr, q.where


def test_expand_fills_variables_and_names_a_missing_one() -> None:
    assert expand('rate(m{a=~"$agent_id"}[$__rate_interval])', {"agent_id": "x", "__rate_interval": "5s"}) == (
        'rate(m{a=~"x"}[5s])')
    assert expand("${agent_id:regex}", {"agent_id": "y"}) == "y"
    with pytest.raises(KeyError, match=r"\$sidecar"):
        expand('m{instance=~"$sidecar"}', {})


def test_provisioning_points_at_the_datasource_the_dashboards_expect() -> None:
    ds = (COMMITTED / "provisioning/datasources/prometheus.yaml").read_text()
    assert "type: prometheus" in ds and "uid: tierplan-prometheus" in ds
    provider = (COMMITTED / "provisioning/dashboards/tierplan.yaml").read_text()
    assert "type: file" in provider and "folder: tierplan" in provider
    assert json.loads((COMMITTED / "tierplan-overview.json").read_text())["schemaVersion"] >= 39


def test_export_into_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_text("x")
    result = CliRunner().invoke(app, ["dashboards", "export", "--out", str(target)])
    assert result.exit_code == 2
    assert "error: --out" in result.output and "expected a folder" in result.output
    assert target.read_text() == "x"


@pytest.mark.parametrize("path", sorted(COMMITTED.glob("*.json")), ids=lambda p: p.name)
def test_committed_json_round_trips_through_the_sdk_model(path: Path) -> None:
    """What Grafana 11.6's schema (as the SDK models it) reads back is exactly what is committed: no field the
    schema does not know, none lost."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    data = json.loads(path.read_text())
    assert json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder)) == data


def test_variable_queries_are_listed() -> None:
    from tierplan.api.dashboards.queries import variable_queries

    assert variable_queries(all_dashboards()["tierplan-service"]) == [
        ("agent_id", "tierplan_telemetry_windows_total", "agent_id"),
        ("sidecar", "tierplan_sidecar_queue_depth", "instance")]
