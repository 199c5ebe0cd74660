"""The node's Prometheus collector: rank snapshots and node state, merged at scrape time.

See [Note: one endpoint per node, ranks publish snapshots] in `daemon/metrics.py`.
`SnapshotAggregator` reads the rank snapshot files and keeps counters monotonic across worker
restarts; `NodeCollector` turns that and the `NodeState` into metric families following
`metrics.CATALOG` and [Note: labels and scopes] there (every series labelled `run_id`; per-rank,
once-per-node and summed families); `config_values` gives the `trainingd_config_*` gauges;
`make_registry` builds the injected `CollectorRegistry` the HTTP server serves.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from daemon.metrics import CATALOG, DAEMON_STATES, MetricKind, MetricSpec, Scope
from daemon.observe.hangs import HangLedger
from daemon.observe.state import ENDED_PHASES, NodePhase, NodeState
from daemon.observe.stragglers import StragglerLedger
from daemon.rundir.snapshot import RankPhase, read_snapshot, snapshot_path

if TYPE_CHECKING:
    from daemon.config import DaemonConfig

__all__ = ["NodeCollector", "RankView", "SnapshotAggregator", "config_values", "make_registry"]


def config_values(cfg: DaemonConfig) -> dict[str, float]:
    """The `trainingd_config_*` gauges of a run: the thresholds its alerts compare against."""
    return {
        "trainingd_config_max_steps": float(cfg.train.max_steps),
        "trainingd_config_ckpt_every_steps": float(cfg.checkpoint.ckpt_every),
        "trainingd_config_heartbeat_timeout_seconds": cfg.observability.heartbeat_timeout_s,
        "trainingd_config_max_restarts": float(cfg.launch.max_restarts),
        "trainingd_config_max_consecutive_save_failures": float(
            cfg.checkpoint.max_consecutive_save_failures
        ),
        "trainingd_config_straggler_threshold_ratio": cfg.observability.straggler_threshold,
    }


@dataclasses.dataclass(kw_only=True, frozen=True)
class RankView:
    """One local rank's latest snapshot with counters made monotonic across restarts."""

    rank: int
    """Global rank of the incarnation that wrote the snapshot."""
    local_rank: int
    """Rank on this node (the snapshot file's key)."""
    pid: int
    """Process that wrote it."""
    restart: int
    """`TORCHELASTIC_RESTART_COUNT` of that process."""
    world_size: int
    """Ranks in the job as that process saw it."""
    phase: RankPhase
    """Where the rank is (`starting`, `loading`, `restoring`, `training`, `stopping`, ...)."""
    counters: dict[str, dict[str, float]]
    """Counter values by name and label value, including earlier incarnations."""
    gauges: dict[str, dict[str, float]]
    """Gauge values of the current incarnation."""
    histograms: dict[str, dict[str, tuple[list[int], float]]]
    """Per-bucket counts and sum by name and label value, including earlier incarnations."""

    def gauge(self, name: str, label: str = "") -> float | None:
        """A gauge value, or None when the rank has not reported it."""
        return self.gauges.get(name, {}).get(label)


