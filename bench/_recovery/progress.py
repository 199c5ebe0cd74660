"""Per-kill samples and step times from the job's progress files and the ranks' logs.

An incarnation is one rank process of the group (one `restart` of its daemon's agent); its
progress file (`job.py`) holds the wall times at which it started fetching a batch, so line k
(1-based) means the incarnation had completed k-1 steps, counted from its start step (the
`restored` line's `ckpt_step` of that restart, 0 without one). Everything here is pure: the
bench reads the files and the logs, these functions do the arithmetic.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

_NAME = re.compile(r"progress-rank(\d+)-pid(\d+)\.txt")


class Incarnation(NamedTuple):
    """One rank process's progress."""

    rank: int
    restart: int
    batch_starts: list[float]
    """Unix times at which it started fetching each batch."""
    pid: int = 0


class KillSample(NamedTuple):
    """What one SIGKILL cost the group."""

    killed_unix: float
    last_step: int
    """The newest step any process of the killed incarnation completed."""
    restored_step: int
    source: str
    """Where the restarted group's state came from (`memory`, `replica`, `durable`, `none`)."""
    steps_lost: int
    """`last_step - restored_step`; -1 when the kill fell after step `last_step + 1`'s
    checkpoint call but before the next forward (whose start marks that step complete)."""
    recovery_s: float
    """SIGKILL to the first step the restarted incarnation completed."""
    fallback_reason: str | None
    catchup_s: float | None = None
    """SIGKILL to the first step beyond `last_step` completed, i.e. with the lost steps
    redone (None: the restarted incarnation has not got there yet)."""


def parse_progress(text: str) -> tuple[int, list[float]]:
    """`(restart, batch start times)` of one progress file's text."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("restart "):
        raise ValueError("a progress file starts with `restart <N>`")
    restart = int(lines[0].split()[1])
    # A process killed mid-write may leave a partial last line: only finished lines count.
    complete = lines[1:] if text.endswith("\n") else lines[1:-1]
    return restart, [float(line) for line in complete]


def read_incarnations(directory: Path, rank: int | None) -> list[Incarnation]:
    """Rank `rank`'s incarnations that fetched at least one batch, in the order they started
    (`rank` None: any rank's; for a directory one node's single-rank processes write, whose
    global rank can change between rounds: [Note: group ranks move between nodes] in
    `daemon/agent/replica`).

    [Note: an incarnation is a process, not a restart count] The restart count does not name
    an incarnation: torch's agent restarts a node's ranks for another node's failure (a
    membership change) without counting a restart, so on several nodes two processes of one
    node can carry the same count. The pid (in the file's name, and bound to every line a
    rank logs) does.

    Processes that built the job without training (the daemon's estimate, the fork server's
    preload) wrote no batch and are left out.
    """
    out: list[Incarnation] = []
    for path in directory.iterdir():
        match = _NAME.fullmatch(path.name)
        if match is None or (rank is not None and int(match.group(1)) != rank):
            continue
        text = path.read_text(encoding="ascii", errors="replace")
        if "\n" not in text:
            continue  # just created: its `restart` line is not written yet
        restart, times = parse_progress(text)
        if times:
            out.append(Incarnation(int(match.group(1)), restart, times, int(match.group(2))))
    return sorted(out, key=lambda inc: inc.batch_starts[0])


def restored_event(
    events: Iterable[Mapping[str, Any]], rank: int | None, incarnation: Incarnation
) -> Mapping[str, Any] | None:
    """The incarnation's `restored` log event (None: it restored nothing): matched by pid, or
    by restart count where no event carries a pid (a daemon from before it was bound)."""
    restored = [
        e
        for e in events
        if e.get("event") == "restored" and (rank is None or int(e.get("rank", -1)) == rank)
    ]
    if any("pid" in e for e in restored):
        return next((e for e in restored if e.get("pid") == incarnation.pid), None)
    return restored_by_restart(restored, rank).get(incarnation.restart)


def restored_by_restart(events: Iterable[Mapping[str, Any]], rank: int | None) -> dict[int, Any]:
    """Rank `rank`'s `restored` log events by restart (`rank` None: any rank's)."""
    return {
        int(e.get("restart", 0)): e
        for e in events
        if e.get("event") == "restored" and (rank is None or int(e.get("rank", -1)) == rank)
    }


def completed_steps(incarnation: Incarnation, start_step: int) -> int:
    """The newest step the incarnation completed (its start step if none)."""
    return start_step + max(len(incarnation.batch_starts) - 1, 0)


def kill_sample(
    killed_unix: float,
    before: Incarnation,
    before_start: int,
    after: Incarnation,
    restored: Mapping[str, Any] | None,
) -> KillSample:
    """The sample of one kill from the incarnations around it (rank 0's, say).

    Args:
        killed_unix: when the SIGKILL was sent.
        before: the incarnation that was running (the killed one, or the one it took down).
        before_start: its start step.
        after: the next incarnation; it must have completed a step (2 batch starts).
        restored: its `restored` log event (None: it started from nothing).
    """
    if len(after.batch_starts) < 2:
        raise ValueError(
            f"process {after.pid} (restart {after.restart}) has not completed a step yet"
        )
    restored_step = int(restored["ckpt_step"]) if restored is not None else 0
    last = completed_steps(before, before_start)
    # Line k (1-based) of `after`: restored_step + k - 1 steps complete.
    beyond = last + 1 - restored_step
    catchup = after.batch_starts[beyond] - killed_unix if beyond < len(after.batch_starts) else None
    return KillSample(
        killed_unix=killed_unix,
        last_step=last,
        restored_step=restored_step,
        source=str(restored["source"]) if restored is not None else "none",
        steps_lost=last - restored_step,
        recovery_s=after.batch_starts[1] - killed_unix,
        fallback_reason=restored.get("fallback_reason") if restored is not None else None,
        catchup_s=catchup,
    )


def lines_to_catch_up(before: Incarnation, before_start: int, restored_step: int) -> int:
    """Progress lines the restarted incarnation needs before `kill_sample` can tell its
    `catchup_s` (the first step beyond the killed incarnation's newest one completed)."""
    return completed_steps(before, before_start) + 2 - restored_step


def step_times(incarnation: Incarnation, skip: int) -> list[float]:
    """Seconds between consecutive batch starts, after the first `skip` steps (warm-up)."""
    starts = incarnation.batch_starts[skip:]
    return [b - a for a, b in itertools.pairwise(starts)]
