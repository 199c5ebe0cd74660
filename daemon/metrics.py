"""The metric catalog of trainingd and the per-node collector that serves it.

Every series a trainingd node exports is declared here, once, as a `MetricSpec`: its full name
(`trainingd_<subsystem>_<name>_<unit>`, base units, counters ending in `_total`), its type, its
help text, its labels and, for histograms, bucket edges chosen for the quantity (never the web
defaults). Dashboards, alerts and tests import `CATALOG` instead of repeating names.

[Note: one endpoint per node, ranks publish snapshots]
Ranks are child processes of torch's elastic agent, which runs inside the daemon. We do not give
each rank its own port (N scrape targets, health split across processes) and we do not use
prometheus_client's multiprocess mode (no custom collectors, `pid` labels that churn on every
elastic restart, mmap files per process). Instead each rank records into plain Python numbers
(`daemon._telemetry.RankTelemetry`: a dict update and a `bisect` per event, no locks, no
Prometheus objects) and, at most every `publish_interval_s` and at step boundaries, writes one
small JSON snapshot of its cumulative values to `<run_dir>/ranks/local-<k>.json` (temp file +
`os.replace`, so a reader never sees half a file). The daemon owns the only `CollectorRegistry`;
`NodeCollector.collect()` reads the snapshots at scrape time and labels each rank's series with
`rank`/`local_rank`. Why files and not a socket or a queue: they survive the elastic agent
restarting the workers (the daemon never has to re-wire anything), a crashed rank's last values
stay readable, the rank never blocks on a slow scraper, and the same directory works under plain
`torchrun`. Staleness is bounded by the publish interval. Counters stay monotonic across worker
restarts: when a snapshot's `pid` changes, the collector folds the previous incarnation's last
values into a per-local-rank base (the increments of a crashed rank's last unpublished interval
are lost; Prometheus' `rate()` is correct either way).

Labelling rule: series that describe one rank carry `rank` and `local_rank` (summing or taking the
max over them is meaningful); series that describe the node (`trainingd_daemon_*`,
`trainingd_build_info`) carry none. Step numbers, paths and run ids never become labels.
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
    "RANK_LABELS",
    "MetricKind",
    "MetricSpec",
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


RANK_LABELS: tuple[str, ...] = ("rank", "local_rank")
"""Labels every per-rank series carries, in this order, before its own `label`."""

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
    per_rank: bool
    """Series carry `rank` and `local_rank` and come from rank snapshots."""
    label: str | None = None
    """At most one further bounded label (`op`, `result`, `state`)."""
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
    def labelnames(self) -> tuple[str, ...]:
        """All label names of a series of this family, in exposition order."""
        base = RANK_LABELS if self.per_rank else ()
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


def _scalar(
    kind: MetricKind,
    name: str,
    help_: str,
    *,
    per_rank: bool = True,
    label: str | None = None,
    values: tuple[str, ...] = (),
) -> MetricSpec:
    return MetricSpec(
        name=name,
        kind=kind,
        help=help_,
        per_rank=per_rank,
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
    label: str | None = None,
    values: tuple[str, ...] = (),
) -> MetricSpec:
    return MetricSpec(
        name=name,
        kind=MetricKind.HISTOGRAM,
        help=help_,
        per_rank=True,
        label=label,
        label_values=values,
        buckets=buckets,
    )


_OPS = ("all_gather", "reduce_scatter", "all_reduce")
_RESULTS = ("committed", "failed")

CATALOG: tuple[MetricSpec, ...] = (
    # --- node / daemon ---------------------------------------------------------------------
    _g(
        "trainingd_build_info",
        "Build metadata (labels version, torch, cuda, python); always 1.",
        per_rank=False,
    ),
    _g(
        "trainingd_daemon_state",
        "1 for the lifecycle state the node is in, 0 for the others.",
        per_rank=False,
        label="state",
        values=DAEMON_STATES,
    ),
    _g(
        "trainingd_daemon_ready",
        "1 when rendezvous and restore are done (what /readyz says).",
        per_rank=False,
    ),
    _g(
        "trainingd_daemon_heartbeat_timestamp_seconds",
        "Unix time of the daemon supervisor loop's last iteration.",
        per_rank=False,
    ),
    _g(
        "trainingd_daemon_start_timestamp_seconds",
        "Unix time the daemon process started.",
        per_rank=False,
    ),
    _g(
        "trainingd_daemon_world_size",
        "Ranks in the job (all nodes), as of the last rendezvous.",
        per_rank=False,
    ),
    _g("trainingd_daemon_local_ranks", "Rank processes this node runs.", per_rank=False),
    _c(
        "trainingd_daemon_restarts_total",
        "Worker group restarts done by the elastic agent on this node.",
        per_rank=False,
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
    # --- per rank: training ------------------------------------------------------------------
    _c("trainingd_train_steps_total", "Optimizer steps completed."),
    _g("trainingd_train_step", "Current optimizer step (completed steps since step 0)."),
    _h("trainingd_train_step_duration_seconds", "Wall time of one optimizer step.", _STEP_S),
    _h("trainingd_train_data_loading_seconds", "Time the loop waited for a batch.", _DATA_S),
    _c("trainingd_train_tokens_total", "Tokens processed by this rank."),
    _g("trainingd_train_loss", "Training loss of the last step (mean over all ranks)."),
    _g("trainingd_train_grad_norm", "Global gradient norm of the last step, before clipping."),
    _g("trainingd_train_learning_rate", "Learning rate used by the last step."),
    # --- per rank: sharding engine -----------------------------------------------------------
    _g(
        "trainingd_fsdp_allgather_queue_depth",
        "Peak number of all-gathers issued and not yet waited on, since the rank started.",
    ),
    _g(
        "trainingd_fsdp_reduce_queue_depth",
        "Peak number of reduce-scatters issued and not yet waited on, since the rank started.",
    ),
    _c(
        "trainingd_fsdp_prefetch_hits_total",
        "Unshards whose all-gather had already been issued ahead of use.",
    ),
    _c("trainingd_fsdp_prefetch_misses_total", "Unshards that had to issue their all-gather."),
    _h(
        "trainingd_fsdp_collective_seconds",
        "Time the engine waited on one collective.",
        _COLLECTIVE_S,
        label="op",
        values=_OPS,
    ),
    _c(
        "trainingd_fsdp_collective_bytes_total",
        "Bytes moved by the engine's collectives.",
        label="op",
        values=_OPS,
    ),
    # --- per rank: checkpoints -----------------------------------------------------------------
    _h(
        "trainingd_ckpt_save_stall_seconds",
        "Time save() blocked the training loop.",
        _CKPT_BLOCKING_S,
    ),
    _h(
        "trainingd_ckpt_staging_seconds",
        "Copy of the state to host memory for a save.",
        _CKPT_BLOCKING_S,
    ),
    _h(
        "trainingd_ckpt_write_seconds",
        "Background write of one rank's checkpoint files.",
        _CKPT_BACKGROUND_S,
    ),
    _h(
        "trainingd_ckpt_finalize_seconds",
        "Coordination and commit of a save across ranks.",
        _CKPT_BLOCKING_S,
    ),
    _h(
        "trainingd_ckpt_save_latency_seconds",
        "Save scheduled to save committed (end to end).",
        _CKPT_BACKGROUND_S,
    ),
    _h(
        "trainingd_ckpt_restore_seconds",
        "Restore of the latest checkpoint at rank start.",
        _CKPT_BACKGROUND_S,
    ),
    _c("trainingd_ckpt_bytes_total", "Checkpoint bytes written by this rank."),
    _c(
        "trainingd_ckpt_saves_total",
        "Finished saves by result (committed or failed).",
        label="result",
        values=_RESULTS,
    ),
    _g("trainingd_ckpt_inflight", "Saves scheduled and not yet finalized."),
    _g("trainingd_ckpt_last_committed_step", "Step of the newest committed checkpoint."),
    _g(
        "trainingd_ckpt_last_committed_timestamp_seconds",
        "Unix time the newest committed checkpoint was committed.",
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
