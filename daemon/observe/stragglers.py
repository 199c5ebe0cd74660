"""The stragglers this node named, as `/metrics` and the status page report them.

The agent's straggler watch (`daemon/agent/straggler.py`) writes here, on the supervisor's
thread; the collector (`trainingd_rank_straggler_episodes_total`) and the status board read, on
HTTP handler threads. A rank is a straggler from the tick its score reaches
`straggler_threshold` until a tick finds it below (or its process gone); each such episode
counts once, and the newest episodes are kept for the status page. Each episode is also one
`straggler` incident (`incidents.py`), recovered when the episode ends.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, NamedTuple

from daemon.observe.incidents import IncidentKind, IncidentLog

__all__ = ["StragglerLedger", "StragglerReport"]

_KEEP = 10
"""Episodes the status page shows (newest first)."""


class StragglerReport(NamedTuple):
    """One straggler episode of a rank."""

    rank: int
    """Global rank."""
    node: int
    """Its node (the daemon's `node_rank`, the score's `node` label)."""
    score: float
    """Its score when named: median compute time over the median rank's."""
    compute_s: float
    """Its median compute seconds per step over the window when named."""
    unix_s: float
    """When it was named."""
    recovered_unix_s: float | None = None
    """When its score fell below the threshold again (None: still a straggler)."""
    restarted: bool = False
    """Its group was restarted for it (`straggler_action = "restart"`)."""

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (`/api/status`)."""
        return self._asdict()


class StragglerLedger:
    """Which ranks are stragglers now, their episode counts and the newest episodes; thread-safe.

    Args:
        incidents: where each episode is a `straggler` incident; None: nowhere.
    """

    def __init__(self, incidents: IncidentLog | None = None) -> None:
        self._incidents = incidents
        self._incident_ids: dict[int, int] = {}
        self._lock = threading.Lock()
        self._now: dict[int, StragglerReport] = {}
        self._num_episodes: dict[int, int] = {}
        self._recent: collections.deque[StragglerReport] = collections.deque(maxlen=_KEEP)

    def named(self, report: StragglerReport) -> None:
        """Record the start of an episode: `report.rank` is a straggler from now."""
        with self._lock:
            self._now[report.rank] = report
            self._num_episodes[report.rank] = self._num_episodes.get(report.rank, 0) + 1
            self._recent.append(report)
        if self._incidents is not None:
            incident = self._incidents.open(
                IncidentKind.STRAGGLER,
                ranks=[report.rank],
                cause=f"rank {report.rank} is a straggler: score {report.score:.2f} "
                f"({report.compute_s:.3f} s compute per step)",
                awaits_restart=False,
            )
            with self._lock:
                self._incident_ids[report.rank] = incident.id

    def recovered(self, rank: int, unix_s: float) -> StragglerReport | None:
        """End `rank`'s episode; its report with the recovery time (None: it was none)."""
        with self._lock:
            report = self._now.pop(rank, None)
            if report is None:
                return None
            done = report._replace(recovered_unix_s=unix_s)
            self._recent = collections.deque(
                (done if r is report else r for r in self._recent), maxlen=_KEEP
            )
            incident_id = self._incident_ids.pop(rank, None)
        if self._incidents is not None and incident_id is not None:
            self._incidents.recover(incident_id)
        return done

    def mark_restarted(self, rank: int) -> None:
        """Note that `rank`'s current episode restarted its group."""
        with self._lock:
            report = self._now.get(rank)
            if report is None:
                return
            done = report._replace(restarted=True)
            self._now[rank] = done
            self._recent = collections.deque(
                (done if r is report else r for r in self._recent), maxlen=_KEEP
            )

    def straggler(self, rank: int) -> bool:
        """Whether `rank` is a straggler now."""
        with self._lock:
            return rank in self._now

    def stragglers(self) -> list[int]:
        """The ranks that are stragglers now, ascending."""
        with self._lock:
            return sorted(self._now)

    def num_episodes(self, rank: int) -> int:
        """Episodes `rank` was named in since the daemon started."""
        with self._lock:
            return self._num_episodes.get(rank, 0)

    def recent(self) -> list[StragglerReport]:
        """The newest episodes, newest first ([] before the first)."""
        with self._lock:
            return list(reversed(self._recent))
