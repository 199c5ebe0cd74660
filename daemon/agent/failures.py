"""Rank failures: each one classified and recorded; deterministic ones end the run.

The elastic agent (`elastic.py`) hands every failure it sees to `FailureTracker.record`, once
per failed attempt of the worker group, with what it knows of each failed process (its local
and global rank, its exit code: negative for a signal). The tracker adds what the rank wrote
before it exited (`daemon/rundir/failure.py`: exception, step, phase, traceback tail) and what
the hang detector declared (`hang.py`), and for each failed rank:

* classifies it (`FailureReason`): `config` (the job or its configuration failed before
  training), `exception`, `oom` (an out-of-memory exception), `signal` (killed, without an
  error file), `exit_code` (exited non-zero without one), `hung` (killed by the hang detector);
* logs one `rank_failed` event (rank, node, attempt, reason, exit code or signal, exception
  type and message, step, the traceback's last lines);
* counts it in `trainingd_rank_failures_total{reason}` (`counts`, read at each scrape) and
  puts it on the status page (`StatusBoard.note_failure`);
* declares the attempt's failures as one incident (`incident_watch.py`), fatal when the verdict
  ends the run.

Then it decides whether the agent may restart the group (`Verdict`):

[Note: when a failure is not worth a retry] A restart costs a rendezvous, a restore and the
steps since the last checkpoint; it helps when the cause is outside the job (a node, a link,
a stuck peer), never when the job itself fails the same way each time. So:
  CONFIG         a rank failed before training because of the job or its configuration (an
                 import error, the build raising, `--init-from` weights that do not fit): the
                 run ends at once with exit 2 and one line, as a start-up check would.
  DETERMINISTIC  a rank failed with the same exception (type and message) at the same step
                 as in the previous attempt: the run ends with exit 1 and a summary naming
                 rank, step and error (`summary_lines`). Every local rank's error file of the
                 attempt counts, not only the processes the agent found dead first: when
                 every rank raises, which one exits first varies. Failures before the first
                 step other than CONFIG (a restore from unreachable storage) keep being
                 retried: storage comes back, a job does not change.
  RETRY          anything else, while `max_restarts` allows.
The comparison is per node: each node's daemon sees its own ranks' failures.
"""

from __future__ import annotations

import collections
import enum
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import structlog

from daemon.rundir.failure import RankError, error_path, read_error

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from daemon.agent.incident_watch import IncidentWatch
    from daemon.observe.status import StatusBoard

__all__ = [
    "FailureReason",
    "FailureTracker",
    "RankExit",
    "RankFailure",
    "Verdict",
    "failure_reason",
    "lost_a_peer",
]

log = structlog.get_logger("trainingd.failures")

_OOM_TYPES = frozenset({"OutOfMemoryError", "MemoryError"})
"""Exception class names of an out-of-memory failure (torch's CUDA one, Python's)."""
_KEPT = 10
"""Failures kept for the summary (the status page keeps its own last few)."""


class FailureReason(enum.StrEnum):
    """Why a rank failed (the `reason` label of `trainingd_rank_failures_total`)."""

    CONFIG = "config"
    """The job or its configuration failed before training (exit 2, no retry)."""
    EXCEPTION = "exception"
    """The rank raised an exception."""
    OOM = "oom"
    """The rank raised an out-of-memory exception."""
    SIGNAL = "signal"
    """The process was killed by a signal, without an error file."""
    EXIT_CODE = "exit_code"
    """The process exited non-zero, without an error file."""
    HUNG = "hung"
    """The hang detector killed it (`hang.py`)."""


class Verdict(enum.Enum):
    """What the agent does after a failed attempt ([Note: when a failure is not worth a retry])."""

    RETRY = "retry"
    """Restart the group if `max_restarts` allows."""
    DETERMINISTIC = "deterministic"
    """The same error at the same step twice in a row: stop, exit 1 with a summary."""
    CONFIG = "config"
    """The job or its configuration failed before training: stop, exit 2 with one line."""


class RankExit(NamedTuple):
    """What the agent saw of one failed rank process."""

    local_rank: int
    """Its rank on this node."""
    rank: int
    """Its global rank."""
    exit_code: int
    """Its exit code; negative: killed by that signal."""


