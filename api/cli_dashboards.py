"""`tierplan dashboards export|push|check`: the Grafana dashboards built as code, written to files, sent to a
Grafana, or checked against a Prometheus (does every panel query return data?).

Runs in the user's shell. The builders are imported inside the commands so `tierplan --help` stays fast. Bad
input or an unreachable / refusing Grafana or Prometheus prints `error: ...` on stderr and exits 2 (no
traceback); `check` exits 1 when a panel query returns no data.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

dashboards_app = typer.Typer(no_args_is_help=True, help="Grafana dashboards built as code (grafana-foundation-sdk).")


def _fail(message: str) -> typer.Exit:
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(2)


@dashboards_app.command("export")
def export_cmd(
    out: Annotated[Path, typer.Option(help="Folder to write the dashboard JSON and provisioning YAML into.")] = Path(
        "dashboards"),
) -> None:
    """Writes every dashboard as JSON plus Grafana's provisioning YAML (the committed dashboards/ is this output)."""
    from tierplan.api.dashboards.export import export

    if out.exists() and not out.is_dir():
        raise _fail(f"--out {out}: is a file; expected a folder (created if missing)")
    try:
        written = export(out)
    except OSError as exc:
        raise _fail(f"--out {out}: cannot write ({exc.strerror or exc})") from None
    for path in written:
        print(path)


@dashboards_app.command("push")
def push_cmd(
    url: Annotated[str, typer.Option(help="Grafana's base URL, e.g. http://localhost:3000.")],
    token: Annotated[str | None, typer.Option(help="Grafana service account token (default: $GRAFANA_TOKEN).",
                                              show_default=False)] = None,
    folder: Annotated[str, typer.Option(help="uid (and title) of the Grafana folder the dashboards go into.")] = (
        "tierplan"),
) -> None:
    """Creates or overwrites every dashboard in a running Grafana (its HTTP API, grafana-client)."""
    from tierplan.api.dashboards.push import PushError, push_dashboards

    token = token if token is not None else os.environ.get("GRAFANA_TOKEN")
    if not token:
        raise _fail("--token missing (and $GRAFANA_TOKEN unset); expected a Grafana service account token")
    try:
        pushed = push_dashboards(url, token, folder)
    except PushError as exc:
        raise _fail(str(exc)) from None
    for item in pushed:
        print(f"{item.uid}: version {item.version} {url.rstrip('/')}{item.url}")


def _prometheus_query(url: str) -> Any:
    import httpx

    client = httpx.Client(base_url=url.rstrip("/"), timeout=10.0)

    def query(expr: str) -> list[dict[str, Any]]:
        body = client.get("/api/v1/query", params={"query": expr}).json()
        if body.get("status") != "success":
            raise ValueError(f"{body.get('errorType')}: {body.get('error')}")
        return list(body["data"]["result"])

    return query


@dashboards_app.command("check")
def check_cmd(
    prometheus: Annotated[str, typer.Option(help="Prometheus base URL, e.g. http://localhost:9090.")],
    agent_id: Annotated[str, typer.Option(help="Agent the panels' $agent_id stands for.")],
    rate_interval: Annotated[str, typer.Option(help="What $__rate_interval stands for (a PromQL duration).")] = "1m",
) -> None:
    """Runs every panel query against a Prometheus; lists those that return no data (exit 1 if any)."""
    import httpx

    from tierplan.api.dashboards.check import failures, run_panel_queries, variable_values
    from tierplan.api.dashboards.export import all_dashboards

    if not prometheus.startswith(("http://", "https://")):
        raise _fail(f"--prometheus {prometheus!r}: expected http(s)://HOST:PORT of a Prometheus server")
    try:
        httpx.get(f"{prometheus.rstrip('/')}/-/ready", timeout=5.0).raise_for_status()
    except httpx.HTTPError as exc:
        raise _fail(f"--prometheus {prometheus}: not ready or unreachable ({exc})") from None
    outcomes = run_panel_queries(_prometheus_query(prometheus), all_dashboards().values(),
                                 variable_values(agent_id, rate_interval))
    bad = failures(outcomes)
    print(f"{len(outcomes) - len(bad)} of {len(outcomes)} panel queries return data")
    for line in bad:
        print(f"no data: {line}")
    if bad:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Adds `tierplan dashboards ...` to the CLI."""
    app.add_typer(dashboards_app, name="dashboards")
