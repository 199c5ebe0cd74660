"""Structure of the Grafana dashboards: the rules a dashboard linter would apply, as tests."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest

from tests.dashboards import _promql as promql
from tests.support.metric_names import ISSUE_METRICS

DS_REF = {"type": "prometheus", "uid": "${datasource}"}
PINNED_UIDS = {
    "training-overview.json": "trainingd-overview",
    "fsdp-communication.json": "trainingd-fsdp",
    "checkpointing.json": "trainingd-checkpointing",
}
RANGE_VARIABLES = ("$__rate_interval", "$__range")
RATE_FUNCTIONS = ("rate(", "irate(", "increase(")

PATHS = promql.dashboard_paths()


def _ids(paths: list[pathlib.Path]) -> list[str]:
    return [p.name for p in paths]


@pytest.fixture(params=PATHS, ids=_ids(PATHS))
def dashboard(request: pytest.FixtureRequest) -> dict[str, Any]:
    return promql.load_json(request.param)


def _walk(node: Any, path: str = "") -> list[tuple[str, str, Any]]:
    """(path, key, value) for every key of every object in a JSON tree."""
    out: list[tuple[str, str, Any]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            out.append((path, key, value))
            out.extend(_walk(value, f"{path}.{key}"))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out.extend(_walk(value, f"{path}[{i}]"))
    return out


def test_the_three_dashboards_ship_with_fixed_unique_uids() -> None:
    assert _ids(PATHS) == sorted(PINNED_UIDS)
    uids = {p.name: promql.load_json(p)["uid"] for p in PATHS}
    assert uids == PINNED_UIDS
    for uid in uids.values():
        assert re.fullmatch(r"[a-z0-9-]{8,40}", uid), uid


def test_classic_model_with_pinned_schema(dashboard: dict[str, Any]) -> None:
    assert isinstance(dashboard["schemaVersion"], int)
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["title"].startswith("trainingd / ")
    assert "trainingd" in dashboard["tags"]
    assert isinstance(dashboard["panels"], list)
    assert dashboard["panels"]
    # Import-only constructs that file provisioning leaves unresolved.
    assert "__inputs" not in dashboard
    assert "${DS_" not in str(dashboard)


def test_panel_ids_are_unique_and_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    panels = list(promql.all_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids)
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    cells: dict[tuple[int, int], int] = {}
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] >= 0, f"panel {p['id']} is off the grid"
        assert pos["x"] + pos["w"] <= 24, f"panel {p['id']} is off the grid"
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"panels {cells[x, y]} and {p['id']} overlap"
                cells[x, y] = p["id"]


def test_datasource_only_through_the_variable(dashboard: dict[str, Any]) -> None:
    refs = [(path, value) for path, key, value in _walk(dashboard) if key == "datasource"]
    assert refs
    for path, value in refs:
        assert value == DS_REF, f"{path}.datasource is {value!r}, not the $datasource variable"
    ds_vars = [v for v in promql.template_variables(dashboard) if v["type"] == "datasource"]
    assert len(ds_vars) == 1
    assert ds_vars[0]["name"] == "datasource"
    assert ds_vars[0]["query"] == "prometheus"
    # Every panel and every target names it (Grafana would otherwise use the default source).
    for panel in promql.all_panels(dashboard):
        assert panel.get("datasource") == DS_REF, f"panel {panel['id']}"
        for target in panel.get("targets", []):  # a row has none
            assert target.get("datasource") == DS_REF, f"panel {panel['id']} {target['refId']}"


def test_job_run_instance_rank_variables_use_label_values(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in promql.template_variables(dashboard)}
    parsed = {v.name: v for v in promql.label_values_variables(dashboard)}
    assert list(parsed) == ["job", "run_id", "instance", "rank"]
    assert [v.label for v in parsed.values()] == ["job", "run_id", "instance", "rank"]
    # Each variable narrows by the ones before it.
    assert promql.referenced_variables(parsed["job"].selector) == set()
    assert promql.referenced_variables(parsed["run_id"].selector) == {"job"}
    assert promql.referenced_variables(parsed["instance"].selector) == {"job", "run_id"}
    assert promql.referenced_variables(parsed["rank"].selector) == {"job", "run_id", "instance"}
    for name, parsed_var in parsed.items():
        var = variables[name]
        assert var["datasource"] == DS_REF
        assert var["multi"] is True
        assert var["includeAll"] is True
        assert var["allValue"] == ".+"
        assert var["refresh"] == 2, f"{name}: refresh on time range change"
        for sel in promql.selectors(parsed_var.selector):
            labels = promql.series_labels(sel.metric)
            assert labels is not None, sel.metric
            assert parsed_var.label in {*labels, "job", "instance"}, sel.metric


def test_every_panel_has_title_description_unit_and_queries(dashboard: dict[str, Any]) -> None:
    for panel in promql.all_panels(dashboard):
        where = f"panel {panel['id']}"
        if panel["type"] == "row":
            # A row only heads the panels below it (e.g. the overview's GPU row): no queries.
            assert panel.get("title", "").strip(), where
            assert not panel.get("targets"), where
            assert not panel.get("panels"), where
            continue
        assert panel["type"] in {"timeseries", "stat"}, where
        assert panel.get("title", "").strip(), where
        assert len(panel.get("description", "")) >= 40, f"{where} needs a real description"
        unit = panel["fieldConfig"]["defaults"].get("unit")
        assert isinstance(unit, str), f"{where} has no unit"
        assert unit.strip(), f"{where} has no unit"
        targets = panel["targets"]
        assert targets, where
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), where
        for target in targets:
            assert target["expr"].strip(), f"{where} {target['refId']}"
            assert "legendFormat" in target, f"{where} {target['refId']}"


def test_no_query_references_an_undefined_variable(dashboard: dict[str, Any]) -> None:
    defined = {v["name"] for v in promql.template_variables(dashboard)}
    texts = [(q.where, q.expr) for q in promql.queries(dashboard)]
    texts += [(f"variable {v.name}", v.selector) for v in promql.label_values_variables(dashboard)]
    for where, text in texts:
        undefined = promql.referenced_variables(text) - defined - promql.GRAFANA_BUILTINS
        assert not undefined, f"{where} uses undefined {sorted(undefined)}: {text}"


def test_every_selector_filters_by_the_variables(dashboard: dict[str, Any]) -> None:
    for query in promql.queries(dashboard):
        sels = promql.selectors(query.expr)
        assert sels, f"{query.where}: no selector"
        names = promql.metric_names(query.expr)
        assert names == {s.metric for s in sels}, f"{query.where}: a metric without matchers"
        for sel in sels:
            where = f"{query.where} {sel.metric}"
            labels = promql.series_labels(sel.metric)
            assert labels is not None, f"{where}: not in daemon/metrics.py nor recorded"
            assert sel.matchers.get("job") == ("=~", "$job"), where
            # Runs are never averaged together: every selector narrows to the chosen runs.
            assert sel.matchers.get("run_id") == ("=~", "$run_id"), where
            assert sel.matchers.get("instance") == ("=~", "$instance"), where
            if "rank" in labels and not query.where.startswith("annotation"):
                assert sel.matchers.get("rank") == ("=~", "$rank"), where
            unknown = set(sel.matchers) - labels - {"job", "instance"}
            assert not unknown, f"{where}: matches labels the series lacks: {unknown}"


def test_cumulative_series_only_under_rate_with_grafana_interval(
    dashboard: dict[str, Any],
) -> None:
    for query in promql.queries(dashboard):
        for sel in promql.selectors(query.expr):
            where = f"{query.where} {sel.metric}"
            if sel.range is not None:
                assert sel.range in RANGE_VARIABLES, f"{where}: fixed range [{sel.range}]"
            if promql.is_cumulative(sel.metric):
                before = query.expr[: sel.start].rstrip()
                assert before.endswith(RATE_FUNCTIONS), f"{where}: counter outside rate()"
                assert sel.range is not None, where


def test_every_metric_the_issue_names_is_on_a_dashboard() -> None:
    used: set[str] = set()
    for path in PATHS:
        board = promql.load_json(path)
        for query in promql.queries(board):
            used |= {
                fam.name
                for name in promql.metric_names(query.expr)
                if (fam := promql.catalog_family(name)) is not None
            }
        for var in promql.label_values_variables(board):
            used |= promql.metric_names(var.selector)
    missing = [name for name in ISSUE_METRICS if name not in used]
    assert not missing, f"not on any dashboard: {missing}"
    for name in ISSUE_METRICS:
        assert promql.catalog_family(name) is not None, f"{name} missing from daemon/metrics.py"


def test_provisioning_matches_the_dashboards() -> None:
    prov = promql.DASHBOARDS_DIR / "provisioning"
    sources = promql.load_yaml(prov / "datasources" / "trainingd.yaml")
    assert sources["apiVersion"] == 1
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus"
    assert source["access"] == "proxy"
    example = promql.load_yaml(promql.EXAMPLE_CONFIG)
    assert source["jsonData"]["timeInterval"] == example["global"]["scrape_interval"]
    for path in PATHS:
        board_vars = promql.template_variables(promql.load_json(path))
        ds_var = next(v for v in board_vars if v["name"] == "datasource")
        assert ds_var["current"]["value"] == source["uid"], path.name

    providers = promql.load_yaml(prov / "dashboards" / "trainingd.yaml")
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"].startswith("/")
    assert {"name", "orgId", "folder", "disableDeletion", "updateIntervalSeconds"} <= set(provider)


def test_readme_explains_every_panel() -> None:
    readme = (promql.DASHBOARDS_DIR / "README.md").read_text()
    for path in PATHS:
        board = promql.load_json(path)
        assert board["uid"] in readme, board["uid"]
        for panel in promql.all_panels(board):
            assert f"**{panel['title']}**" in readme, f"{path.name}: {panel['title']!r}"
    for rule in promql.rules(promql.ALERT_RULES):
        assert rule["alert"] in readme, rule["alert"]
    for rule in promql.rules(promql.RECORDING_RULES):
        assert rule["record"] in readme, rule["record"]
