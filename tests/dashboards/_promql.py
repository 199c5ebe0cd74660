"""Read the dashboards and rule files, and take their PromQL apart the way the tests need.

No PromQL parser is needed for what the tests check: which metric names an expression reads
(string literals, label matchers, range brackets and grouping clauses removed, then every
identifier that is not a function or keyword), which label matchers each selector has, and
which Grafana variables it references. Whether the expressions parse is checked by promtool and
by a real Prometheus (tests/dashboards/test_rules.py, test_prometheus_queries.py).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from daemon.metrics import CATALOG, MetricKind, MetricSpec

REPO = pathlib.Path(__file__).resolve().parents[2]
DASHBOARDS_DIR = REPO / "dashboards"
PROMETHEUS_DIR = DASHBOARDS_DIR / "prometheus"
RECORDING_RULES = PROMETHEUS_DIR / "recording_rules.yml"
ALERT_RULES = PROMETHEUS_DIR / "alert_rules.yml"
RULE_FILES = (RECORDING_RULES, ALERT_RULES)
ALERT_TESTS = PROMETHEUS_DIR / "alert_rules_test.yml"
EXAMPLE_CONFIG = PROMETHEUS_DIR / "prometheus.yml"

GRAFANA_BUILTINS = frozenset(
    {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms"}
)
"""Variables Grafana defines itself."""

PROMETHEUS_SERIES = frozenset({"up"})
"""Series Prometheus creates for every target (the only one the rules read)."""

_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    | {"group_left", "group_right", "inf", "nan", "atan2"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_BRACKETS = re.compile(r"\[[^\]]*\]")
_BRACES = re.compile(r"\{[^}]*\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.$:])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
_SELECTOR = re.compile(r"(?<![\w.$:])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}(\s*\[[^\]]*\])?")
_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.+),\s*(?P<label>\w+)\s*\)\s*$")
_REGEX_SPECIALS = re.compile(r"([\\^$*+?.()|{}\[\]])")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Selector:
    """One `metric{matchers}[range]` in an expression."""

    metric: str
    matchers: dict[str, tuple[str, str]]
    """Label name → (operator, value as written)."""
    range: str | None
    """The text inside `[...]` right after the selector, if any."""
    start: int
    """Offset of the metric name in the expression."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Query:
    """One PromQL expression of a dashboard and where it sits."""

    dashboard: str
    """The dashboard's uid."""
    where: str
    """Human-readable location: panel id and title and refId, or the annotation's name."""
    expr: str
    legend: str = ""
    """The legend template (`{{instance}} rank {{rank}}`); empty for annotations."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variable:
    """A `label_values(selector, label)` query variable."""

    name: str
    selector: str
    label: str


# --- files ---------------------------------------------------------------------------------------
def dashboard_paths() -> list[pathlib.Path]:
    """The dashboard JSON files shipped in `dashboards/`."""
    return sorted(DASHBOARDS_DIR.glob("*.json"))


def load_json(path: pathlib.Path) -> dict[str, Any]:
    """Parse one dashboard file."""
    data = json.loads(path.read_text())
    assert isinstance(data, dict), f"{path} is not a JSON object"
    return data


def load_yaml(path: pathlib.Path) -> dict[str, Any]:
    """Parse one YAML file (rules, rule tests, provisioning)."""
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a YAML mapping"
    return data


def rules(path: pathlib.Path) -> list[dict[str, Any]]:
    """Every rule of a rule file, in order."""
    return [rule for group in load_yaml(path)["groups"] for rule in group["rules"]]


# --- dashboards ----------------------------------------------------------------------------------
def all_panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: Mapping[str, Any]) -> list[Query]:
    """The PromQL expressions of every panel target and every annotation."""
    uid = dashboard["uid"]
    out = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            where = f"panel {panel['id']} {panel.get('title')!r} target {target.get('refId')}"
            expr, legend = target.get("expr", ""), target.get("legendFormat", "")
            out.append(Query(dashboard=uid, where=where, expr=expr, legend=legend))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if "expr" in annotation:
            where = f"annotation {annotation.get('name')!r}"
            out.append(Query(dashboard=uid, where=where, expr=annotation["expr"]))
    return out


def template_variables(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The `templating.list` entries."""
    return list(dashboard.get("templating", {}).get("list", []))


