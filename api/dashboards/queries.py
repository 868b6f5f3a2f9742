"""The PromQL of every panel of an exported dashboard, and those queries with their template variables filled in.

Used by tests (every panel query must return data from a real Prometheus) and by anyone checking a dashboard
against a Prometheus. Pure functions over dashboard JSON: no network, no Grafana.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


@dataclass(frozen=True)
class PanelQuery:
    """One target of one panel: where it sits (dashboard uid, panel title, refId) and its raw expression."""

    dashboard_uid: str
    panel_title: str
    ref_id: str
    expr: str

    @property
    def where(self) -> str:
        return f"{self.dashboard_uid} / {self.panel_title!r} / {self.ref_id}"


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])  # a collapsed row keeps its panels inside it


def panel_queries(board: Mapping[str, Any]) -> list[PanelQuery]:
    """Every Prometheus target of every panel (rows included), in dashboard order."""
    out = []
    for panel in _panels(list(board.get("panels") or [])):
        for target in panel.get("targets") or []:
            if "expr" in target:
                out.append(PanelQuery(str(board.get("uid")), str(panel.get("title")), str(target.get("refId")),
                                      str(target["expr"])))
    return out


def expand(expr: str, values: Mapping[str, str]) -> str:
    """`expr` with `$name` / `${name}` replaced from `values`; a variable with no value raises KeyError by name."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"template variable ${name} in {expr!r} has no value")
        return values[name]

    return _VAR.sub(sub, expr)


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)\s*$")


def variable_queries(board: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(variable name, metric, label) of every `label_values(metric, label)` query variable, in order."""
    out = []
    for var in (board.get("templating") or {}).get("list") or []:
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        if var.get("type") == "query" and (m := _LABEL_VALUES.match(text)):
            out.append((str(var["name"]), m.group(1), m.group(2)))
    return out
