"""One record per fault the node saw: what happened, where, how long detection and recovery took.

An incident opens when the daemon declares a fault: a rank failure (by reason), a hang, a
straggler episode, a deterministic failure, a rendezvous-store outage (`IncidentKind`). It is
`open` until the fault is over, then `recovered` (the restarted group completed its first
step; a straggler's score fell below the threshold) or `fatal` (the run ended on it). Its
numbers:

    detection_s  fault -> declared, where the fault time is known (a hung rank's last
                 progress, a rank's exit as the supervisor saw it); None otherwise.
    recovery_s   declared -> the first training step completed after the restart (or the
                 straggler's recovery).
    steps_lost   the step reached before the fault minus the step restored: steps redone.

The writers are the hang and straggler ledgers (`hangs.py`, `stragglers.py`), the agent's
failure tracker, incident watch and store guard (`daemon/agent/failures.py`,
`incident_watch.py`, `store_guard.py`) and the daemon's run (`daemon/agent/run.py`: fatal
endings); the readers are `/api/status` (`StatusBoard`), the collector
(`trainingd_daemon_incidents_total{kind}`, counted when declared) and `trainingd status`.
The log keeps the last `KEEP` incidents; each one closed is logged as one `incident_closed`
line and appended as one JSON line to `<run_dir>/incidents.jsonl` (read back when the daemon
starts again with the same `run_dir`, and by `trainingd status --run-dir`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import structlog

__all__ = [
    "INCIDENTS_FILE",
    "KEEP",
    "Incident",
    "IncidentKind",
    "IncidentLog",
    "IncidentState",
    "read_incidents",
]

log = structlog.get_logger("trainingd.incidents")

KEEP = 20
"""Incidents the daemon keeps (and `/api/status` shows), newest first."""
INCIDENTS_FILE = "incidents.jsonl"
"""The closed incidents, one JSON object a line, in the per-run directory."""


class IncidentKind(enum.StrEnum):
    """What kind of fault (the `kind` label of `trainingd_daemon_incidents_total`)."""

    RANK_FAILURE = "rank_failure"
    """Rank processes failed (an exception, out of memory, a signal, an exit code)."""
    HANG = "hang"
    """A rank's progress stopped past its budget; its group was restarted."""
    STRAGGLER = "straggler"
    """A rank was named a straggler (its score reached `straggler_threshold`)."""
    DETERMINISTIC = "deterministic"
    """The same error at the same step twice: the run ended (exit 1)."""
    PEER_LOST = "peer_lost"
    """This node's ranks lost a peer of their group (another node's rank or process group died:
    every failure here only says its collective's peer went away); the group was restarted."""
    STORE_OUTAGE = "store_outage"
    """The rendezvous store did not answer: ridden out (recovered when it answers again), or
    lost past its grace (fatal: the node's run ended, exit 75)."""


class IncidentState(enum.StrEnum):
    """Where an incident stands."""

    OPEN = "open"
    """Declared, not over yet."""
    RECOVERED = "recovered"
    """Training went on: the restarted group completed a step, or the straggler caught up."""
    FATAL = "fatal"
    """The node's run ended on it."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class Incident:
    """One fault, from its declaration to its end."""

    id: int
    """Number of the incident on this node (from 1, across daemon restarts with one run dir)."""
    kind: IncidentKind
    """What kind of fault."""
    ranks: tuple[int, ...]
    """The global ranks at fault (causes, not the peers that only waited)."""
    node: int
    """The node that declared it (`node_rank`)."""
    cause: str
    """The cause in one line: the error, the hung rank's frame, the straggler's score."""
    detected_unix_s: float
    """When the daemon declared it."""
    fault_unix_s: float | None = None
    """When the fault happened, where known (a hung rank's last progress, a rank's exit)."""
    step_before: int | None = None
    """The step training had reached before the fault."""
    awaits_restart: bool = True
    """It ends when a restarted group completes a step (hangs, rank failures)."""
    state: IncidentState = IncidentState.OPEN
    """Open, recovered or fatal."""
    ended_unix_s: float | None = None
    """When it was recovered (the first step after the restart) or found fatal."""
    restored_step: int | None = None
    """The step the restarted group restored (0: it started from scratch)."""
    source: str | None = None
    """Where the restored state came from: memory, replica or durable (None: nothing)."""

    @property
    def detection_s(self) -> float | None:
        """Fault -> declared, in seconds (None: the fault time is unknown)."""
        if self.fault_unix_s is None:
            return None
        return max(0.0, self.detected_unix_s - self.fault_unix_s)

    @property
    def recovery_s(self) -> float | None:
        """Declared -> recovered, in seconds (None: not recovered)."""
        if self.state is not IncidentState.RECOVERED or self.ended_unix_s is None:
            return None
        return max(0.0, self.ended_unix_s - self.detected_unix_s)

    @property
    def steps_lost(self) -> int | None:
        """Steps redone: the step reached before the fault minus the step restored."""
        if self.step_before is None or self.restored_step is None:
            return None
        return max(0, self.step_before - self.restored_step)

    def as_dict(self) -> dict[str, Any]:
        """The incident as JSON-ready data (`/api/status`, `incidents.jsonl`, the log line)."""
        data = dataclasses.asdict(self)
        data["kind"] = self.kind.value
        data["state"] = self.state.value
        data["ranks"] = list(self.ranks)
        for name in ("detection_s", "recovery_s"):
            value = getattr(self, name)
            data[name] = None if value is None else round(value, 3)
        data["steps_lost"] = self.steps_lost
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Incident:
        """Read back `as_dict()`'s output (derived fields are recomputed).

        Raises:
            ValueError: a field is missing or of the wrong kind.
        """
        try:
            fields = {f.name for f in dataclasses.fields(cls)}
            kept = {k: v for k, v in data.items() if k in fields}
            kept["kind"] = IncidentKind(kept["kind"])
            kept["state"] = IncidentState(kept["state"])
            kept["ranks"] = tuple(int(r) for r in kept["ranks"])
            return cls(**kept)
        except (KeyError, TypeError) as err:
            raise ValueError(f"not an incident record: {err}") from err


def read_incidents(path: Path) -> list[Incident]:
    """The incidents of an `incidents.jsonl`, oldest first; unreadable lines are skipped.

    A line torn by a crash mid-append, or written by another version, must not hide the rest.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    found = []
    for line in text.splitlines():
        try:
            found.append(Incident.from_dict(json.loads(line)))
        except (ValueError, AttributeError):
            continue
    return found


