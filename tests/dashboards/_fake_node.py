"""A stand-in for a trainingd node's `/metrics`: every family of `daemon.metrics.CATALOG`.

The families, their types, label names, pre-created label values and histogram buckets come
from the daemon's catalog, so this exporter cannot drift from what the daemon declares. Values
advance on every scrape (counters grow, each histogram gets one observation per series,
timestamps are "now"), so rates, ratios and quantiles over a few scrapes are finite numbers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from daemon.metrics import CATALOG, MetricKind, MetricSpec

RUN_ID = "fake-run"
"""The `run_id` label of every series the fake node serves."""
_BUILD_LABELS = {"version": "0.0.0-test", "torch": "test", "cuda": "none", "python": "3"}


class FakeNodeCollector(Collector):
    """Every catalog family for `num_ranks` local ranks, advancing on each collect()."""

    def __init__(self, catalog: Sequence[MetricSpec] = CATALOG, num_ranks: int = 2) -> None:
        self._catalog = tuple(catalog)
        self._ranks = range(num_ranks)
        self._lock = threading.Lock()
        self._scrapes = 0

    def describe(self) -> Iterable[Metric]:
        """Nothing: the registry need not check for duplicates of a test collector."""
        return []

    def collect(self) -> Iterator[Metric]:
        """One scrape's families."""
        with self._lock:
            self._scrapes += 1
            n = self._scrapes
        now = time.time()
        for spec in self._catalog:
            yield self._family(spec, n, now)

    def _label_sets(self, spec: MetricSpec) -> list[list[str]]:
        own = list(spec.label_values or ("any",)) if spec.label else [None]
        run = [RUN_ID]
        ids = [[*run, str(r), str(r)] for r in self._ranks] if spec.per_rank else [run]
        return [base + ([v] if v is not None else []) for base in ids for v in own]

    def _family(self, spec: MetricSpec, n: int, now: float) -> Metric:
        if spec.name == "trainingd_build_info":
            info = GaugeMetricFamily(spec.name, spec.help, labels=["run_id", *_BUILD_LABELS])
            info.add_metric([RUN_ID, *_BUILD_LABELS.values()], 1.0)
            return info
        labels = list(spec.labelnames)
        if spec.kind is MetricKind.COUNTER:
            counter = CounterMetricFamily(spec.name, spec.help, labels=labels)
            for i, values in enumerate(self._label_sets(spec)):
                counter.add_metric(values, float(n * (10 + i)))
            return counter
        if spec.kind is MetricKind.GAUGE:
            gauge = GaugeMetricFamily(spec.name, spec.help, labels=labels)
            for i, values in enumerate(self._label_sets(spec)):
                if spec.name.endswith("_timestamp_seconds"):
                    value = now - 1.0
                elif spec.label == "state":
                    # Enum-like gauges (one series per state): the first value is current.
                    value = 1.0 if values[-1] == spec.label_values[0] else 0.0
                else:
                    value = float(n + i)
                gauge.add_metric(values, value)
            return gauge
        hist = HistogramMetricFamily(spec.name, spec.help, labels=labels)
        middle = spec.buckets[len(spec.buckets) // 2]
        for values in self._label_sets(spec):
            buckets = [(_le(edge), float(n if edge >= middle else 0)) for edge in spec.buckets]
            buckets.append(("+Inf", float(n)))
            hist.add_metric(values, buckets, n * middle)
        return hist


def _le(edge: float) -> str:
    return repr(float(edge))


class FakeNode:
    """Serves a `FakeNodeCollector` on 127.0.0.1 (a free port) until `stop()`."""

    def __init__(self, num_ranks: int = 2) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(FakeNodeCollector(num_ranks=num_ranks))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def target(self) -> str:
        """`host:port` for a scrape config."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> FakeNode:
        """Start serving `/metrics`."""
        self._server, self._thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.port = self._server.server_port
        return self

    def stop(self) -> None:
        """Stop the server and join its thread."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None
