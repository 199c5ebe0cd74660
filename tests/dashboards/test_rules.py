"""Prometheus rules: structure, metric names, promtool checks and the alert unit tests."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from tests.dashboards import _promql as promql

SEVERITIES = {"critical", "warning", "info"}
REQUIRED_ALERTS = {
    "TrainingdRankHeartbeatStale",
    "TrainingdNotReadyTooLong",
    "TrainingdRestartLoop",
    "TrainingdWorkersRestarted",
    "TrainingdLossNotFinite",
    "TrainingdWorldSizeShrank",
    "TrainingdCheckpointTooOld",
    "TrainingdCheckpointSaveFailures",
    "TrainingdCheckpointStallHigh",
    "TrainingdPrefetchHitRatioLow",
    "TrainingdReduceQueueSaturated",
    "TrainingdDaemonDown",
    # Peer replicas of the memory tier.
    "TrainingdMemoryReplicaLagging",
    # Hangs (issue #30 item 1).
    "TrainingdRankHung",
    # Stragglers (issue #30 item 2).
    "TrainingdRankStraggler",
}
_BY_CLAUSE = re.compile(r"\bby\s*\(([^)]*)\)")
_HEADING = re.compile(r"^## (\S+)\s*$", re.MULTILINE)
RUNBOOKS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "runbooks.md"
ANNOTATIONS = {"summary", "description", "runbook_url"}
_SERIES = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*$")
_LABEL = re.compile(r'([a-zA-Z_]\w*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def _promtool(*args: str | pathlib.Path, timeout_s: float = 60.0) -> str:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: install Debian's `prometheus` (`make test` does as root)"
    proc = subprocess.run(
        [exe, *map(str, args)], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"promtool {' '.join(map(str, args))} failed:\n{output}"
    return output


def _alerts() -> list[dict[str, Any]]:
    return promql.rules(promql.ALERT_RULES)


def _rule_metric_names(rule: dict[str, Any]) -> set[str]:
    return promql.metric_names(rule["expr"])


# --- structure, without promtool -------------------------------------------------------------
def test_every_required_alert_exists_with_severity_and_annotations() -> None:
    alerts = _alerts()
    names = [a["alert"] for a in alerts]
    assert len(names) == len(set(names)), names
    assert set(names) == REQUIRED_ALERTS
    for alert in alerts:
        name = alert["alert"]
        assert re.fullmatch(r"Trainingd(?:[A-Z][a-z]+)+", name), f"{name}: CamelCase, Trainingd…"
        assert alert["labels"]["severity"] in SEVERITIES, name
        assert set(alert["annotations"]) == ANNOTATIONS, name
        for key in ("summary", "description"):
            text = alert["annotations"][key]
            assert "$labels.run_id" in text, f"{name}.{key} does not name the run"
        assert len(alert["annotations"]["description"]) > len(alert["annotations"]["summary"])


def test_every_alert_links_its_own_runbook_section() -> None:
    sections = _HEADING.findall(RUNBOOKS.read_text())
    assert sorted(sections) == sorted(REQUIRED_ALERTS), "one docs/runbooks.md section per alert"
    for alert in _alerts():
        # GitHub's anchor of a heading `## TrainingdX` is `#trainingdx`.
        expected = f"docs/runbooks.md#{alert['alert'].lower()}"
        assert alert["annotations"]["runbook_url"] == expected, alert["alert"]
    text = RUNBOOKS.read_text()
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        for part in ("**Means:**", "**Check:**", "**Do:**"):
            assert part in section, f"runbook {section.split()[0]} lacks {part}"


def test_every_alert_is_aggregated_by_run() -> None:
    # The outermost aggregation of every alert keeps run_id and nothing else (one alert per
    # run); the unit tests below check the labels of every alert that fires.
    for alert in _alerts():
        clauses = [{c.strip() for c in m.split(",")} for m in _BY_CLAUSE.findall(alert["expr"])]
        assert {"run_id"} in clauses, alert["alert"]


def test_rules_read_only_metrics_the_daemon_exports() -> None:
    recorded: set[str] = set()
    for rule in promql.rules(promql.RECORDING_RULES):
        for name in _rule_metric_names(rule):
            assert promql.catalog_family(name), f"{rule['record']}: {name} not in daemon/metrics.py"
        recorded.add(rule["record"])
    for alert in _alerts():
        for name in _rule_metric_names(alert):
            known = (
                promql.catalog_family(name) is not None
                or name in recorded
                or name in promql.PROMETHEUS_SERIES
            )
            assert known, f"{alert['alert']}: {name} is neither exported nor recorded"
        for sel in promql.selectors(alert["expr"]):
            labels = promql.series_labels(sel.metric) or frozenset()
            unknown = set(sel.matchers) - labels - {"job", "instance"}
            assert not unknown, f"{alert['alert']}: {sel.metric} has no label {unknown}"


def test_recording_rule_names_state_the_labels_they_keep() -> None:
    for rule in promql.rules(promql.RECORDING_RULES):
        name = rule["record"]
        _level, metric, operations = name.split(":")
        assert metric.startswith("trainingd_"), name
        assert operations.startswith("ratio_rate"), name
        kept = promql.recorded_labels()[name]
        clauses = _BY_CLAUSE.findall(rule["expr"])
        assert clauses, f"{name}: aggregate explicitly"
        for clause in clauses:
            assert {c.strip() for c in clause.split(",")} == kept, f"{name}: by ({clause})"
        for sel in promql.selectors(rule["expr"]):
            family = promql.catalog_family(sel.metric)
            assert family is not None
            assert kept - {"job", "instance"} <= set(family.labelnames), name


def _alert_tests() -> list[dict[str, Any]]:
    return promql.load_yaml(promql.ALERT_TESTS)["tests"]


def test_unit_tests_cover_every_alert_firing_and_not_firing() -> None:
    fires: set[str] = set()
    silent: set[str] = set()
    for test in _alert_tests():
        for case in test["alert_rule_test"]:
            (fires if case["exp_alerts"] else silent).add(case["alertname"])
            for exp in case["exp_alerts"]:
                # Annotations are compared exactly, so the templates are rendered and checked.
                assert set(exp["exp_annotations"]) == ANNOTATIONS, case
                # One alert per run: no rank, node or job label survives the aggregation.
                assert set(exp["exp_labels"]) <= {"severity", "run_id"}, case
    names = {a["alert"] for a in _alerts()}
    assert fires == names, f"never firing in a test: {names - fires}"
    assert silent == names, f"never checked silent: {names - silent}"


def test_unit_test_series_use_the_daemons_names_and_labels() -> None:
    config = promql.load_yaml(promql.ALERT_TESTS)
    assert [pathlib.Path(f).name for f in config["rule_files"]] == [
        p.name for p in promql.RULE_FILES
    ]
    for test in _alert_tests():
        for series in test["input_series"]:
            match = _SERIES.match(series["series"])
            assert match, series
            name, labels = match[1], dict(_LABEL.findall(match[2] or ""))
            assert {"job", "instance"} <= set(labels), series
            expected = (
                frozenset() if name in promql.PROMETHEUS_SERIES else promql.series_labels(name)
            )
            assert expected is not None, f"{name} is not in daemon/metrics.py"
            assert set(labels) - {"job", "instance"} == expected, f"{series}: labels {expected}"


# --- promtool --------------------------------------------------------------------------------
@pytest.mark.prometheus
def test_promtool_check_rules() -> None:
    out = _promtool("check", "rules", *promql.RULE_FILES)
    assert out.count("SUCCESS") == len(promql.RULE_FILES)


@pytest.mark.prometheus
def test_promtool_check_example_config() -> None:
    out = _promtool("check", "config", promql.EXAMPLE_CONFIG)
    assert "2 rule files found" in out


@pytest.mark.prometheus
def test_promtool_alert_unit_tests_pass() -> None:
    out = _promtool("test", "rules", promql.ALERT_TESTS)
    assert "SUCCESS" in out


@pytest.mark.prometheus
def test_promtool_unit_tests_can_fail(tmp_path: pathlib.Path) -> None:
    # A unit-test file expecting the opposite of one case must fail: promtool really compares.
    config = promql.load_yaml(promql.ALERT_TESTS)
    config["rule_files"] = [str(p) for p in promql.RULE_FILES]
    case = next(c for c in config["tests"][0]["alert_rule_test"] if c["exp_alerts"])
    case["exp_alerts"] = []
    broken = tmp_path / "broken_test.yml"
    broken.write_text(yaml.safe_dump(config))
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: install Debian's `prometheus` (`make test` does as root)"
    proc = subprocess.run(
        [exe, "test", "rules", str(broken)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "FAILED" in proc.stdout + proc.stderr


@pytest.mark.prometheus
def test_every_dashboard_query_parses(tmp_path: pathlib.Path) -> None:
    # promtool parses each expression as a recording rule (Grafana's variables substituted).
    values = {
        "job": ".+",
        "run_id": ".+",
        "instance": ".+",
        "rank": ".+",
        "__rate_interval": "1m",
        "__range": "1h",
    }
    rules = []
    for path in promql.dashboard_paths():
        board = promql.load_json(path)
        prefix = f"dashboard:{board['uid'].replace('-', '_')}"
        for i, query in enumerate(promql.queries(board)):
            expr = promql.substitute(query.expr, values)
            rules.append({"record": f"{prefix}:q{i}", "expr": expr})
        for var in promql.label_values_variables(board):
            expr = promql.substitute(var.selector, values)
            rules.append({"record": f"{prefix}:{var.name}", "expr": expr})
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = _promtool("check", "rules", path)
    assert f"SUCCESS: {len(rules)} rules found" in out