class RankFailure(NamedTuple):
    """One classified rank failure."""

    rank: int
    """Global rank."""
    local_rank: int
    """Rank on this node."""
    node: int
    """This node's rank."""
    restart: int
    """The attempt (restart count of the group) it failed in."""
    reason: FailureReason
    """Its class."""
    exit_code: int
    """The process's exit code (negative: the signal)."""
    error: RankError | None
    """What the rank wrote before exiting (None: nothing, or an older attempt's file)."""

    @property
    def signal(self) -> str | None:
        """The signal's name when a signal ended the process."""
        if self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return f"signal {-self.exit_code}"

    @property
    def step(self) -> int | None:
        """The step the rank was training (None: before training, or unknown)."""
        return None if self.error is None else self.error.step

    @property
    def signature(self) -> tuple[int, str, str, int] | None:
        """(rank, exception type, message, step) of an exception in training, else None."""
        e = self.error
        if e is None or e.step is None or self.reason not in _SAME_ERROR_REASONS:
            return None
        return (self.rank, e.exc_type, e.message, e.step)

    def describe(self) -> str:
        """One line: `rank 0 (node 0) at step 3: ValueError: boom` (or how the process ended)."""
        where = f"rank {self.rank} (node {self.node})"
        if self.step is not None:
            where += f" at step {self.step}"
        elif self.error is not None:
            where += f" while {self.error.phase}"
        return f"{where}: {self.cause()}"

    def cause(self) -> str:
        """The error (`Type: message`), or how the process ended."""
        if self.reason is FailureReason.HUNG:
            return "hung (killed by the hang detector)"
        if self.error is not None:
            return _first_line(f"{self.error.exc_type}: {self.error.message}")
        if self.signal is not None:
            return f"killed by {self.signal}"
        return f"exited with code {self.exit_code}"

    def as_dict(self) -> dict[str, object]:
        """The fields of the `rank_failed` event and of the status page's entry."""
        e = self.error
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node": self.node,
            "restart": self.restart,
            "reason": self.reason.value,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "step": self.step,
            "phase": None if e is None else e.phase,
            "exc_type": None if e is None else e.exc_type,
            "message": None if e is None else e.message,
        }


_SAME_ERROR_REASONS = frozenset({FailureReason.EXCEPTION, FailureReason.OOM})


def failure_reason(exit_code: int, error: RankError | None, hung: bool) -> FailureReason:
    """Classify one failure from the exit code, the rank's error file and the hang detector."""
    if hung:
        return FailureReason.HUNG
    if error is not None:
        if error.config:
            return FailureReason.CONFIG
        return FailureReason.OOM if error.exc_type in _OOM_TYPES else FailureReason.EXCEPTION
    return FailureReason.SIGNAL if exit_code < 0 else FailureReason.EXIT_CODE


