"""The PromQL helpers the dashboard tests rely on find what they must (and nothing else)."""

from __future__ import annotations

import pytest

from tests.dashboards import _promql as promql


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'sum by (job, le) (rate(a_bucket{job=~"$job", x="b{c}"}[$__rate_interval]))',
            {"a_bucket"},
        ),
        ("time() - max by (instance) (b_seconds > 0) > 3600", {"b_seconds"}),
        ("x / on (job) group_left (rank) y and 1e-3 > z unless w offset 5m", {"x", "y", "z", "w"}),
        ("histogram_quantile(0.99, sum(rate(a:b:c[5m]))) >bool 2", {"a:b:c"}),
        ('up{job=~".*trainingd.*"} == 0', {"up"}),
        ("(x != x) or (abs(x) == Inf) or y > NaN", {"x", "y"}),
    ],
)
def test_metric_names(expr: str, names: set[str]) -> None:
    assert promql.metric_names(expr) == names


def test_selectors_parse_matchers_and_ranges() -> None:
    (sel,) = promql.selectors('rate(m_total{job=~"$job", result="failed"}[$__range])')
    assert sel.metric == "m_total"
    assert sel.matchers == {"job": ("=~", "$job"), "result": ("=", "failed")}
    assert sel.range == "$__range"
    (bare,) = promql.selectors('g{a!="b"}')
    assert bare.range is None
    assert bare.matchers == {"a": ("!=", "b")}


def test_variables_are_found_and_substituted() -> None:
    text = 'm{a=~"$job", b=~"${instance}", c=~"${rank:regex}"}[$__rate_interval]'
    assert promql.referenced_variables(text) == {"job", "instance", "rank", "__rate_interval"}
    values = {"job": "j", "instance": "i", "rank": "r", "__rate_interval": "1m"}
    assert promql.substitute(text, values) == 'm{a=~"j", b=~"i", c=~"r"}[1m]'
    with pytest.raises(KeyError, match="rank"):
        promql.substitute("$rank", {})


def test_regex_escape_doubles_backslashes_for_a_promql_string() -> None:
    # Grafana writes `127.0.0.1:80` into a regex matcher as 127\\.0\\.0\\.1:80 in PromQL.
    assert promql.regex_escape("127.0.0.1:80") == r"127\\.0\\.0\\.1:80"
    assert promql.regex_escape("a(b)") == r"a\\(b\\)"


def test_catalog_families_and_labels() -> None:
    family = promql.catalog_family("trainingd_fsdp_collective_seconds_bucket")
    assert family is not None
    assert family.name == "trainingd_fsdp_collective_seconds"
    assert promql.is_cumulative("trainingd_fsdp_collective_seconds_count")
    assert promql.is_cumulative("trainingd_train_steps_total")
    assert not promql.is_cumulative("trainingd_train_step")
    assert promql.catalog_family("trainingd_train_step_bucket") is None
    assert promql.series_labels("trainingd_fsdp_collective_seconds_bucket") == {
        "run_id",
        "op",
        "le",
    }
    assert promql.series_labels("trainingd_fsdp_queue_issue_depth_bucket") == {
        "run_id",
        "rank",
        "local_rank",
        "queue",
        "le",
    }
    assert promql.series_labels("trainingd_build_info") == {"run_id"}
    assert promql.series_labels("run_instance_rank:trainingd_fsdp_prefetch_hit:ratio_rate5m") == {
        "run_id",
        "rank",
    }
    assert promql.series_labels("trainingd_no_such_metric") is None