def _add_counters(
    base: dict[str, dict[str, float]], more: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    out = {k: dict(v) for k, v in base.items()}
    for name, series in more.items():
        dest = out.setdefault(name, {})
        for label, value in series.items():
            dest[label] = dest.get(label, 0.0) + value
    return out


def _add_histograms(
    base: dict[str, dict[str, tuple[list[int], float]]], more: dict[str, Any]
) -> dict[str, dict[str, tuple[list[int], float]]]:
    out = {k: dict(v) for k, v in base.items()}
    for name, series in more.items():
        dest = out.setdefault(name, {})
        for label, hist in series.items():
            counts, total = list(hist["counts"]), float(hist["sum"])
            if label in dest and len(dest[label][0]) == len(counts):
                old_counts, old_total = dest[label]
                counts = [a + b for a, b in zip(old_counts, counts, strict=True)]
                total += old_total
            dest[label] = (counts, total)
    return out


class SnapshotAggregator:
    """Reads the local ranks' snapshot files; thread-safe.

    Args:
        run_dir: the per-run directory the ranks publish into.
        local_ranks: number of local ranks (files `local-0.json` ... `local-{n-1}.json`).
    """

    def __init__(self, run_dir: Path, local_ranks: int) -> None:
        self._paths = [snapshot_path(run_dir, k) for k in range(local_ranks)]
        self._lock = threading.Lock()
        self._last: dict[int, dict[str, Any]] = {}
        self._base_counters: dict[int, dict[str, dict[str, float]]] = {}
        self._base_histograms: dict[int, dict[str, dict[str, tuple[list[int], float]]]] = {}

    def refresh(self) -> list[RankView]:
        """Read every snapshot now and return the local ranks that have published one."""
        views = []
        with self._lock:
            for local_rank, path in enumerate(self._paths):
                data = read_snapshot(path)
                if data is None:
                    data = self._last.get(local_rank)
                    if data is None:
                        continue
                prev = self._last.get(local_rank)
                if prev is not None and prev["pid"] != data["pid"]:
                    # A new incarnation of this local rank: fold the old one's totals into the base.
                    self._base_counters[local_rank] = _add_counters(
                        self._base_counters.get(local_rank, {}), prev["counters"]
                    )
                    self._base_histograms[local_rank] = _add_histograms(
                        self._base_histograms.get(local_rank, {}), prev["histograms"]
                    )
                self._last[local_rank] = data
                views.append(
                    RankView(
                        rank=int(data["rank"]),
                        local_rank=local_rank,
                        pid=int(data["pid"]),
                        restart=int(data["restart"]),
                        world_size=int(data["world_size"]),
                        phase=data["phase"],
                        counters=_add_counters(
                            self._base_counters.get(local_rank, {}), data["counters"]
                        ),
                        gauges=data["gauges"],
                        histograms=_add_histograms(
                            self._base_histograms.get(local_rank, {}), data["histograms"]
                        ),
                    )
                )
        return views


class NodeCollector(Collector):
    """Exports `metrics.CATALOG` for this node at scrape time.

    Args:
        aggregator: the local ranks' snapshots.
        state: the node's lifecycle state.
        build_labels: labels of `trainingd_build_info` (`metrics.build_info_labels`).
        run_id: value of the `run_id` label on every series.
        config: the `trainingd_config_*` values (`config_values`); missing ones export 0.
        tier_bytes: bytes the node's memory tier holds by kind (`local`, `replica`), read at
            each scrape (`daemon.agent.memory_dir.NodeMemoryDir.tier_bytes`); None: 0.
        replica_values: the `trainingd_memory_replica_*` families' values, by family and
            label value ("" without a label), read at each scrape
            (`daemon.agent.replica.ReplicaService.values`); None: 0.
        hangs: the hang detector's ledger (`trainingd_rank_hung`, `trainingd_rank_hangs_total`,
            per rank that published); None: 0.
        failure_counts: rank failures by reason (`trainingd_rank_failures_total`), read at each
            scrape (`daemon.agent.failures.FailureTracker.counts`); None: 0.
        stragglers: the straggler watch's ledger (`trainingd_rank_straggler_episodes_total`,
            per rank that published); None: 0.
        incident_counts: incidents by kind (`trainingd_daemon_incidents_total`), read at each scrape
            (`daemon.observe.incidents.IncidentLog.counts`); None: 0.
    """

    def __init__(
        self,
        aggregator: SnapshotAggregator,
        state: NodeState,
        build_labels: dict[str, str],
        *,
        run_id: str,
        config: dict[str, float] | None = None,
        tier_bytes: Callable[[], Mapping[str, float]] | None = None,
        replica_values: Callable[[], Mapping[str, Mapping[str, float]]] | None = None,
        hangs: HangLedger | None = None,
        failure_counts: Callable[[], Mapping[str, float]] | None = None,
        stragglers: StragglerLedger | None = None,
        incident_counts: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        self._incident_counts = incident_counts
        if not run_id:
            raise ValueError("run_id is empty: pass DaemonConfig.run_id")
        self._aggregator = aggregator
        self._state = state
        self._build_labels = dict(build_labels)
        self._run_id = run_id
        self._config = dict(config or {})
        self._tier_bytes = tier_bytes
        self._replica_values = replica_values
        self._hangs = hangs if hangs is not None else HangLedger()
        self._failure_counts = failure_counts
        self._stragglers = stragglers if stragglers is not None else StragglerLedger()

    def describe(self) -> Iterable[Metric]:
        """Empty families with the catalog's names (lets the registry detect duplicates)."""
        return [_family(s) for s in CATALOG]

    def collect(self) -> Iterator[Metric]:
        """Build every family from the current node state and rank snapshots."""
        views = self._aggregator.refresh()
        status = self._state.status()
        # JOB families come from the lowest local rank that published (all ranks agree).
        first = min(views, key=lambda v: v.local_rank, default=None)
        step = first.gauge("trainingd_train_step") if first is not None else None
        max_steps = self._config.get("trainingd_config_max_steps")
        reached = step is not None and max_steps is not None and step >= max_steps
        node_values: dict[str, float] = {
            "trainingd_daemon_ready": float(status.ready),
            "trainingd_daemon_finished": float(status.phase in ENDED_PHASES or reached),
            "trainingd_daemon_heartbeat_timestamp_seconds": status.heartbeat_unix_s,
            "trainingd_daemon_start_timestamp_seconds": status.start_unix_s,
            "trainingd_daemon_world_size": float(status.world_size),
            "trainingd_daemon_local_ranks": float(status.local_ranks),
            "trainingd_daemon_restarts_total": float(status.restarts),
        }
        run = [self._run_id]
        replica = self._replica_values() if self._replica_values is not None else {}
        for s in CATALOG:
            fam: Metric
            if s.name == "trainingd_build_info":
                names = ["run_id", *self._build_labels]
                info = GaugeMetricFamily(s.name, s.help, labels=names)
                info.add_metric(run + list(self._build_labels.values()), 1.0)
                fam = info
            elif s.name == "trainingd_daemon_state":
                states = GaugeMetricFamily(s.name, s.help, labels=list(s.labelnames))
                for value in DAEMON_STATES:
                    states.add_metric([*run, value], float(NodePhase(value) is status.phase))
                fam = states
            elif s.name == "trainingd_memory_tier_bytes":
                tier = GaugeMetricFamily(s.name, s.help, labels=list(s.labelnames))
                held = self._tier_bytes() if self._tier_bytes is not None else {}
                for kind in s.label_values:
                    tier.add_metric([*run, kind], float(held.get(kind, 0.0)))
                fam = tier
            elif s.name.startswith("trainingd_memory_replica_"):
                fam = _family(s)
                values = replica.get(s.name, {})
                for lv in s.label_values or ("",):
                    labels = [*run, lv] if s.label else run
                    fam.add_metric(labels, float(values.get(lv, 0.0)))  # type: ignore[attr-defined]
            elif s.name in _HANG_FAMILIES:
                # Per rank, from the daemon's hang detector (not the rank's own snapshot).
                fam = _family(s)
                hang_value = (
                    self._hangs.hung if s.name == "trainingd_rank_hung" else self._hangs.num_hangs
                )
                for view in views:
                    ids = [*run, str(view.rank), str(view.local_rank)]
                    fam.add_metric(ids, float(hang_value(view.rank)))  # type: ignore[attr-defined]
            elif s.name == "trainingd_rank_failures_total":
                fam = _family(s)
                counts = self._failure_counts() if self._failure_counts is not None else {}
                for reason in s.label_values:
                    fam.add_metric([*run, reason], float(counts.get(reason, 0.0)))  # type: ignore[attr-defined]
            elif s.name == "trainingd_daemon_incidents_total":
                fam = _family(s)
                counts = self._incident_counts() if self._incident_counts is not None else {}
                for kind in s.label_values:
                    fam.add_metric([*run, kind], float(counts.get(kind, 0.0)))  # type: ignore[attr-defined]
            elif s.name == "trainingd_rank_straggler_episodes_total":
                # Per rank, from the daemon's straggler watch.
                fam = _family(s)
                for view in views:
                    ids = [*run, str(view.rank), str(view.local_rank)]
                    episodes = float(self._stragglers.num_episodes(view.rank))
                    fam.add_metric(ids, episodes)  # type: ignore[attr-defined]
            elif s.scope is Scope.NODE:
                node_cls = (
                    CounterMetricFamily if s.kind is MetricKind.COUNTER else GaugeMetricFamily
                )
                node = node_cls(s.name, s.help, labels=list(s.labelnames))
                node.add_metric(run, node_values.get(s.name, self._config.get(s.name, 0.0)))
                fam = node
            elif s.scope is Scope.RANK:
                fam = _family(s)
                for view in views:
                    _add_samples(fam, s, view, [*run, str(view.rank), str(view.local_rank)])
            elif s.scope is Scope.JOB:
                fam = _family(s)
                if first is not None:
                    _add_samples(fam, s, first, run)
            else:
                fam = _family(s)
                if views:
                    _add_samples(fam, s, _summed(s, views), run)
            yield fam


_HANG_FAMILIES = frozenset({"trainingd_rank_hung", "trainingd_rank_hangs_total"})


def _summed(s: MetricSpec, views: list[RankView]) -> RankView:
    """A view holding family `s` summed over `views` (counters and histograms)."""
    counters: dict[str, float] = {}
    hists: dict[str, tuple[list[int], float]] = {}
    for view in views:
        for lv, value in view.counters.get(s.name, {}).items():
            counters[lv] = counters.get(lv, 0.0) + value
        for lv, (counts, total) in view.histograms.get(s.name, {}).items():
            if len(counts) != len(s.buckets) + 1:
                continue  # written by a build with other bucket edges
            old_counts, old_total = hists.get(lv, ([0] * len(counts), 0.0))
            summed = [a + b for a, b in zip(old_counts, counts, strict=True)]
            hists[lv] = (summed, old_total + total)
    head = views[0]
    return dataclasses.replace(
        head, counters={s.name: counters}, gauges={}, histograms={s.name: hists}
    )


def _go_float(edge: float) -> str:
    # The `le` label is written the way Go's client does: "0.5", "1.0", "+Inf".
    return "+Inf" if math.isinf(edge) else repr(float(edge))


def _family(s: MetricSpec) -> Metric:
    labels = list(s.labelnames)
    if s.kind is MetricKind.COUNTER:
        return CounterMetricFamily(s.name, s.help, labels=labels)
    if s.kind is MetricKind.GAUGE:
        return GaugeMetricFamily(s.name, s.help, labels=labels)
    return HistogramMetricFamily(s.name, s.help, labels=labels)


def _add_samples(fam: Metric, s: MetricSpec, view: RankView, ids: list[str]) -> None:
    label_values = s.label_values or ("",)
    if s.kind is MetricKind.COUNTER:
        assert isinstance(fam, CounterMetricFamily)
        series = view.counters.get(s.name, {})
        for lv in sorted(set(label_values) | set(series)):
            fam.add_metric(ids + ([lv] if s.label else []), series.get(lv, 0.0))
    elif s.kind is MetricKind.GAUGE:
        assert isinstance(fam, GaugeMetricFamily)
        for lv, value in sorted(view.gauges.get(s.name, {}).items()):
            fam.add_metric(ids + ([lv] if s.label else []), value)
    else:
        assert isinstance(fam, HistogramMetricFamily)
        hists = view.histograms.get(s.name, {})
        for lv in sorted(set(label_values) | set(hists)):
            counts, total = hists.get(lv, ([0] * (len(s.buckets) + 1), 0.0))
            if len(counts) != len(s.buckets) + 1:
                continue  # written by a build with other bucket edges
            cumulative, buckets = 0, []
            for edge, count in zip((*s.buckets, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append((_go_float(edge), float(cumulative)))
            fam.add_metric(ids + ([lv] if s.label else []), buckets, total)


def make_registry(collector: NodeCollector, *, process_metrics: bool = True) -> CollectorRegistry:
    """A fresh registry serving `collector` (plus the daemon's `process_*` series if asked)."""
    from prometheus_client import PlatformCollector, ProcessCollector

    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    if process_metrics:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
    return registry
