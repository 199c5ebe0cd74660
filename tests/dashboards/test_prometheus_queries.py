"""Every dashboard query returns data from a real Prometheus scraping a node's metric families.

The node is `_fake_node.FakeNode`: every family of `daemon.metrics.CATALOG`, two ranks, values
advancing on each scrape. The same checks against a real `trainingd run` are in
test_e2e_trainingd.py.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator

import pytest

from tests.dashboards import _promql as promql
from tests.dashboards._evaluate import Outcome, evaluate_dashboards
from tests.dashboards._fake_node import RUN_ID, FakeNode
from tests.dashboards._prometheus import JOB, PrometheusServer

pytestmark = pytest.mark.prometheus

NUM_RANKS = 2


@pytest.fixture(scope="module")
def node() -> Iterator[FakeNode]:
    fake = FakeNode(num_ranks=NUM_RANKS).start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture(scope="module")
def prom(node: FakeNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    workdir: pathlib.Path = tmp_path_factory.mktemp("prometheus")
    with PrometheusServer(workdir, [node.target], rule_files=promql.RULE_FILES) as server:
        # Every recorded ratio needs two scrapes and one evaluation after them.
        for rule in promql.rules(promql.RECORDING_RULES):
            server.wait_for(rule["record"], timeout_s=30)
        yield server


@pytest.fixture(scope="module")
def evaluated(
    prom: PrometheusServer,
) -> tuple[dict[str, dict[str, list[str]]], list[Outcome]]:
    # 10 s spans ten 1-second scrapes, as Grafana's $__rate_interval spans at least four.
    return evaluate_dashboards(prom, rate_interval="10s", range_="1h")


def test_the_scrape_target_is_up(prom: PrometheusServer, node: FakeNode) -> None:
    (up,) = prom.query(f'up{{job="{JOB}"}}')
    assert up["metric"]["instance"] == node.target
    assert up["value"][1] == "1"


def test_every_variable_lists_the_node(
    evaluated: tuple[dict[str, dict[str, list[str]]], list[Outcome]], node: FakeNode
) -> None:
    variables, _ = evaluated
    assert set(variables) == {p["uid"] for p in map(promql.load_json, promql.dashboard_paths())}
    for found in variables.values():
        assert found == {
            "job": [JOB],
            "run_id": [RUN_ID],
            "instance": [node.target],
            "rank": [str(r) for r in range(NUM_RANKS)],
        }


def test_every_panel_and_annotation_query_returns_data(
    evaluated: tuple[dict[str, dict[str, list[str]]], list[Outcome]],
) -> None:
    _, outcomes = evaluated
    expected = sum(len(promql.queries(promql.load_json(p))) for p in promql.dashboard_paths())
    assert len(outcomes) == 2 * expected
    empty = [o.describe() for o in outcomes if o.error or o.num_series < 1]
    assert not empty, "queries without data:\n" + "\n".join(empty)
    # The fake's values advance every scrape, so every rate, ratio and quantile is a number.
    not_finite = [o.describe() for o in outcomes if o.num_finite < 1]
    assert not not_finite, "queries without a finite value:\n" + "\n".join(not_finite)


def test_per_rank_panels_split_by_rank(
    evaluated: tuple[dict[str, dict[str, list[str]]], list[Outcome]],
) -> None:
    # A query whose legend names the rank must show one series per rank with All selected, and
    # exactly one with the first rank selected: the $rank filter really filters.
    _, outcomes = evaluated
    checked = 0
    for o in outcomes:
        if "{{rank}}" not in o.query.legend:
            continue
        checked += 1
        want = NUM_RANKS if o.selection == "all" else 1
        assert o.num_series == want, o.describe()
    assert checked >= 6


def test_every_rule_evaluates_without_error(prom: PrometheusServer) -> None:
    expected = {
        r.get("record") or r.get("alert") for p in promql.RULE_FILES for r in promql.rules(p)
    }
    deadline = time.monotonic() + 15
    while True:
        rules = prom.rules()
        evaluated = [r for r in rules if r.get("lastEvaluation", "").startswith("2")]
        if len(evaluated) == len(rules) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert {r["name"] for r in rules} == expected
    broken = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not broken, broken
