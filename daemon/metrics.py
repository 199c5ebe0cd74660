"""The metric catalog of trainingd: every family a node exports, declared once.

Every series a trainingd node exports is declared here, once, as a `MetricSpec`: its full name
(`trainingd_<subsystem>_<name>_<unit>`, base units, counters ending in `_total`), its type, its
help text, its labels and, for histograms, bucket edges chosen for the quantity (never the web
defaults). Ranks record under these names (`daemon/rank/telemetry.py`), the daemon's collector
exports them (`daemon/observe/collector.py`); dashboards, alerts and tests import `CATALOG`
instead of repeating names.

[Note: one endpoint per node, ranks publish snapshots]
Ranks are child processes of torch's elastic agent, which runs inside the daemon. We do not give
each rank its own port (N scrape targets, health split across processes) and we do not use
prometheus_client's multiprocess mode (no custom collectors, `pid` labels that churn on every
elastic restart, mmap files per process). Instead each rank records into plain Python numbers
(`daemon.rank.telemetry.RankTelemetry`: a dict update and a `bisect` per event, under one
uncontended lock because the engines' observers may report from their own threads, such as the
checkpoint manager's finalize thread; no Prometheus objects) and, at most every
`publish_interval_s` and at step boundaries, writes one small JSON snapshot of its cumulative
values to `<run_dir>/ranks/local-<k>.json` (temp file + `os.replace`, so a reader never sees half a
file; `daemon/rundir/snapshot.py`). The daemon owns the only `CollectorRegistry`;
`daemon.observe.collector.NodeCollector.collect()` reads the snapshots at scrape time and labels
each rank's series with `rank`/`local_rank`. Why files and not a socket or a queue: they survive
the elastic agent restarting the workers (the daemon never has to re-wire anything), a crashed
rank's last values stay readable, the rank never blocks on a slow scraper, and the same directory
works under plain `torchrun`. Staleness is bounded by the publish interval. Counters stay monotonic
across worker restarts: when a snapshot's `pid` changes, the collector folds the previous
incarnation's last values into a per-local-rank base (the increments of a crashed rank's last
unpublished interval are lost; Prometheus' `rate()` is correct either way).

[Note: labels and scopes] Every series carries `run_id` (`DaemonConfig.run_id`, the same on
all nodes of a run), so dashboards and alerts group by run and two runs scraped as one job are
never averaged together. Each family has a `Scope` saying where its value comes from and so
which further labels it has:
  RANK      values that differ between ranks (heartbeats, queue depths, collective waits,
            prefetch): one series per rank, labelled `rank` and `local_rank`.
  JOB       values every rank of the run agrees on (step, loss, LR, grad norm, saves, last
            commit): exported once per node, from the lowest local rank that published.
  NODE_SUM  counters/histograms whose per-rank split says little (tokens, data wait, collective
            and checkpoint latencies): summed over the node's local ranks.
  NODE      the daemon's own state and the job's configured thresholds (`trainingd_config_*`,
            what the alerts compare against).
This keeps a rank's own series to about 30 whatever the catalog's size (issue #15: ~211 per rank
before, most identical on every rank); a test counts them on a real scrape. Step numbers and
paths never become labels.
"""

from __future__ import annotations

import dataclasses
import enum
import platform
import sys
from typing import Any

__all__ = [
    "CATALOG",
    "DAEMON_STATES",
    "INCIDENT_KINDS",
    "QUEUE_DEPTH_BUCKETS",
    "RANK_FAILURE_REASONS",
    "RANK_LABELS",
    "REPLICA_FAILURE_REASONS",
    "RUN_LABEL",
    "MetricKind",
    "MetricSpec",
    "Scope",
    "build_info_labels",
    "spec",
]


class MetricKind(enum.StrEnum):
    """Prometheus metric type of a catalog entry."""

    COUNTER = "counter"
    """Monotonic total; the name ends in `_total`."""
    GAUGE = "gauge"
    """A value that goes up and down, or a timestamp."""
    HISTOGRAM = "histogram"
    """Bucketed observations with `_bucket`, `_sum`, `_count` samples."""