class IncidentLog:
    """The node's last incidents, their counts by kind, and the file of closed ones; thread-safe.

    Args:
        node: this node's rank.
        path: where closed incidents are appended (read back first); None: nowhere.
        keep: incidents kept in memory (newest first in `recent`).
        clock: Unix time source.
    """

    def __init__(
        self,
        *,
        node: int,
        path: Path | None = None,
        keep: int = KEEP,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least 1 incident")
        self._node = node
        self._path = path
        self._clock = clock
        self._lock = threading.Lock()
        history = read_incidents(path) if path is not None else []
        self._recent: collections.deque[Incident] = collections.deque(history, maxlen=keep)
        self._next_id = max((i.id for i in history), default=0) + 1
        self._counts = dict.fromkeys(IncidentKind, 0)

    def counts(self) -> dict[str, float]:
        """Incidents declared since the daemon started, by kind value, every kind present."""
        with self._lock:
            return {kind.value: float(n) for kind, n in self._counts.items()}

    def recent(self) -> list[Incident]:
        """The kept incidents, newest first."""
        with self._lock:
            return list(reversed(self._recent))

    def is_open(self, kind: IncidentKind) -> bool:
        """Whether an incident of `kind` is open."""
        with self._lock:
            return any(i.kind is kind and i.state is IncidentState.OPEN for i in self._recent)

    def awaiting_restart(self) -> list[Incident]:
        """The open incidents that end when a restarted group completes a step."""
        with self._lock:
            return [i for i in self._recent if i.state is IncidentState.OPEN and i.awaits_restart]

    def open(
        self,
        kind: IncidentKind,
        *,
        ranks: Iterable[int],
        cause: str,
        fault_unix_s: float | None = None,
        step_before: int | None = None,
        awaits_restart: bool = True,
    ) -> Incident:
        """Declare an incident now; returns it (state `open`)."""
        with self._lock:
            incident = Incident(
                id=self._next_id,
                kind=kind,
                ranks=tuple(sorted(set(ranks))),
                node=self._node,
                cause=cause,
                detected_unix_s=self._clock(),
                fault_unix_s=fault_unix_s,
                step_before=step_before,
                awaits_restart=awaits_restart,
            )
            self._next_id += 1
            self._counts[kind] += 1
            self._recent.append(incident)
        log.warning(
            "incident_opened",
            incident=incident.id,
            kind=kind.value,
            ranks=list(incident.ranks),
            cause=cause,
        )
        return incident

    def recover(
        self, incident_id: int, *, restored_step: int | None = None, source: str | None = None
    ) -> Incident | None:
        """Close an open incident as recovered now; the closed record (None: not open)."""
        return self._close(
            incident_id,
            state=IncidentState.RECOVERED,
            unix_s=self._clock(),
            restored_step=restored_step,
            source=source,
        )

    def restarted(
        self, *, unix_s: float, restored_step: int | None, source: str | None
    ) -> list[Incident]:
        """A restarted group completed its first step at `unix_s`: close what awaited it."""
        return [
            closed
            for incident in self.awaiting_restart()
            if (
                closed := self._close(
                    incident.id,
                    state=IncidentState.RECOVERED,
                    unix_s=max(unix_s, incident.detected_unix_s),
                    restored_step=restored_step,
                    source=source,
                )
            )
            is not None
        ]

    def fatal(self, incident_id: int) -> Incident | None:
        """Close an open incident as fatal now; the closed record (None: not open)."""
        return self._close(incident_id, state=IncidentState.FATAL, unix_s=self._clock())

    def end_open_as_fatal(self) -> list[Incident]:
        """The run ends: every open incident is fatal."""
        return [
            closed
            for incident in self.recent()
            if incident.state is IncidentState.OPEN
            and (closed := self.fatal(incident.id)) is not None
        ]

    def _close(
        self,
        incident_id: int,
        *,
        state: IncidentState,
        unix_s: float,
        restored_step: int | None = None,
        source: str | None = None,
    ) -> Incident | None:
        with self._lock:
            current = next((i for i in self._recent if i.id == incident_id), None)
            if current is None or current.state is not IncidentState.OPEN:
                return None
            closed = dataclasses.replace(
                current,
                state=state,
                ended_unix_s=unix_s,
                restored_step=restored_step,
                source=source,
            )
            self._recent = collections.deque(
                (closed if i is current else i for i in self._recent), maxlen=self._recent.maxlen
            )
            record = closed.as_dict()
            if self._path is not None:
                try:
                    with self._path.open("a") as out:
                        out.write(json.dumps(record, separators=(",", ":")) + "\n")
                except OSError as err:  # the history is lost, the run is not
                    log.warning("incident_not_saved", path=str(self._path), error=str(err))
        log.info("incident_closed", **record)
        return closed
