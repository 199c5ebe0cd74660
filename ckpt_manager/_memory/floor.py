"""The durable floor: the newest step this run is known to hold durably, kept in the tier.

[Note: a memory step older than a durable one is stale] The restore agreement alone picks the
newest step every rank holds in memory. That step can be older than what the run reached:
after an elastic shrink and grow, the returning node's replica and the other node's slots
still hold the step both had before the shrink (their layouts match again), while the run
went on alone and committed newer steps durably. Restoring it would roll the run back. So
each rank records, in the tier's directory (which outlives its ranks), the newest step it saw
committed or restored durably, and the agreement refuses memory steps below the newest such
step any rank knows (or the coordinator learnt from the root's catalog when it opened it):
the restore then falls back to the durable tier, which holds that step.

    <directory>/durable-floor.rank-<r:05d>.json     {"run_id": ..., "step": N}

One file per rank (ranks of a node never write the same file); a reader takes the maximum
over every rank's file of this run, since global ranks move between nodes across rounds.
Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

__all__ = ["read_floor", "write_floor"]

_NAME = re.compile(r"durable-floor\.rank-(\d{5})\.json")


def write_floor(directory: str, rank: int, run_id: str, step: int) -> None:
    """Record that `run_id` holds `step` durably (atomic replace; a failure is ignored: the
    floor only makes a restore more careful, and the catalog still bounds it).

    Args:
        directory: the tier's directory.
        rank: the writing rank.
        run_id: the run.
        step: the newest step this rank saw committed or restored durably.
    """
    path = os.path.join(directory, f"durable-floor.rank-{rank:05d}.json")
    temp = f"{path}.tmp"
    with contextlib.suppress(OSError):
        with open(temp, "w", encoding="utf-8") as f:
            json.dump({"run_id": run_id, "step": int(step)}, f)
        os.replace(temp, path)


def read_floor(directory: str, run_id: str) -> int | None:
    """The newest durable step any rank recorded for `run_id` in `directory` (None: none)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    steps: list[int] = []
    for name in names:
        if _NAME.fullmatch(name) is None:
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                raw = json.load(f)
            if isinstance(raw, dict) and raw.get("run_id") == run_id:
                steps.append(int(raw["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a torn or foreign file is no evidence
    return max(steps, default=None)