class Scope(enum.StrEnum):
    """Where a family's values come from (see [Note: labels and scopes])."""

    RANK = "rank"
    """One series per local rank, labelled `rank` and `local_rank`."""
    JOB = "job"
    """A value all ranks agree on, exported once per node from the lowest local rank."""
    NODE_SUM = "node_sum"
    """A rank counter or histogram summed over the node's local ranks."""
    NODE = "node"
    """The daemon's own state or the job's configuration."""


RUN_LABEL = "run_id"
"""Label every trainingd series carries first: the run it belongs to."""
RANK_LABELS: tuple[str, ...] = ("rank", "local_rank")
"""Labels every per-rank series carries, in this order, after `run_id` and before `label`."""

DAEMON_STATES: tuple[str, ...] = (
    "starting",
    "rendezvous",
    "loading",
    "training",
    "checkpointing",
    "draining",
    "stopped",
)
"""Values of the `state` label of `trainingd_daemon_state` (lifecycle of a node)."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class MetricSpec:
    """One exported metric family."""

    name: str
    """Full metric name, including `_total` for counters."""
    kind: MetricKind
    """Counter, gauge or histogram."""
    help: str
    """One-line description shown in the exposition."""
    scope: Scope
    """Where the value comes from, and so whether series carry `rank` and `local_rank`."""
    label: str | None = None
    """At most one further bounded label (`op`, `result`, `state`, `queue`)."""
    label_values: tuple[str, ...] = ()
    """Values of `label` pre-created at zero so the series exist before the first event."""
    buckets: tuple[float, ...] = ()
    """Upper bucket edges of a histogram, ascending, without `+Inf`."""

    def __post_init__(self) -> None:
        if not self.name.startswith("trainingd_"):
            raise ValueError(f"metric {self.name!r} must start with 'trainingd_'")
        if (self.kind is MetricKind.COUNTER) != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name!r}: counters, and only counters, end in _total")
        if self.kind is MetricKind.HISTOGRAM:
            if not self.buckets or list(self.buckets) != sorted(set(self.buckets)):
                raise ValueError(f"histogram {self.name!r} needs strictly ascending buckets")
        elif self.buckets:
            raise ValueError(f"metric {self.name!r} is not a histogram but has buckets")
        if self.label_values and self.label is None:
            raise ValueError(f"metric {self.name!r} has label_values but no label")

    @property
    def per_rank(self) -> bool:
        """Whether series carry `rank` and `local_rank` (scope `RANK`)."""
        return self.scope is Scope.RANK

    @property
    def from_ranks(self) -> bool:
        """Whether values come from rank snapshots (every scope but `NODE`)."""
        return self.scope is not Scope.NODE

    @property
    def labelnames(self) -> tuple[str, ...]:
        """All label names of a series of this family, in exposition order."""
        base = (RUN_LABEL, *RANK_LABELS) if self.per_rank else (RUN_LABEL,)
        return (*base, self.label) if self.label else base


# Bucket sets, one per quantity (operations.md section 1). Edges sit near the alert thresholds.
_STEP_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
"""Wall time of one optimizer step: tens of ms (small CPU jobs) to minutes (large models)."""
_COLLECTIVE_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
"""Time the engine waited on one collective: 100 us (NVLink) to seconds (a straggler)."""
_DATA_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
"""Time the loop waited for a batch: should stay far below the step time."""
_CKPT_BLOCKING_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    120.0,
)
"""What the training loop paid for a save or a finalize poll: ms (async) to minutes (sync)."""
_CKPT_BACKGROUND_S = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
"""Background checkpoint phases (write, schedule to commit, restore): 100 ms to an hour."""
_MEMORY_SNAPSHOT_S = (
    0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5,
)  # fmt: skip
"""What one memory snapshot cost the training thread: well under 5 ms is the target. Buckets
are 1 ms apart around it: `histogram_quantile` interpolates linearly inside a bucket, and
with 5 and 10 ms adjacent a p99 read 8 ms when 2.6% of snapshots took a little over 5 ms."""
_RECOVERY_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""A restarted rank's start to its first step: seconds from memory, minutes from storage."""
QUEUE_DEPTH_BUCKETS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
"""Depth of an engine queue right after an issue: 1 (nothing overlaps) to 16 (deep prefetch)."""


