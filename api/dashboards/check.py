"""Runs every panel query of the dashboards against a Prometheus and says which ones return no data.

Used by the Prometheus integration tests (every panel query in the committed dashboards must return data
from a real Prometheus scraping the service and the sidecar) and usable by an operator. Takes the query
function from its caller (any `expr -> result list`), so this module opens no connection itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tierplan.api.dashboards.queries import PanelQuery, expand, panel_queries

QueryFn = Callable[[str], list[dict[str, Any]]]


@dataclass(frozen=True)
class QueryOutcome:
    """One panel query as sent (variables filled in), how many series came back, and an error if PromQL failed."""

    query: PanelQuery
    sent: str
    num_series: int
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.num_series > 0

    def describe(self) -> str:
        why = f"error {self.error}" if self.error else f"{self.num_series} series"
        return f"{self.query.where}: {why} <- {self.sent}"


_REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}/])")


def regex_value(value: str) -> str:
    """`value` as Grafana puts a single-valued variable into a PromQL `=~"..."` (regex specials escaped, with the
    backslash itself doubled for the string literal)."""
    return _REGEX_SPECIAL.sub(r"\\\\\1", value)


def variable_values(agent_id: str, rate_interval: str, sidecar: str = ".*") -> dict[str, str]:
    """Values for the dashboards' template variables: one agent, every sidecar, a concrete rate window."""
    return {"agent_id": regex_value(agent_id), "sidecar": sidecar, "__rate_interval": rate_interval}


def run_panel_queries(query: QueryFn, boards: Iterable[Mapping[str, Any]],
                      values: Mapping[str, str]) -> list[QueryOutcome]:
    """Every Prometheus target of every panel, sent through `query`; exceptions become the outcome's error."""
    outcomes = []
    for board in boards:
        for pq in panel_queries(board):
            sent = expand(pq.expr, values)
            try:
                result = query(sent)
            except Exception as exc:  # a PromQL or HTTP error is that query's outcome, not the end of the run
                outcomes.append(QueryOutcome(pq, sent, 0, f"{type(exc).__name__}: {exc}"))
                continue
            outcomes.append(QueryOutcome(pq, sent, len(result)))
    return outcomes


def failures(outcomes: Iterable[QueryOutcome]) -> list[str]:
    """One line per query that failed or returned nothing."""
    return [o.describe() for o in outcomes if not o.ok]
