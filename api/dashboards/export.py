"""Exports the dashboards as Grafana JSON plus the file-provisioning YAML that loads them into a Grafana.

Runs in the user's shell (`tierplan dashboards export`) and in tests (the committed files under dashboards/
must equal a fresh export byte for byte). Writes only under the folder it is given; never touches the network.
The output is deterministic: keys sorted, fixed indentation, fixed panel ids, no timestamps.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders.dashboard import Dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from tierplan.api.dashboards.overview import overview_dashboard
from tierplan.api.dashboards.service import service_dashboard

# file stem -> builder; the stem is also what `push` reports
DASHBOARDS: dict[str, Callable[[], Dashboard]] = {
    "tierplan-overview": overview_dashboard,
    "tierplan-service": service_dashboard,
}

PROVIDER_YAML = """\
# Grafana file provisioning for the tierplan dashboards (written by `tierplan dashboards export`; regenerate,
# don't edit). Copy or mount this repository's dashboards/ folder at the path below, or change `path`.
apiVersion: 1
providers:
  - name: tierplan
    orgId: 1
    folder: tierplan
    type: file
    disableDeletion: false
    allowUiUpdates: false
    updateIntervalSeconds: 30
    options:
      path: /var/lib/grafana/dashboards/tierplan
      foldersFromFilesStructure: false
"""

DATASOURCE_YAML = """\
# The Prometheus that scrapes the tierplan service (`/metrics`) and every sidecar (`--metrics-port`); written by
# `tierplan dashboards export`. The dashboards pick it through their `datasource` variable (any Prometheus
# datasource works). timeInterval is the scrape interval, from which Grafana derives $__rate_interval.
apiVersion: 1
datasources:
  - name: Prometheus (tierplan)
    uid: tierplan-prometheus
    type: prometheus
    access: proxy
    url: http://localhost:9090
    isDefault: true
    jsonData:
      timeInterval: 15s
"""

PROVIDER_PATH = Path("provisioning/dashboards/tierplan.yaml")
DATASOURCE_PATH = Path("provisioning/datasources/prometheus.yaml")


def dashboard_json(builder: Dashboard) -> dict[str, Any]:
    """The dashboard model as plain JSON data (what Grafana stores and its HTTP API takes)."""
    return json.loads(json.dumps(builder.build(), cls=JSONEncoder))


def render(data: dict[str, Any]) -> str:
    """Canonical text of one dashboard: sorted keys, two-space indent, trailing newline."""
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def all_dashboards() -> dict[str, dict[str, Any]]:
    """Every tierplan dashboard as JSON data, by file stem."""
    return {stem: dashboard_json(build()) for stem, build in DASHBOARDS.items()}


def exported_files() -> dict[Path, str]:
    """Relative path -> text of every file `export` writes."""
    files = {Path(f"{stem}.json"): render(data) for stem, data in all_dashboards().items()}
    files[PROVIDER_PATH] = PROVIDER_YAML
    files[DATASOURCE_PATH] = DATASOURCE_YAML
    return files


def export(out_dir: Path) -> list[Path]:
    """Writes the dashboards and the provisioning YAML under `out_dir`; returns the paths written."""
    written = []
    for rel, text in exported_files().items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
