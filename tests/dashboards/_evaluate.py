"""Evaluate every dashboard query through a real Prometheus, the way Grafana would.

Variables are resolved in order through the series API (`label_values(selector, label)`, with
the earlier variables substituted), then every panel and annotation query is run twice: with
*All* selected (`.+`) and with the first value of each variable (regex-escaped as Grafana does).
`$__rate_interval` and `$__range` become fixed durations chosen by the caller.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tests.dashboards import _promql as promql
from tests.dashboards._prometheus import PrometheusError, PrometheusServer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    """What one query returned."""

    query: promql.Query
    selection: str
    """`all` or `first`."""
    expr: str
    """The expression sent, variables substituted."""
    num_series: int
    num_finite: int
    """Series whose value is a finite number (not NaN, not ±Inf)."""
    error: str | None = None

    def describe(self) -> str:
        """One line for an assertion message."""
        what = self.error or f"{self.num_series} series, {self.num_finite} finite"
        where = f"{self.query.dashboard} {self.query.where} [{self.selection}]"
        return f"{where}: {what}\n    {self.expr}"


def resolve_variables(prom: PrometheusServer, dashboard: dict[str, object]) -> dict[str, list[str]]:
    """Each query variable's values, as Grafana would list them for *All* selections."""
    resolved: dict[str, list[str]] = {}
    values = {name: ".+" for name in ("job", "run_id", "instance", "rank")}
    for var in promql.label_values_variables(dashboard):
        selector = promql.substitute(var.selector, values)
        found = sorted({s[var.label] for s in prom.series(selector) if var.label in s})
        resolved[var.name] = found
    return resolved


def evaluate_dashboards(
    prom: PrometheusServer,
    *,
    rate_interval: str,
    range_: str,
    selections: Sequence[str] = ("all", "first"),
) -> tuple[dict[str, dict[str, list[str]]], list[Outcome]]:
    """Run every query of every dashboard; returns the variables found and one outcome each."""
    variables: dict[str, dict[str, list[str]]] = {}
    outcomes = []
    for path in promql.dashboard_paths():
        board = promql.load_json(path)
        found = resolve_variables(prom, board)
        variables[board["uid"]] = found
        for selection in selections:
            values = {"__rate_interval": rate_interval, "__range": range_}
            for name, options in found.items():
                first = promql.regex_escape(options[0]) if options else "__no_value__"
                values[name] = ".+" if selection == "all" else first
            for query in promql.queries(board):
                expr = promql.substitute(query.expr, values)
                try:
                    result = prom.query(expr)
                except PrometheusError as err:
                    outcomes.append(
                        Outcome(
                            query=query,
                            selection=selection,
                            expr=expr,
                            num_series=0,
                            num_finite=0,
                            error=str(err),
                        )
                    )
                    continue
                finite = sum(1 for r in result if math.isfinite(float(r["value"][1])))
                outcomes.append(
                    Outcome(
                        query=query,
                        selection=selection,
                        expr=expr,
                        num_series=len(result),
                        num_finite=finite,
                    )
                )
    return variables, outcomes