def _scalar(
    kind: MetricKind,
    name: str,
    help_: str,
    *,
    scope: Scope = Scope.RANK,
    label: str | None = None,
    values: tuple[str, ...] = (),
) -> MetricSpec:
    return MetricSpec(
        name=name,
        kind=kind,
        help=help_,
        scope=scope,
        label=label,
        label_values=values,
    )


def _c(name: str, help_: str, **kwargs: Any) -> MetricSpec:
    return _scalar(MetricKind.COUNTER, name, help_, **kwargs)


def _g(name: str, help_: str, **kwargs: Any) -> MetricSpec:
    return _scalar(MetricKind.GAUGE, name, help_, **kwargs)


def _h(
    name: str,
    help_: str,
    buckets: tuple[float, ...],
    *,
    scope: Scope = Scope.NODE_SUM,
    label: str | None = None,
    values: tuple[str, ...] = (),
) -> MetricSpec:
    return MetricSpec(
        name=name,
        kind=MetricKind.HISTOGRAM,
        help=help_,
        scope=scope,
        label=label,
        label_values=values,
        buckets=buckets,
    )


_OPS = ("all_gather", "reduce_scatter", "all_reduce")
_RESULTS = ("committed", "failed", "deferred")
_RESTORE_SOURCES = ("memory", "replica", "durable")
_TIER_KINDS = ("local", "replica")
REPLICA_FAILURE_REASONS: tuple[str, ...] = (
    "foreign_run",
    "stale_round",
    "mismatch",
    "checksum",
    "no_space",
    "protocol",
    "connection",
)
"""Values of the `reason` label of `trainingd_memory_replica_failures_total` (the daemon's
`daemon.agent.replica.protocol.Refusal`)."""
_QUEUES = ("allgather", "reduce")
RANK_FAILURE_REASONS: tuple[str, ...] = (
    "config",
    "exception",
    "oom",
    "signal",
    "exit_code",
    "hung",
)
"""Values of the `reason` label of `trainingd_rank_failures_total` (the daemon's
`daemon.agent.failures.FailureReason`)."""
INCIDENT_KINDS: tuple[str, ...] = (
    "rank_failure",
    "hang",
    "straggler",
    "deterministic",
    "peer_lost",
    "store_outage",
)
"""Values of the `kind` label of `trainingd_daemon_incidents_total` (the daemon's
`daemon.observe.incidents.IncidentKind`)."""
_NODE, _JOB, _SUM = Scope.NODE, Scope.JOB, Scope.NODE_SUM

