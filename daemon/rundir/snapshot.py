"""The rank snapshot file: what a rank publishes and the daemon reads (`ranks/local-<k>.json`).

See [Note: one endpoint per node, ranks publish snapshots] in `daemon/metrics.py`. A rank
(`daemon/rank/telemetry.py`) writes its cumulative values as one JSON file, atomically (temp
file + `os.replace`, so a reader never sees half a file); the daemon's collector and supervisor
(`daemon/observe/collector.py`) read it. The format (`SNAPSHOT_SCHEMA`):

    {"schema": 2, "pid": 4242, "rank": 0, "world_size": 2, "restart": 0, "phase": "training",
     "counters":   {"<name>": {"<label value or ''>": 12.0}},
     "gauges":     {"<name>": {"": 3.5}},
     "histograms": {"<name>": {"": {"counts": [per-bucket counts, +Inf last], "sum": 1.2}}}}

Metric names are those of `daemon.metrics.CATALOG`; `phase` is a `RankPhase`. Every field has a
reader on the daemon's side (CONTRACTS.md lists them); the local rank is the file's name.
"""

from __future__ import annotations

import enum
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["SNAPSHOT_SCHEMA", "RankPhase", "read_snapshot", "snapshot_path", "write_snapshot"]

SNAPSHOT_SCHEMA = 2
"""Version of the snapshot file format; readers skip files of another version.

2: without `local_rank` (the file's name says it) and `published_unix_s` (no reader).
"""


class RankPhase(enum.StrEnum):
    """Where a rank process is (`phase` in its snapshot); the daemon derives the node's phase.

    In order: starting -> loading -> restoring -> training (<-> checkpointing) -> stopping |
    finishing -> finished -> exited (a failing rank goes to exited from any phase).
    """

    STARTING = "starting"
    """The process started: it leads its process group and has published its pid."""
    LOADING = "loading"
    """In the process group; building the job (model, data)."""
    RESTORING = "restoring"
    """Wrapping the model and restoring the latest committed checkpoint (or `--init-from`)."""
    TRAINING = "training"
    """In the training loop (saves scheduled there run in the background)."""
    CHECKPOINTING = "checkpointing"
    """In the training loop, in a checkpoint call that has lasted (a `save()` waiting for a
    slot or for storage): published only after `daemon.rank.phase_watch.LINGER_S`."""
    STOPPING = "stopping"
    """Left the loop on an agreed stop: the final save is being committed."""
    FINISHING = "finishing"
    """Left the loop at `max_steps`: the final save is being committed."""
    FINISHED = "finished"
    """Every save committed; the process returns its summary next."""
    EXITED = "exited"
    """The rank's entry point returned or raised; the process exits."""

    @property
    def done(self) -> bool:
        """Whether the rank has left the training group (`finished` or `exited`)."""
        return self in (RankPhase.FINISHED, RankPhase.EXITED)


def snapshot_path(run_dir: Path, local_rank: int) -> Path:
    """Where local rank `local_rank` publishes its snapshot inside the per-run directory."""
    return run_dir / "ranks" / f"local-{local_rank}.json"


def write_snapshot(path: Path, data: dict[str, Any]) -> None:
    """Replace the snapshot at `path` with `data` in one step (readers see old or new)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    os.replace(tmp, path)


def read_snapshot(path: Path) -> dict[str, Any] | None:
    """Parse one snapshot file; `None` when it is missing, torn or of another schema.

    The `phase` of a returned snapshot is a `RankPhase`.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SNAPSHOT_SCHEMA:
        return None
    try:
        data["phase"] = RankPhase(str(data.get("phase")))
    except ValueError:
        return None
    return data
