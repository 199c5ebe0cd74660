"""The metric catalog, rank snapshots and the node collector, parsed like Prometheus would."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ckpt_manager import ManagerStats, SaveReport, SaveResult
from daemon.config import CheckpointSettings, DaemonConfig, TrainSettings
from daemon.metrics import (
    CATALOG,
    RANK_FAILURE_REASONS,
    MetricKind,
    MetricSpec,
    Scope,
    build_info_labels,
    spec,
)
from daemon.observe.collector import NodeCollector, SnapshotAggregator, config_values, make_registry
from daemon.observe.state import NodePhase, NodeState
from daemon.rank.telemetry import NullTelemetry, RankTelemetry
from daemon.rundir.snapshot import RankPhase, snapshot_path
from tests.support.metric_names import ISSUE_METRICS

REQUIRED = set(ISSUE_METRICS)

# `val`: the validation loss and its step (issue #31 names `trainingd_val_loss`).
_NAME = re.compile(
    r"^trainingd_(daemon|train|fsdp|ckpt|memory|rank|build|config|gpu|val)_[a-z0-9_]+$"
)
_UNITS = ("_seconds", "_bytes", "_total", "_ratio", "_depth", "_step", "_info", "_loss",
          "_norm", "_rate", "_size", "_ranks", "_state", "_ready", "_inflight", "_finished",
          "_steps", "_restarts", "_failures", "_peak", "_bound",
          # A 0/1 state like _ready and _finished: the rank is declared hung (issue #30 names it).
          "_hung",
          # A ratio to the median rank's compute time (issue #30 names it `..._straggler_score`).
          "_score",
          # A rate gauge: tokens/s of the last step (issue #17 names it), not a counter's rate.
          "_per_second")  # fmt: skip


def test_catalog_names_follow_conventions() -> None:
    names = [s.name for s in CATALOG]
    assert len(names) == len(set(names))
    assert set(names) >= REQUIRED
    for s in CATALOG:
        assert _NAME.match(s.name), s.name
        assert s.name.endswith(_UNITS), f"{s.name}: unit suffix?"
        assert "percent" not in s.name
        assert "millis" not in s.name
        if s.kind is MetricKind.HISTOGRAM:
            assert 8 <= len(s.buckets) <= 15, s.name
            # Never the client's web defaults (5 ms .. 10 s).
            assert s.buckets != (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
                                 2.5, 5.0, 7.5, 10.0)  # fmt: skip
    assert spec("trainingd_fsdp_collective_seconds").label == "op"
    assert spec("trainingd_ckpt_saves_total").label == "result"
    # Restores and recoveries say where the state came from.
    for name in ("trainingd_ckpt_restore_seconds", "trainingd_rank_restart_recovery_seconds"):
        assert spec(name).label == "source"
        assert spec(name).label_values == ("memory", "replica", "durable")
    with pytest.raises(KeyError, match="similar"):
        spec("trainingd_train_stepz")


def test_spec_validation_says_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="end in _total"):
        MetricSpec(name="trainingd_x_things", kind=MetricKind.COUNTER, help="h", scope=Scope.RANK)
    with pytest.raises(ValueError, match="ascending"):
        MetricSpec(
            name="trainingd_x_seconds",
            kind=MetricKind.HISTOGRAM,
            help="h",
            scope=Scope.RANK,
            buckets=(2.0, 1.0),
        )


@dataclasses.dataclass
class _Totals:
    count: int
    num_bytes: int
    seconds: float


@dataclasses.dataclass
class _ShardingStats:
    allgather_queue_depth: int = 0
    allgather_queue_depth_peak: int = 2
    reduce_queue_depth: int = 0
    reduce_queue_depth_peak: int = 1
    prefetch_hits: int = 7
    prefetch_misses: int = 1
    collectives: dict[str, _Totals] = dataclasses.field(
        default_factory=lambda: {"all_gather": _Totals(3, 4096, 0.01)}
    )
    queue_depth_step_peak: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"allgather": 2, "reduce": 1}
    )
    queue_bound: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"allgather": 5, "reduce": 2}
    )
    queue_depth_at_issue: dict[str, dict[int, int]] = dataclasses.field(
        default_factory=lambda: {"allgather": {1: 4, 2: 3}, "reduce": {1: 6, 5: 1}}
    )


def _report(result: SaveResult) -> SaveReport:
    return SaveReport(
        step=10,
        result=result,
        stall_s=0.02,
        staging_s=0.01,
        write_s=0.3,
        finalize_s=0.004,
        latency_s=0.5,
        num_bytes=1000,
        error=None if result is SaveResult.COMMITTED else "disk full",
    )


def _record_some_work(tel: RankTelemetry) -> None:
    tel.heartbeat(RankPhase.TRAINING)
    tel.inc("trainingd_train_steps_total")
    tel.set("trainingd_train_step", 10)
    tel.observe("trainingd_train_step_duration_seconds", 0.1)  # exactly an edge: le="0.1"
    tel.observe("trainingd_train_step_duration_seconds", 200.0)  # beyond the last edge
    tel.inc("trainingd_train_tokens_total", 512)
    tel.set("trainingd_train_loss", 2.5)
    tel.on_collective("all_gather", 4096, 0.0003)
    tel.update_sharding(_ShardingStats())
    tel.on_save_finished(_report(SaveResult.COMMITTED))
    tel.on_save_finished(_report(SaveResult.FAILED))
    tel.update_checkpoints(
        ManagerStats(
            inflight=1,
            last_committed_step=10,
            last_committed_unix_s=1.7e9,
            num_memory_snapshots_failed=2,
            newest_memory_step=12,
        )
    )
    tel.inc("trainingd_ckpt_saves_total", 1.0, "deferred")  # the loop's DeferredSaves
    tel.observe("trainingd_ckpt_restore_seconds", 0.3, "durable")
    tel.set("trainingd_memory_every_steps", 6)


def _scrape(collector: NodeCollector) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = generate_latest(make_registry(collector, process_metrics=False)).decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def _value(
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str
) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def test_rank_snapshots_become_labelled_series(tmp_path: Path) -> None:
    for local in (0, 1):
        tel = RankTelemetry(snapshot_path(tmp_path, local), rank=2 + local, world_size=4)
        _record_some_work(tel)
        # Local rank 1 disagrees on a job value: only local rank 0's is exported.
        tel.set("trainingd_train_loss", 2.5 + local)
        tel.publish(force=True)
    state = NodeState(local_ranks=2)
    state.update(phase=NodePhase.TRAINING, world_size=4, restarts=1)
    cfg = DaemonConfig(
        train=TrainSettings(max_steps=500), checkpoint=CheckpointSettings(ckpt_every=25)
    )
    collector = NodeCollector(
        SnapshotAggregator(tmp_path, 2),
        state,
        build_info_labels("1.2"),
        run_id="run-a",
        config=config_values(cfg),
        tier_bytes=lambda: {"local": 4096.0, "replica": 1024.0},
    )
    s = _scrape(collector)

    run = {"run_id": "run-a"}
    r1 = {"rank": "3", "local_rank": "1", **run}
    # Job values: once per node, without rank labels.
    assert _value(s, "trainingd_train_steps_total", **run) == 1
    assert _value(s, "trainingd_train_step", **run) == 10
    assert _value(s, "trainingd_train_loss", **run) == 2.5
    assert len(s["trainingd_train_loss"]) == 1
    assert _value(s, "trainingd_train_step_duration_seconds_bucket", le="0.05", **run) == 0
    assert _value(s, "trainingd_train_step_duration_seconds_bucket", le="0.1", **run) == 1
    assert _value(s, "trainingd_train_step_duration_seconds_bucket", le="128.0", **run) == 1
    assert _value(s, "trainingd_train_step_duration_seconds_bucket", le="+Inf", **run) == 2
    assert _value(s, "trainingd_train_step_duration_seconds_count", **run) == 2
    assert _value(s, "trainingd_train_step_duration_seconds_sum", **run) == pytest.approx(200.1)
    assert _value(s, "trainingd_fsdp_collective_bytes_total", op="all_gather", **run) == 4096
    # Known label values exist at zero before any event.
    assert _value(s, "trainingd_fsdp_collective_bytes_total", op="reduce_scatter", **run) == 0
    assert _value(s, "trainingd_ckpt_saves_total", result="committed", **run) == 1
    assert _value(s, "trainingd_ckpt_saves_total", result="failed", **run) == 1
    assert _value(s, "trainingd_ckpt_saves_total", result="deferred", **run) == 1
    # The memory tier: failed snapshots summed over the node's ranks, the newest step once.
    assert _value(s, "trainingd_memory_snapshot_failures_total", **run) == 4
    assert _value(s, "trainingd_memory_newest_step", **run) == 12
    assert _value(s, "trainingd_ckpt_save_latency_seconds_count", **run) == 1
    assert _value(s, "trainingd_ckpt_last_committed_step", **run) == 10
    assert _value(s, "trainingd_fsdp_queue_bound", queue="reduce", **run) == 2
    assert _value(s, "trainingd_memory_every_steps", **run) == 6
    # The memory tier's bytes come from the daemon (its directory), labelled by kind.
    assert _value(s, "trainingd_memory_tier_bytes", kind="local", **run) == 4096
    assert _value(s, "trainingd_memory_tier_bytes", kind="replica", **run) == 1024
    # A restore is counted under its source; the others exist at zero.
    assert _value(s, "trainingd_ckpt_restore_seconds_count", source="durable", **run) == 2
    assert _value(s, "trainingd_ckpt_restore_seconds_count", source="memory", **run) == 0
    # Node sums: both local ranks.
    assert _value(s, "trainingd_train_tokens_total", **run) == 1024
    assert _value(s, "trainingd_ckpt_bytes_total", **run) == 2000
    assert _value(s, "trainingd_fsdp_collective_seconds_count", op="all_gather", **run) == 2
    # Per rank.
    assert _value(s, "trainingd_fsdp_prefetch_hits_total", **r1) == 7
    assert _value(s, "trainingd_fsdp_queue_depth_step_peak", queue="allgather", **r1) == 2
    wait = _value(s, "trainingd_fsdp_collective_wait_seconds_total", op="all_gather", **r1)
    assert wait == pytest.approx(0.01)
    depth = "trainingd_fsdp_queue_issue_depth"
    assert _value(s, f"{depth}_bucket", queue="reduce", le="1.0", **r1) == 6
    assert _value(s, f"{depth}_bucket", queue="reduce", le="4.0", **r1) == 6
    assert _value(s, f"{depth}_bucket", queue="reduce", le="6.0", **r1) == 7
    assert _value(s, f"{depth}_sum", queue="reduce", **r1) == 11
    # Node values and the job's thresholds.
    assert _value(s, "trainingd_daemon_state", state="training", **run) == 1
    assert _value(s, "trainingd_daemon_state", state="draining", **run) == 0
    assert _value(s, "trainingd_daemon_ready", **run) == 1
    assert _value(s, "trainingd_daemon_finished", **run) == 0
    assert _value(s, "trainingd_daemon_world_size", **run) == 4
    assert _value(s, "trainingd_daemon_restarts_total", **run) == 1
    assert _value(s, "trainingd_config_ckpt_every_steps", **run) == 25
    assert _value(s, "trainingd_config_max_steps", **run) == 500
    assert _value(s, "trainingd_config_heartbeat_timeout_seconds", **run) == 300
    info = next(iter(s["trainingd_build_info"]))
    assert ("version", "1.2") in info
    # Every series says which run it belongs to.
    for name, series in s.items():
        for labels in series:
            assert ("run_id", "run-a") in labels, name
    assert {"trainingd_" + n.removeprefix("trainingd_") for n in REQUIRED} <= {
        n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in s
    }
    # A node that is draining, or whose ranks reached max_steps, is finished (never pages).
    state.update(phase=NodePhase.DRAINING)
    assert _value(_scrape(collector), "trainingd_daemon_finished", **run) == 1
    state.update(phase=NodePhase.TRAINING)
    done = NodeCollector(
        SnapshotAggregator(tmp_path, 2),
        state,
        {"version": "x"},
        run_id="run-a",
        config=config_values(dataclasses.replace(cfg, train=TrainSettings(max_steps=10))),
    )
    assert _value(_scrape(done), "trainingd_daemon_finished", **run) == 1


def test_a_collector_needs_a_run_id(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run_id is empty"):
        NodeCollector(SnapshotAggregator(tmp_path, 1), NodeState(local_ranks=1), {}, run_id="")


def test_counters_stay_monotonic_across_a_worker_restart(tmp_path: Path) -> None:
    path = snapshot_path(tmp_path, 0)
    state = NodeState(local_ranks=1)
    collector = NodeCollector(SnapshotAggregator(tmp_path, 1), state, {"version": "x"}, run_id="r")
    first = RankTelemetry(path, rank=0, world_size=1)
    first.inc("trainingd_train_steps_total", 5)
    first.observe("trainingd_train_step_duration_seconds", 0.3)
    first.publish(force=True)
    assert _value(_scrape(collector), "trainingd_train_steps_total", run_id="r") == 5
    second = RankTelemetry(path, rank=0, world_size=1, restart=1)
    second._identity["pid"] = os.getpid() + 1  # a new incarnation of local rank 0
    second.inc("trainingd_train_steps_total", 2)
    second.observe("trainingd_train_step_duration_seconds", 0.3)
    second.publish(force=True)
    s = _scrape(collector)
    assert _value(s, "trainingd_train_steps_total", run_id="r") == 7
    assert _value(s, "trainingd_train_step_duration_seconds_count", run_id="r") == 2


def test_publish_is_rate_limited_and_atomic(tmp_path: Path) -> None:
    now = [100.0]
    tel = RankTelemetry(snapshot_path(tmp_path, 0), rank=0, world_size=1, publish_interval_s=60)
    assert tel.publish()
    assert not tel.publish()
    assert tel.publish(force=True)
    assert [p.name for p in (tmp_path / "ranks").iterdir()] == ["local-0.json"]
    off = RankTelemetry(None, rank=0, world_size=1, clock=lambda: now[0])
    off.inc("trainingd_train_steps_total")
    assert not off.publish(force=True)
    assert off.snapshot()["counters"]["trainingd_train_steps_total"] == {"": 1.0}


def test_null_telemetry_mirrors_rank_telemetry() -> None:
    # Every RankTelemetry method the loop or an engine may call, with the same signature;
    # only reading back what was recorded (snapshot, phase) has no null form.
    public = {n for n in vars(RankTelemetry) if not n.startswith("_")} - {"snapshot", "phase"}
    null = NullTelemetry()
    assert {n for n in vars(NullTelemetry) if not n.startswith("_")} == public
    for name in public:
        real = inspect.signature(getattr(RankTelemetry, name))
        assert inspect.signature(getattr(NullTelemetry, name)) == real, name
    assert isinstance(null.started_unix_s, float)
    null.inc("trainingd_train_steps_total")
    null.observe("trainingd_train_step_duration_seconds", 0.1)
    null.heartbeat(RankPhase.TRAINING)
    null.on_collective("all_gather", 1024, 0.001)
    assert not null.publish(force=True)


def test_rank_failures_are_exported_by_reason_zero_from_the_start(tmp_path: Path) -> None:
    counts: dict[str, float] = {}
    collector = NodeCollector(
        SnapshotAggregator(tmp_path, 1),
        NodeState(local_ranks=1),
        {},
        run_id="r",
        failure_counts=lambda: counts,
    )
    name = "trainingd_rank_failures_total"
    s = _scrape(collector)
    assert {dict(k)["reason"]: v for k, v in s[name].items()} == dict.fromkeys(
        RANK_FAILURE_REASONS, 0.0
    )
    counts["exception"] = 2.0
    assert _value(_scrape(collector), name, run_id="r", reason="exception") == 2.0