class FailureTracker:
    """Records rank failures and decides whether the group may restart; thread-safe.

    Args:
        run_dir: the per-run directory (the ranks' error files).
        node: this node's rank.
        hung: global rank -> whether it caused the current hang (`HangDetector.hung`), read
            when a failure comes in; None: no hang detection.
        board: the status page's board, told each failure, or None.
        local_ranks: rank processes on this node (whose error files an attempt may have).
        incidents: where each failed attempt is declared as an incident, or None.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        node: int,
        hung: Callable[[], Mapping[int, bool]] | None = None,
        board: StatusBoard | None = None,
        local_ranks: int = 1,
        incidents: IncidentWatch | None = None,
    ) -> None:
        self._incidents = incidents
        self._run_dir = run_dir
        self._local_ranks = local_ranks
        self._node = node
        self._hung = hung
        self._board = board
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(FailureReason, 0)
        self._signatures: dict[int, set[tuple[int, str, str, int]]] = {}
        self._last: collections.deque[RankFailure] = collections.deque(maxlen=_KEPT)
        self.verdict = Verdict.RETRY
        """The last decision (`DETERMINISTIC` or `CONFIG` once the run was ended by one)."""
        self.decisive: list[RankFailure] = []
        """The failures that ended the run (empty while it may be retried)."""

    def counts(self) -> dict[str, float]:
        """Failures so far by reason value, every reason present (0 until one happens)."""
        with self._lock:
            return {reason.value: float(n) for reason, n in self._counts.items()}

    @property
    def last(self) -> list[RankFailure]:
        """The last failures recorded, oldest first."""
        with self._lock:
            return list(self._last)

    def record(self, exits: list[RankExit], restart: int) -> Verdict:
        """Classify, log, count and show the failures of attempt `restart`; the verdict.

        Args:
            exits: the processes the agent found failed in this attempt.
            restart: the attempt's restart count (membership rounds included), as the ranks
                wrote it in their error files.
        """
        hung = dict(self._hung()) if self._hung is not None else {}
        failures = []
        for ex in sorted(exits, key=lambda e: e.local_rank):
            error = read_error(error_path(self._run_dir, ex.local_rank))
            if error is not None and error.restart != restart:
                error = None  # an older attempt's file: this process wrote none
            reason = failure_reason(ex.exit_code, error, ex.rank in hung)
            failures.append(
                RankFailure(
                    ex.rank, ex.local_rank, self._node, restart, reason, ex.exit_code, error
                )
            )
        others = self._other_errors({f.local_rank for f in failures}, restart, hung)
        failures, others = _blame_the_cause(failures, others)
        for f in failures:
            tail = [] if f.error is None else f.error.traceback_tail
            log.error("rank_failed", **f.as_dict(), traceback_tail=tail)
            if self._board is not None:
                self._board.note_failure(f.as_dict(), f.describe())
        with self._lock:
            for f in failures:
                self._counts[f.reason] += 1
                self._last.append(f)
            verdict = self._decide(failures, others, restart)
        if self._incidents is not None:
            self._incidents.rank_failures(failures, verdict)
        return verdict

    def _other_errors(
        self, found: set[int], restart: int, hung: Mapping[int, object]
    ) -> list[RankFailure]:
        """The attempt's other local ranks that raised too, whether or not their process has
        exited yet: their errors count for the comparison, not as failures seen here (unless
        the failures seen only lost them: `_blame_the_cause`)."""
        others = []
        for local in range(self._local_ranks):
            error = None if local in found else read_error(error_path(self._run_dir, local))
            if error is not None and error.restart == restart:
                reason = failure_reason(1, error, error.rank in hung)
                others.append(RankFailure(error.rank, local, self._node, restart, reason, 1, error))
        return others

    def _decide(
        self, failures: list[RankFailure], others: list[RankFailure], restart: int
    ) -> Verdict:
        """[Note: when a failure is not worth a retry] (caller holds the lock)."""
        config = [f for f in failures if f.reason is FailureReason.CONFIG]
        if config:
            self.verdict, self.decisive = Verdict.CONFIG, config
            return self.verdict
        # A lost peer is the peer's failure, outside this rank: never a reason to stop.
        attempt = [f for f in failures + others if not lost_a_peer(f.error)]
        self._signatures[restart] = {s for f in attempt if (s := f.signature) is not None}
        previous = self._signatures.get(restart - 1, set())
        repeated = [f for f in attempt if f.signature in previous]
        if repeated:
            self.verdict, self.decisive = Verdict.DETERMINISTIC, repeated
        return self.verdict

    def config_line(self) -> str:
        """The one line of a run ended by `Verdict.CONFIG` (printed like a start-up check's)."""
        f = self.decisive[0]
        return f"rank {f.rank} (node {f.node}) failed before training: {f.cause()}"

    def summary_lines(self) -> list[str]:
        """The short block a run ended by `Verdict.DETERMINISTIC` prints on stdout."""
        f = self.decisive[0]
        lines = [
            f"failed: the same error on attempts {f.restart} and {f.restart + 1} "
            f"(deterministic: not retried): {f.describe()}"
        ]
        where = _innermost_frame(f.error.traceback_tail if f.error is not None else [])
        if where is not None:
            lines.append(f"  raised at {where}")
        lines.extend(f"  also {other.describe()}" for other in self.decisive[1:])
        return lines

    def last_failure_line(self) -> str | None:
        """`the last failure: rank ...`, or None when none was recorded."""
        last = self.last
        return None if not last else f"last failure: {last[-1].describe()}"


_PEER_LOSS_MARKERS = (
    "Connection closed by peer",  # gloo, the peer's process exited
    "Connection reset by peer",
    "remote process exited or there was a network error",  # NCCL's ncclRemoteError
    "NCCL communicator was aborted",
)
"""What a collective raises on a rank whose peer went away (the peer's failure, not its own)."""


def lost_a_peer(error: RankError | None) -> bool:
    """Whether a rank's error says only that a peer of its collective went away."""
    return error is not None and any(m in error.message for m in _PEER_LOSS_MARKERS)


def _blame_the_cause(
    failures: list[RankFailure], others: list[RankFailure]
) -> tuple[list[RankFailure], list[RankFailure]]:
    """The failures to report and the other errors of the attempt.

    [Note: a rank that lost its peer is not the failure] When one rank raises, its peers in a
    collective see the connection close and exit too, often before it does: the agent may find
    only them dead. If every failure the agent found only lost a peer and another local rank of
    the attempt wrote an error of its own, that rank is the failure (logged, counted, the
    incident's rank) and the others are its collateral, logged as such. Across nodes a node
    sees only its own ranks: its lost-peer failure stays the failure it reports.
    """
    causes = [f for f in others if not lost_a_peer(f.error)]
    if not causes or not failures or not all(lost_a_peer(f.error) for f in failures):
        return failures, others
    for f in failures:
        log.warning(
            "rank_stopped_by_peer_failure",
            rank=f.rank,
            node=f.node,
            restart=f.restart,
            message=f.error.message if f.error is not None else None,
            causes=[c.rank for c in causes],
        )
    rest = [f for f in others if lost_a_peer(f.error)]
    return causes, failures + rest


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _innermost_frame(traceback_tail: list[str]) -> str | None:
    """`file:line in function` of the last `File ...` line of a traceback tail."""
    for line in reversed(traceback_tail):
        stripped = line.strip()
        if stripped.startswith('File "'):
            # 'File "/x/job.py", line 12, in loss_fn'
            file, _, rest = stripped[len('File "') :].partition('", line ')
            number, _, function = rest.partition(", in ")
            return f"{file}:{number} in {function}" if function else f"{file}:{number}"
    return None