def variable_definition(variable: Mapping[str, Any]) -> str:
    """The query text of a query variable (string or object form)."""
    query = variable.get("query")
    if isinstance(query, dict):
        return str(query.get("query", ""))
    return str(query or variable.get("definition", ""))


def label_values_variables(dashboard: Mapping[str, Any]) -> list[Variable]:
    """The query variables, parsed; raises AssertionError for any other query form."""
    out = []
    for var in template_variables(dashboard):
        if var.get("type") != "query":
            continue
        definition = variable_definition(var)
        match = _LABEL_VALUES.match(definition)
        assert match, f"variable {var['name']}: not label_values(selector, label): {definition!r}"
        out.append(Variable(name=var["name"], selector=match["selector"], label=match["label"]))
    return out


# --- PromQL --------------------------------------------------------------------------------------
def referenced_variables(text: str) -> set[str]:
    """Names of the Grafana variables (`$x`, `${x}`, `${x:fmt}`) in `text`."""
    return {a or b for a, b in _VARIABLE.findall(text)}


def metric_names(expr: str) -> set[str]:
    """Every metric (or recorded series) name an expression reads."""
    text = _STRING.sub('""', expr)
    text = _BRACKETS.sub("[]", text)
    text = _BRACES.sub("{}", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for name, call in _IDENTIFIER.findall(text):
        if call or name.lower() in _KEYWORDS:  # Inf, NaN: any case
            continue
        names.add(name)
    return names


def selectors(expr: str) -> list[Selector]:
    """Every `metric{...}` selector of an expression, with its matchers and range."""
    out = []
    for match in _SELECTOR.finditer(expr):
        matchers = {m[0]: (m[1], m[2]) for m in _MATCHER.findall(match[2])}
        range_text = match[3].strip()[1:-1] if match[3] else None
        out.append(
            Selector(metric=match[1], matchers=matchers, range=range_text, start=match.start())
        )
    return out


def regex_escape(value: str) -> str:
    """A label value as Grafana writes it into a regex matcher (backslashes doubled for PromQL)."""
    return _REGEX_SPECIALS.sub(r"\\\\\1", value)


def substitute(text: str, values: Mapping[str, str]) -> str:
    """Replace `$x` / `${x}` by `values[x]`; a KeyError names a variable without a value."""

    def repl(match: re.Match[str]) -> str:
        return values[match[1] or match[2]]

    return _VARIABLE.sub(repl, text)


# --- the metric catalog --------------------------------------------------------------------------
CATALOG_BY_NAME: dict[str, MetricSpec] = {s.name: s for s in CATALOG}


def catalog_family(name: str) -> MetricSpec | None:
    """The catalog entry a sample name belongs to (`x_bucket` → histogram `x`), or None."""
    if name in CATALOG_BY_NAME:
        return CATALOG_BY_NAME[name]
    for suffix in _HISTOGRAM_SUFFIXES:
        family = CATALOG_BY_NAME.get(name.removesuffix(suffix))
        if name.endswith(suffix) and family and family.kind is MetricKind.HISTOGRAM:
            return family
    return None


def is_cumulative(name: str) -> bool:
    """Whether a sample name is a counter or a histogram's cumulative series."""
    family = catalog_family(name)
    return family is not None and (
        family.kind is MetricKind.COUNTER
        or (family.kind is MetricKind.HISTOGRAM and name != family.name)
    )


def recorded_labels() -> dict[str, frozenset[str]]:
    """Recording rule name → the labels its series carry (`job` plus the level's labels).

    The level (the part before the first colon) names the labels kept besides `job`, by the
    convention documented in recording_rules.yml; a test checks each rule's `by` clauses match.
    """
    out = {}
    for rule in rules(RECORDING_RULES):
        level = rule["record"].split(":", 1)[0]
        # `run` in a level stands for the `run_id` label (a level splits on underscores).
        kept = {"run_id" if part == "run" else part for part in level.split("_")}
        out[rule["record"]] = frozenset({"job", *kept})
    return out


def series_labels(name: str) -> frozenset[str] | None:
    """Labels (besides `job`/`instance` from the scrape) a series of this name carries."""
    recorded = recorded_labels()
    if name in recorded:
        return recorded[name] - {"job", "instance"}
    family = catalog_family(name)
    if family is None:
        return None
    extra = {"le"} if family.kind is MetricKind.HISTOGRAM and name.endswith("_bucket") else set()
    return frozenset({*family.labelnames, *extra})
