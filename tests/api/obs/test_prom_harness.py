"""The Prometheus harness and the panel-query check, against a stand-in exporter of the contract's metrics.

With every contract metric served, a real Prometheus scrapes both stand-ins and every panel query of the
committed dashboards returns data; a dashboard with a misspelled metric, or the queries of another agent, make
the check fail and name exactly the panels concerned (the check can fail).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.obs.fake_exporter import FakeExporter, serve
from tests.api.obs.prom import PrometheusError, PrometheusServer, ScrapeJob, free_port, scrape_config
from tierplan.api.dashboards.check import failures, run_panel_queries, variable_values
from tierplan.api.dashboards.contract import Source

AGENT = "agent-0.rank0"
DASHBOARDS = Path(__file__).resolve().parents[3] / "dashboards"


def _committed_boards() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))]


def _scraped(prom: PrometheusServer, exporters: list[FakeExporter]) -> None:
    """Ticks the stand-ins until Prometheus holds two samples of every series (what rate() needs)."""
    for _ in range(3):
        for e in exporters:
            e.tick()
        time.sleep(prom.scrape_interval_s * 2)
    prom.wait_for('count_over_time(up{job="service"}[1m]) >= 3')


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory, prometheus_bin: str
              ) -> Iterator[tuple[PrometheusServer, list[FakeExporter]]]:
    exporters = [serve(Source.SERVICE, free_port(), AGENT), serve(Source.SIDECAR, free_port(), AGENT)]
    prom = PrometheusServer(tmp_path_factory.mktemp("prom"), [ScrapeJob("service", (exporters[0].target,)),
                                                              ScrapeJob("sidecar", (exporters[1].target,))],
                            binary=prometheus_bin)
    try:
        prom.start()
        prom.wait_targets_up()
        _scraped(prom, exporters)
        yield prom, exporters
    finally:
        prom.stop()
        for e in exporters:
            e.close()


def test_scrape_config_lists_every_target() -> None:
    text = scrape_config([ScrapeJob("service", ("127.0.0.1:1",)), ScrapeJob("sidecar", ("127.0.0.1:2",))], 0.5)
    assert "scrape_interval: 500ms" in text
    assert "targets: ['127.0.0.1:1']" in text and "job_name: 'sidecar'" in text


def test_every_panel_query_returns_data_from_the_stand_ins(stand_ins) -> None:
    prom, _ = stand_ins
    outcomes = run_panel_queries(prom.query, _committed_boards(), variable_values(AGENT, "5s"))
    assert len(outcomes) >= 25
    assert failures(outcomes) == []


def test_a_query_for_another_agent_finds_nothing(stand_ins) -> None:
    prom, _ = stand_ins
    outcomes = run_panel_queries(prom.query, _committed_boards(), variable_values("someone-else", "5s"))
    empty = {o.query.panel_title for o in outcomes if not o.ok}
    assert {"Expert slots per layer", "Stalls by cause", "Telemetry windows/s"} <= empty


def test_a_misspelled_metric_fails_the_check_by_panel(stand_ins) -> None:
    prom, _ = stand_ins
    boards = [json.loads(json.dumps(b).replace("tierplan_stall_seconds_total", "tierplan_stall_second_total")
                         .replace("tierplan_sidecar_queue_depth{", "tierplan_sidecar_queue_dept{"))
              for b in _committed_boards()]
    outcomes = run_panel_queries(prom.query, boards, variable_values(AGENT, "5s"))
    failed = {o.query.panel_title for o in outcomes if not o.ok}
    assert failed == {"Stalls by cause", "Sidecar queue depth"}


def test_bad_promql_is_an_error_not_empty(stand_ins) -> None:
    prom, _ = stand_ins
    with pytest.raises(PrometheusError, match="bad_data"):
        prom.query("sum by (layer (tierplan_split_expert_slots)")
    board = {"uid": "broken", "panels": [{"title": "typo", "targets": [{"refId": "A", "expr": "rate(x[)"}]}]}
    [outcome] = run_panel_queries(prom.query, [board], variable_values(AGENT, "5s"))
    assert not outcome.ok and "bad_data" in outcome.error


def test_the_check_command_against_the_stand_ins(stand_ins) -> None:
    from typer.testing import CliRunner

    from tierplan.api.cli import app

    prom, _ = stand_ins
    ok = CliRunner().invoke(app, ["dashboards", "check", "--prometheus", prom.url, "--agent-id", AGENT,
                                  "--rate-interval", "5s"])
    assert ok.exit_code == 0, ok.output
    assert "panel queries return data" in ok.output and "no data" not in ok.output
    other = CliRunner().invoke(app, ["dashboards", "check", "--prometheus", prom.url, "--agent-id", "nobody"])
    assert other.exit_code == 1 and "no data: tierplan-overview / 'Expert slots per layer'" in other.output
    down = CliRunner().invoke(app, ["dashboards", "check", "--prometheus", f"http://127.0.0.1:{free_port()}",
                                    "--agent-id", AGENT])
    assert down.exit_code == 2 and "error: --prometheus http://127.0.0.1:" in down.output
