"""The hangs this node declared, as `/metrics` and the status page report them.

The agent's hang detector (`daemon/agent/hang.py`) writes here, on the supervisor's thread;
the collector (`trainingd_rank_hung`, `trainingd_rank_hangs_total`) and the status board read,
on HTTP handler threads. A rank named as the cause of a hang counts one hang and is `hung`
until its restarted incarnation is back in the training loop (its progress word moves past
start-up and restore): a restart takes seconds to minutes, so the gauge stays 1 long enough
for a scrape to see it, and the counter keeps every hang even when none does. Ranks that only
waited for the cause (in a collective) are recorded in the last hang's report, never counted.
Each declared hang with a cause here opens one `hang` incident (`incidents.py`): its ranks, the
cause's frame (or "stopped"), its last progress as the fault time and its step.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from daemon.observe.incidents import IncidentKind, IncidentLog

__all__ = ["HangLedger", "HangReport"]


class HangReport(NamedTuple):
    """One rank found without progress when a hang was declared."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on this node."""
    node: int
    """The node's rank (`node_rank`)."""
    phase: str
    """Where its progress word stopped (`daemon.rundir.progress.ProgressPhase` value)."""
    step: int
    """The step it was in."""
    seconds_without_progress: float
    """How long its progress word had not moved."""
    stopped: bool
    """The process was stopped (state T) and could not dump its stacks."""
    waiting: bool
    """It waited in a collective (for a peer), as its phase or its stacks showed."""
    cause: bool
    """Named as the cause of the hang (`rank_hung`), else a waiter (`rank_waiting`)."""
    frame: str | None
    """Innermost frame of our code or the job's (`file:line in function`); None: no dump."""
    stacks: str
    """Where its stack dump was written."""
    unix_s: float
    """When the hang was declared."""

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (`/api/status`)."""
        return self._asdict()


class HangLedger:
    """Which ranks are hung, how many hangs each caused, and the last hang; thread-safe.

    Args:
        incidents: where each declared hang opens a `hang` incident; None: nowhere.
    """

    def __init__(self, incidents: IncidentLog | None = None) -> None:
        self._incidents = incidents
        self._lock = threading.Lock()
        self._hung: set[int] = set()
        self._num_hangs: dict[int, int] = {}
        self._last: list[HangReport] = []

    def declare(self, reports: list[HangReport]) -> None:
        """Record one declared hang: its causes become hung and count one hang each."""
        with self._lock:
            self._last = list(reports)
            for report in reports:
                if report.cause:
                    self._hung.add(report.rank)
                    self._num_hangs[report.rank] = self._num_hangs.get(report.rank, 0) + 1
        causes = [r for r in reports if r.cause]
        if self._incidents is not None and causes:
            self._incidents.open(
                IncidentKind.HANG,
                ranks=[r.rank for r in causes],
                cause="; ".join(_hang_cause(r) for r in causes),
                fault_unix_s=min(r.unix_s - r.seconds_without_progress for r in causes),
                step_before=max(r.step for r in reports),
            )

    def recovered(self, rank: int) -> None:
        """Rank `rank` trains again (its restarted incarnation left start-up): not hung."""
        with self._lock:
            self._hung.discard(rank)

    def hung(self, rank: int) -> bool:
        """Whether `rank` is hung now."""
        with self._lock:
            return rank in self._hung

    def num_hangs(self, rank: int) -> int:
        """Hangs `rank` was named the cause of since the daemon started."""
        with self._lock:
            return self._num_hangs.get(rank, 0)

    def hung_ranks(self) -> list[int]:
        """The ranks hung now, ascending."""
        with self._lock:
            return sorted(self._hung)

    def last(self) -> list[HangReport]:
        """Every rank of the last declared hang, causes first ([] before the first)."""
        with self._lock:
            return sorted(self._last, key=lambda r: (not r.cause, r.rank))


def _hang_cause(report: HangReport) -> str:
    """`rank 1 hung in data at step 10: job.py:12 in spin` (or `... stopped (state T)`)."""
    where = f"rank {report.rank} hung in {report.phase} at step {report.step}"
    if report.stopped:
        return f"{where}: stopped (state T)"
    return f"{where}: {report.frame}" if report.frame else where