CATALOG: tuple[MetricSpec, ...] = (
    # --- node / daemon ---------------------------------------------------------------------
    _g(
        "trainingd_build_info",
        "Build metadata (labels version, torch, cuda, python); always 1.",
        scope=_NODE,
    ),
    _g(
        "trainingd_daemon_state",
        "1 for the lifecycle state the node is in, 0 for the others.",
        scope=_NODE,
        label="state",
        values=DAEMON_STATES,
    ),
    _g(
        "trainingd_daemon_ready",
        "1 when rendezvous and restore are done (what /readyz says).",
        scope=_NODE,
    ),
    _g(
        "trainingd_daemon_finished",
        "1 once the node's run ended on purpose (max_steps reached, or draining/stopped).",
        scope=_NODE,
    ),
    _g(
        "trainingd_daemon_heartbeat_timestamp_seconds",
        "Unix time of the daemon supervisor loop's last iteration.",
        scope=_NODE,
    ),
    _g(
        "trainingd_daemon_start_timestamp_seconds",
        "Unix time the daemon process started.",
        scope=_NODE,
    ),
    _g(
        "trainingd_daemon_world_size",
        "Ranks in the job (all nodes), as of the last rendezvous.",
        scope=_NODE,
    ),
    _g("trainingd_daemon_local_ranks", "Rank processes this node runs.", scope=_NODE),
    _c(
        "trainingd_daemon_restarts_total",
        "Worker group restarts done by the elastic agent on this node.",
        scope=_NODE,
    ),
    _c(
        "trainingd_rank_failures_total",
        "Rank process failures on this node, by reason (the job or its configuration before "
        "training, an exception, out of memory, a signal, an exit code, a declared hang).",
        scope=_NODE,
        label="reason",
        values=RANK_FAILURE_REASONS,
    ),
    _c(
        "trainingd_daemon_incidents_total",
        "Incidents this node declared, by kind (a rank failure, a hang, a straggler episode, a "
        "deterministic failure, a lost rendezvous store); /api/status tells each one's story.",
        scope=_NODE,
        label="kind",
        values=INCIDENT_KINDS,
    ),
    # --- node: the job's own thresholds (what the alerts compare against) ---------------------
    _g(
        "trainingd_config_max_steps",
        "Configured max_steps: the step at which the run is finished.",
        scope=_NODE,
    ),
    _g(
        "trainingd_config_ckpt_every_steps",
        "Configured ckpt_every: steps between two scheduled saves (0: only on stop).",
        scope=_NODE,
    ),
    _g(
        "trainingd_config_heartbeat_timeout_seconds",
        "Configured heartbeat_timeout_s: a rank silent this long is unhealthy.",
        scope=_NODE,
    ),
    _g(
        "trainingd_config_max_restarts",
        "Configured max_restarts: worker-group restarts before the run fails.",
        scope=_NODE,
    ),
    _g(
        "trainingd_config_max_consecutive_save_failures",
        "Configured max_consecutive_save_failures: failed saves in a row that stop the run.",
        scope=_NODE,
    ),
    _g(
        "trainingd_config_straggler_threshold_ratio",
        "Configured straggler_threshold: a rank's score at or above it names a straggler.",
        scope=_NODE,
    ),
    # --- per rank: liveness ------------------------------------------------------------------
    _g(
        "trainingd_rank_heartbeat_timestamp_seconds",
        "Unix time of the rank's last training-loop heartbeat (step or phase change).",
    ),
    _g(
        "trainingd_rank_recovery_seconds",
        "Rank process start to its first completed step (cost of a start or restart).",
    ),
    # --- per rank: hangs (the daemon's hang detector, `daemon/agent/hang.py`) ---------------
    _g(
        "trainingd_rank_hung",
        "1 while the rank is declared hung (named the cause of a hang), until its restarted "
        "incarnation trains again; 0 otherwise.",
    ),
    _c(
        "trainingd_rank_hangs_total",
        "Hangs the rank was named the cause of (no progress for hang_timeout_s; its group was "
        "restarted).",
    ),
    # --- per rank: stragglers (`daemon/rank/stragglers.py`, `daemon/agent/straggler.py`) ----
    _g(
        "trainingd_rank_straggler_score",
        "The rank's median compute time per step over the straggler window divided by the "
        "median rank's (1: typical; >= straggler_threshold: a straggler; 0: not measured yet).",
        label="node",
    ),
    _g(
        "trainingd_rank_compute_seconds",
        "The rank's median compute time per step over the straggler window: step time less "
        "its waits in collectives (0: not measured yet).",
    ),
    _c(
        "trainingd_rank_straggler_episodes_total",
        "Times the daemon named the rank a straggler (its score reached straggler_threshold).",
    ),
    _h(
        "trainingd_rank_restart_recovery_seconds",
        "A restored rank's process start to its first completed step, by where the state came "
        "from: memory, replica or durable (all local ranks).",
        _RECOVERY_S,
        label="source",
        values=_RESTORE_SOURCES,
    ),
    # --- job: training (every rank agrees; exported once per node) ---------------------------
    _c("trainingd_train_steps_total", "Optimizer steps completed.", scope=_JOB),
    _g(
        "trainingd_train_step",
        "Current optimizer step (completed steps since step 0).",
        scope=_JOB,
    ),
    _h(
        "trainingd_train_step_duration_seconds",
        "Wall time of one optimizer step.",
        _STEP_S,
        scope=_JOB,
    ),
    _h(
        "trainingd_train_data_loading_seconds",
        "Time a step waited for its batches (all local ranks; read ahead by a thread).",
        _DATA_S,
    ),
    _c("trainingd_train_tokens_total", "Tokens processed by this node's ranks.", scope=_SUM),
    _g("trainingd_train_loss", "Training loss of the last step (mean over all ranks).", scope=_JOB),
    _g(
        "trainingd_train_grad_norm",
        "Global gradient norm of the last step, before clipping.",
        scope=_JOB,
    ),
    _g("trainingd_train_learning_rate", "Learning rate used by the last step.", scope=_JOB),
    _g(
        "trainingd_val_loss",
        "Validation loss of the last evaluation (token-weighted mean over all ranks' eval "
        "batches; NaN until the first, exported only with eval_every on).",
        scope=_JOB,
    ),
    _g(
        "trainingd_val_step",
        "Step of the last validation loss (0 until the first evaluation).",
        scope=_JOB,
    ),
    # --- per rank: speed and device (GPU series exist only on CUDA ranks) -------------------
    _g(
        "trainingd_train_tokens_per_second",
        "Tokens this rank trained per second in its last step (its tokens over the step time).",
    ),
    _g(
        "trainingd_train_mfu_ratio",
        "Model FLOPs utilisation of the rank's last step: model FLOP/s over the device's peak.",
    ),
    _g(
        "trainingd_gpu_memory_allocated_bytes",
        "CUDA memory held by live tensors on the rank's GPU (caching allocator).",
    ),
    _g(
        "trainingd_gpu_memory_reserved_bytes",
        "CUDA memory the caching allocator holds on the rank's GPU (allocated plus cached).",
    ),
    _g(
        "trainingd_gpu_memory_max_allocated_bytes",
        "Peak CUDA memory held by live tensors on the rank's GPU since the rank started.",
    ),
    # --- sharding engine ---------------------------------------------------------------------
    _g(
        "trainingd_fsdp_queue_depth_step_peak",
        "Most operations the queue held at once during the rank's last completed step.",
        label="queue",
        values=_QUEUES,
    ),
    _g(
        "trainingd_fsdp_queue_bound",
        "Most operations the queue can hold (max_inflight_reductions; ZeRO-3 units).",
        scope=_JOB,
        label="queue",
        values=_QUEUES,
    ),
    _h(
        "trainingd_fsdp_queue_issue_depth",
        "Depth of the queue right after each issue.",
        QUEUE_DEPTH_BUCKETS,
        scope=Scope.RANK,
        label="queue",
        values=_QUEUES,
    ),
    _c(
        "trainingd_fsdp_prefetch_hits_total",
        "Unshards whose all-gather had already been issued ahead of use.",
    ),
    _c("trainingd_fsdp_prefetch_misses_total", "Unshards that had to issue their all-gather."),
    _c(
        "trainingd_fsdp_collective_wait_seconds_total",
        "Time the rank waited on collectives.",
        label="op",
        values=_OPS,
    ),
    _h(
        "trainingd_fsdp_collective_seconds",
        "Time the engine waited on one collective (all local ranks).",
        _COLLECTIVE_S,
        label="op",
        values=_OPS,
    ),
    _c(
        "trainingd_fsdp_collective_bytes_total",
        "Bytes moved by one rank's collectives (the same on every rank).",
        scope=_JOB,
        label="op",
        values=_OPS,
    ),
    # --- checkpoints ---------------------------------------------------------------------------
    _h(
        "trainingd_ckpt_save_stall_seconds",
        "Time save() blocked the training loop.",
        _CKPT_BLOCKING_S,
        scope=_JOB,
    ),
    _h(
        "trainingd_ckpt_staging_seconds",
        "Copy of the state to host memory for a save (all local ranks).",
        _CKPT_BLOCKING_S,
    ),
    _h(
        "trainingd_ckpt_write_seconds",
        "Background write of one rank's checkpoint files (all local ranks).",
        _CKPT_BACKGROUND_S,
    ),
    _h(
        "trainingd_ckpt_finalize_seconds",
        "Coordination and commit of a save across ranks.",
        _CKPT_BLOCKING_S,
        scope=_JOB,
    ),
    _h(
        "trainingd_ckpt_save_latency_seconds",
        "Save scheduled to save committed (end to end).",
        _CKPT_BACKGROUND_S,
        scope=_JOB,
    ),
    _h(
        "trainingd_ckpt_restore_seconds",
        "Restore at rank start by where the state came from: memory, replica or durable "
        "(all local ranks).",
        _CKPT_BACKGROUND_S,
        label="source",
        values=_RESTORE_SOURCES,
    ),
    _c("trainingd_ckpt_bytes_total", "Checkpoint bytes written by this node's ranks.", scope=_SUM),
    _c(
        "trainingd_ckpt_saves_total",
        "Saves by result: committed, failed, or deferred (due while an earlier save was still "
        "being written; taken at the first step after it).",
        scope=_JOB,
        label="result",
        values=_RESULTS,
    ),
    _g(
        "trainingd_ckpt_consecutive_save_failures",
        "Failed saves since the last commit (the run stops at max_consecutive_save_failures).",
        scope=_JOB,
    ),
    _g("trainingd_ckpt_inflight", "Saves scheduled and not yet finalized.", scope=_JOB),
    _g(
        "trainingd_ckpt_last_committed_step",
        "Step of the newest committed checkpoint.",
        scope=_JOB,
    ),
    _g(
        "trainingd_ckpt_last_committed_timestamp_seconds",
        "Unix time the newest committed checkpoint was committed.",
        scope=_JOB,
    ),
    # --- the memory tier (node memory, held by the daemon) --------------------------------
    _g(
        "trainingd_memory_every_steps",
        "Steps between two memory snapshots in force (auto: the interval chosen; 0: tier off).",
        scope=_JOB,
    ),
    _g(
        "trainingd_memory_tier_bytes",
        "Bytes the node's memory tier holds in memory_dir: its ranks' slots (local) and the "
        "snapshots a peer node streamed here (replica).",
        scope=_NODE,
        label="kind",
        values=_TIER_KINDS,
    ),
    _h(
        "trainingd_memory_snapshot_seconds",
        "Time one memory snapshot blocked the training thread (all local ranks).",
        _MEMORY_SNAPSHOT_S,
    ),
    # --- peer replicas of the memory tier (the daemon's replica ring) ---------------------
    _g(
        "trainingd_memory_replica_lag_steps",
        "Newest complete local memory snapshot minus the newest one the next node acknowledged "
        "as its replica, in steps (max over local ranks; 0 without a peer).",
        scope=_NODE,
    ),
    _c(
        "trainingd_memory_replica_sent_bytes_total",
        "Snapshot bytes streamed to a peer node (replicas acknowledged, and fetches served).",
        scope=_NODE,
    ),
    _c(
        "trainingd_memory_replica_send_seconds_total",
        "Seconds spent streaming those bytes (first byte to last).",
        scope=_NODE,
    ),
    _c(
        "trainingd_memory_replica_received_bytes_total",
        "Snapshot bytes received from peer nodes (replicas held here, and fetched copies).",
        scope=_NODE,
    ),
    _c(
        "trainingd_memory_replica_receive_seconds_total",
        "Seconds spent receiving those bytes (first byte to last).",
        scope=_NODE,
    ),
    _c(
        "trainingd_memory_replica_failures_total",
        "Replicas refused or failed, by reason (another run, a stale round, a mismatch, a bad "
        "checksum, no room, a protocol error, a broken connection).",
        scope=_NODE,
        label="reason",
        values=REPLICA_FAILURE_REASONS,
    ),
    # --- the memory tier: failures and the newest step (issue #29 items 5-7) ---------------
    _c(
        "trainingd_memory_snapshot_failures_total",
        "Memory snapshots that failed (a full tmpfs, a failed copy or meta write; training "
        "goes on with the older snapshot) (all local ranks).",
        scope=_SUM,
    ),
    _g(
        "trainingd_memory_newest_step",
        "Newest step the rank's memory tier holds (snapshotted or restored).",
        scope=_JOB,
    ),
)
"""Every metric family trainingd exports, in exposition order."""

_BY_NAME = {s.name: s for s in CATALOG}


def spec(name: str) -> MetricSpec:
    """Return the catalog entry called `name`.

    Raises:
        KeyError: `name` is not in the catalog (the message lists the close names).
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        prefix = name.rsplit("_", 1)[0]
        close = sorted(n for n in _BY_NAME if n.startswith(prefix))
        raise KeyError(f"unknown metric {name!r}; similar: {close}") from None


def build_info_labels(version: str) -> dict[str, str]:
    """Labels of `trainingd_build_info` for this process (versions of trainingd, torch, Python)."""
    import torch

    return {
        "version": version,
        "torch": str(torch.__version__),
        "cuda": str(torch.version.cuda or "none"),
        "python": platform.python_version(),
        "platform": sys.platform,
    }
