"""The rank snapshot file: what a rank publishes and the daemon reads (`ranks/local-<k>.json`).

See [Note: one endpoint per node, ranks publish snapshots] in `daemon/metrics.py`. A rank
(`daemon/rank/telemetry.py`) writes its cumulative values as one JSON file, atomically (temp
file + `os.replace`, so a reader never sees half a file); the daemon's collector and supervisor
(`daemon/observe/collector.py`) read it. The format (`SNAPSHOT_SCHEMA`):

    {"schema": 1, "pid": 4242, "rank": 0, "local_rank": 0, "world_size": 2, "restart": 0,
     "phase": "training", "published_unix_s": 1.7e9,
     "counters":   {"<name>": {"<label value or ''>": 12.0}},
     "gauges":     {"<name>": {"": 3.5}},
     "histograms": {"<name>": {"": {"counts": [per-bucket counts, +Inf last], "sum": 1.2}}}}

Metric names are those of `daemon.metrics.CATALOG`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["SNAPSHOT_SCHEMA", "read_snapshot", "snapshot_path", "write_snapshot"]

SNAPSHOT_SCHEMA = 1
"""Version of the snapshot file format; readers skip files of another version."""


def snapshot_path(run_dir: Path, local_rank: int) -> Path:
    """Where local rank `local_rank` publishes its snapshot inside the per-run directory."""
    return run_dir / "ranks" / f"local-{local_rank}.json"


def write_snapshot(path: Path, data: dict[str, Any]) -> None:
    """Replace the snapshot at `path` with `data` in one step (readers see old or new)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    os.replace(tmp, path)


def read_snapshot(path: Path) -> dict[str, Any] | None:
    """Parse one snapshot file; `None` when it is missing, torn or of another schema."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SNAPSHOT_SCHEMA:
        return None
    return data
