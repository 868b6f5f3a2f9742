"""Issue 15's Prometheus acceptance: a real Prometheus scrapes the real service and the real sidecar while the
CPU engine and its agent replay real telemetry through them, and every panel query of the committed dashboards
returns data for the replayed agent.

The story: Prometheus starts with a scrape config for both; `tierplan serve` runs on SQLite, `tierplan sidecar`
beside it; the engine replays the bundled workload through a ServiceLink, the service plans, the agent
applies; once Prometheus holds the final counts, each panel query is one test case (its template variables
filled in: `$agent_id` -> the replayed agent, `$sidecar` -> all, `$__rate_interval` -> 1m). A misspelled
metric in a panel fails the check by name (the check can fail).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.obs.prom import PrometheusServer, ScrapeJob, free_port
from tierplan.api.dashboards.check import QueryOutcome, run_panel_queries, variable_values
from tierplan.api.dashboards.queries import panel_queries, variable_queries

AGENT = "obs-e2e-0"
TOKEN = "obs-e2e-write-token"
DASHBOARDS = Path(__file__).resolve().parents[3] / "dashboards"
RATE_WINDOW = "1m"
# Panel queries that cannot return data yet, each with the missing piece; strict, so a fix turns the case into
# a failure until its line here is removed.
KNOWN_GAPS: dict[str, str] = {}  # panel -> why it has no data yet (a strict xfail); empty: every panel has data


def _boards() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))]


def _cases() -> list[Any]:
    cases = []
    for board in _boards():
        for q in panel_queries(board):
            marks = [pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[q.where])] if q.where in KNOWN_GAPS else []
            cases.append(pytest.param(q.where, id=q.where.replace(" ", ""), marks=marks))
    return cases


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, prometheus_bin: str) -> Iterator[dict[str, Any]]:
    from tests.api.obs.replay import replay_through_sidecar
    from tests.api.obs.stack import start_service, start_sidecar

    work = tmp_path_factory.mktemp("obs-e2e")
    sock_dir = Path(tempfile.mkdtemp(prefix="tp-obs-"))  # unix socket paths must stay short
    socket_path = str(sock_dir / "agent.sock")
    svc_port, metrics_port = free_port(), free_port()
    prom = PrometheusServer(work, [ScrapeJob("service", (f"127.0.0.1:{svc_port}",)),
                                   ScrapeJob("sidecar", (f"127.0.0.1:{metrics_port}",))],
                            scrape_interval_s=0.5, binary=prometheus_bin)
    procs = []
    try:
        prom.start()
        procs.append(start_service(work, svc_port, TOKEN))
        procs.append(start_sidecar(work, f"http://127.0.0.1:{svc_port}", socket_path, metrics_port, TOKEN))
        prom.wait_targets_up()
        stats = replay_through_sidecar(socket_path, work / "engine", AGENT)
        windows = stats["loop"]["windows"]
        # Prometheus holds the final counts, scraped twice (rate() over the window needs two samples)
        prom.wait_for(f'sum(tierplan_telemetry_windows_total{{agent_id="{AGENT}",result="accepted"}}) == {windows}')
        prom.wait_for(f"tierplan_sidecar_windows_sent_total >= {windows}")
        prom.wait_for('count_over_time(up{job="sidecar"}[5s]) >= 4')
        outcomes = run_panel_queries(prom.query, _boards(), variable_values(AGENT, RATE_WINDOW))
        yield {"prom": prom, "stats": stats, "outcomes": {o.query.where: o for o in outcomes},
               "metrics_port": metrics_port}
    finally:
        for p in reversed(procs):
            p.stop()
        prom.stop()
        for leftover in sock_dir.iterdir():
            leftover.unlink()
        sock_dir.rmdir()


def test_the_replay_went_through_the_sidecar_and_plans_were_applied(stack: dict[str, Any]) -> None:
    loop, link = stack["stats"]["loop"], stack["stats"]["link"]
    assert loop["windows"] > 0 and loop["applied"] >= 1, loop
    assert link["sent"] == loop["windows"] and link["dropped"] == {} and link["engine_thread_io"] == 0, link
    prom: PrometheusServer = stack["prom"]
    [applied] = prom.query(f'tierplan_plan_version{{agent_id="{AGENT}",kind="applied"}}')
    assert float(applied["value"][1]) >= 1


def test_the_template_variables_list_the_agent_and_the_sidecar(stack: dict[str, Any]) -> None:
    prom: PrometheusServer = stack["prom"]
    seen = {(name, v) for board in _boards() for name, metric, label in variable_queries(board)
            for v in prom.label_values(label, metric)}
    assert ("agent_id", AGENT) in seen
    assert ("sidecar", f"127.0.0.1:{stack['metrics_port']}") in seen


@pytest.mark.parametrize("where", _cases())
def test_every_panel_query_returns_data(stack: dict[str, Any], where: str) -> None:
    outcome: QueryOutcome = stack["outcomes"][where]
    assert outcome.ok, outcome.describe()


def test_a_misspelled_metric_in_a_panel_fails_the_check(stack: dict[str, Any]) -> None:
    boards = [json.loads(json.dumps(b).replace("tierplan_split_kv_blocks", "tierplan_split_kv_block"))
              for b in _boards()]
    outcomes = run_panel_queries(stack["prom"].query, boards, variable_values(AGENT, RATE_WINDOW))
    assert [o.query.panel_title for o in outcomes if not o.ok and o.query.where not in KNOWN_GAPS] == [
        "KV blocks per tier"]
