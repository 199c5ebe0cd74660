"""Finalizing saves across ranks: agree, commit or fail, report.

The manager queues every `SaveRequest` here (`pending`, oldest first). `run()` takes the
oldest, MAX-agrees its status over the checkpoint group (OK < WRITING < FAILED), and then
commits it (gather the reports, the coordinator writes the manifest exclusively, every rank
learns the outcome) or fails it on every rank (stop writers, remove the attempt, exchange
the causes, raise `SaveFailedError`). A folder that holds a manifest is never removed: when the
commit finds another attempt's manifest there (`CommitResult.CONFLICT`), every rank raises
`SaveFailedError` chained to `CommitConflictError` and the folder stays as it is. Each
finished request becomes a `SaveReport` for the observer. See [Note: finalize at a step
boundary] in `_manager.py`: `run()` is only ever called from the training thread.

[Note: the commit runs off the training thread] The coordinator's part of a commit (building
the top manifest from the gathered reports, unpickling them, the lease checks, the exclusive
PUT, reading back a manifest found there) takes milliseconds to seconds on an object store.
It runs on the coordinator's finalizer thread (`ckpt-finalize`, a `CommitJob`); the training
threads only learn its outcome from a later poll round. Each rank's report was pickled by
its staging job ([Note: the report is encoded before the files are durable] in
`report.py`); the poll that first sees OK only frames it.

[Note: a non-blocking finalize never waits for a peer] `maybe_finalize` (`run(blocking=
False)`) issues its collectives with `async_op=True` and reads each one in a later call, so
a call costs a few microseconds of local work even when a peer is late (busy staging or
writing on shared cores, or stopped): it never sits in a collective. The oldest request goes
through three phases, the same on every rank:

    AGREE    poll rounds: MAX of [status, id, -id, report bytes, 0, 0] until the status is
             OK (every rank's files are durable) or FAILED; report bytes is the size of this
             rank's encoded report, so the MAX sizes the gather
    REPORTS  one gather of the reports to the coordinator in fixed-size uint8 buffers (the
             MAX size); once read, the coordinator queues the commit job
    COMMIT   poll rounds: MAX of [OK, id, -id, 0, code, time], where only the coordinator
             fills code (0 running, 1 COMMITTED, 2 not committed) and the commit time (its
             float64 bits) once the job is done; COMMITTED retires the request on every rank

A round is issued in one call and read in a later call (`Pending.ready()` then `result()`);
a call that finds it unfinished returns at once. A call that reads a round that changes
nothing (still WRITING, commit still running) issues the next round and returns; a round
that moves the phase on is followed at once by the next phase's collective. A single
process has no group and its rounds are local: it issues each round when it reads it, so
a call acts on the state of that moment, not on the one the previous call saw. Every decision
is taken from a completed round's result, which is identical on every rank, so every rank
issues the same collectives in the same order, whenever each reads them; the finalizer's
group is its own ([Note: collectives the training thread does not wait for] in `_coord.py`).
No path of a non-blocking call blocks in a collective, a failed save's included ([Note: a
failed save is cleaned up in rounds too]); only the blocking finalize waits on its rounds.

[Note: a failed save is cleaned up in rounds too] Each rank reads a round in whichever call
finds it complete *on that rank*; on a loaded machine a peer's gloo thread may not have
marked the same round complete when the peer polls, and the peer goes on into the next
training step's collectives. A rank that read "FAILED" (or a commit that did not happen)
and then sat in a blocking collective of this group would wait for that peer, and the peer
for it in the training group, until the group's timeout (300 s by default), which breaks
the group and fails every later save: a run under `trainingd` stalled that way on a loaded
machine (`tests/ckpt_manager/save/test_finalize.py` makes a rank miss the round). So a
failure takes two more rounds like the others, read whenever each rank reads them:

    STOPPED  issued once this rank stopped its writer: MAX of [FAILED, id, -id, body bytes,
             0, 0]. Complete means every writer is stopped, so the coordinator then removes
             the attempt (never a folder another commit's manifest holds); the MAX sizes:
    CAUSES   an all-gather of each rank's body: its cause (JSON; null if its own part had not
             failed) or, after a failed commit, the coordinator's `CommitOutcome` (pickled, as
             torch's object collectives do, between the ranks of one run), each behind a
             byte saying whether the coordinator kept the folder. Then every rank raises.

The failure still reaches every rank, with every rank's cause, a call or two after the
round that said so; two ranks may raise it in different calls, never for different saves.

[Note: a blocking finalize polls the agreement] `run(blocking=True)` (a `save()` that needs
a slot, `wait_until_finished`, `close`, `AsyncMode.SYNC`) runs the same phases and rounds,
first waiting on a round a non-blocking call left in flight, then on each round it issues. A
rank never sits inside a collective waiting for a peer's write: a slow writer elsewhere would
outlast the group's timeout (`finalize_timeout_s`), fail the save on every rank and break the
group. Instead, after a round that changes nothing, each rank waits for news of its own (its
writer, the coordinator's commit job) before the next round: up to `AGREE_POLL_S` once its
own part is settled, up to `OWN_WRITE_POLL_S` while it is still staging or writing. The news
ends the wait at once, so the longer bound only thins the rounds that cannot end the
agreement anyway (this rank is not OK yet) and would only bring a peer's failure: about
three rounds instead of twelve over a 0.6 s write, each a gloo all-reduce and a handful of
thread wake-ups on every rank. The first round of AGREE and of COMMIT waits for that news
too, before it is issued ([Note: a blocking finalize opens a phase once its own part can end
it]). How long a write may take is bounded by `write_timeout_s`
alone: the late rank's own `local_status` fails it (and kills its writer) when that runs
out, and FAILED dominates the next round.

Timeouts: every round is bounded by the group timeout even when nobody waits for it: gloo
completes a work that outlives it with a timeout error (a dead peer's at once), and the next
call that polls it raises, abandons the request and raises `SaveFailedError` for its step on
every rank that polls. Requests still commit in order (only the oldest is ever agreed), and
every guarantee of the synchronous commit holds: the exclusive manifest write is the commit,
a failed or conflicting commit raises the same `SaveFailedError` on every rank, an
uncommitted attempt's folder is removed by the coordinator after the outcome is known (never
while its commit may still write).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import json
import pickle
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from ckpt_manager._config import AsyncMode, CheckpointConfig
from ckpt_manager._coord import Coordinator, Pending, Status
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._save.commit import TopTensors, commit_step
from ckpt_manager._save.report import decode_report, encode_report, report_tensor_list
from ckpt_manager._save.request import Limits, SaveRequest, SaveState
from ckpt_manager._save.staging import BackgroundThread
from ckpt_manager._save.writer_proc import WriterProcess
from ckpt_manager._store.publish import CommitOutcome, CommitResult
from ckpt_manager._store.steps import remove_uncommitted_step
from ckpt_manager._store.storage import Storage
from ckpt_manager._types import SaveObserver, SaveReport, SaveResult
from ckpt_manager.errors import CheckpointError, SaveFailedError

__all__ = ["AGREE_POLL_S", "OWN_WRITE_POLL_S", "CommitJob", "Finalizer", "Phase"]

AGREE_POLL_S = 0.05
"""Interval of agreement rounds while a blocking finalize whose own part is settled waits
for some peer's write."""

OWN_WRITE_POLL_S = 0.25
"""Longest wait for news of this rank's own staging or write between agreement rounds of a
blocking finalize ([Note: a blocking finalize polls the agreement])."""


class Phase(enum.Enum):
    """Where the oldest request is ([Note: a non-blocking finalize never waits for a peer])."""

    AGREE = "agree"
    """Poll rounds until every rank's files are durable (or one failed)."""
    REPORTS = "reports"
    """The reports' gather to the coordinator."""
    COMMIT = "commit"
    """Poll rounds until the coordinator's commit has an outcome."""
    STOPPED = "stopped"
    """A failed save: one round once every rank stopped its writer ([Note: a failed save is
    cleaned up in rounds too])."""
    CAUSES = "causes"
    """A failed save: every rank's cause, or the coordinator's commit outcome, to every rank."""


_RAW_PHASES = (Phase.REPORTS, Phase.CAUSES)
"""Phases whose round is a gather of bytes, not a poll."""


class _Code:
    """The coordinator's commit state in a COMMIT poll round (MAX: only it fills it)."""

    RUNNING = 0
    COMMITTED = 1
    NOT_COMMITTED = 2


@dataclasses.dataclass
class _Failure:
    """The clean-up of a failed save in progress on this rank."""

    body: bytes
    """What this rank tells the others: its cause (JSON), or the coordinator's pickled
    `CommitOutcome` after a failed commit (empty on the other ranks)."""
    outcome: CommitOutcome | None = None
    """The coordinator's outcome of a commit that did not happen (None: a write failed)."""
    commit: bool = False
    """The commit failed (the writes had all succeeded)."""
    size: int = 0
    """The largest body (agreed by the STOPPED round)."""
    kept: bool = False
    """The coordinator kept the attempt's folder (a removal failed, or a manifest holds it)."""


class _Poll(NamedTuple):
    """One poll round's MAX over ranks."""

    status: int
    consistent: bool
    report_nbytes: int
    code: int
    committed_unix_s: float

    @classmethod
    def of(cls, request_id: int, fields: Sequence[int]) -> _Poll:
        status, rid, neg, nbytes, code, bits = fields
        return cls(status, rid == -neg == request_id, nbytes, code, _float_of(bits))


def _bits_of(value: float) -> int:
    # A positive float's IEEE bits are a positive int64, so MAX over ranks that send 0 picks
    # the coordinator's value unchanged.
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _float_of(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


class CommitJob:
    """The coordinator's commit of one request, run on its finalizer thread."""

    def __init__(self) -> None:
        """An unfinished job (`done` unset, no outcome yet)."""
        self.done = threading.Event()
        """Set when `outcome` is final."""
        self.outcome = CommitOutcome(CommitResult.FAILED, cause="the commit did not run")
        """The commit's outcome (FAILED until it ran)."""

    def run(self, commit: Callable[[], CommitOutcome]) -> None:
        """Run `commit`, record its outcome, set `done`."""
        try:
            self.outcome = commit()
        except Exception as err:  # the outcome reaches every rank; never a silent hang
            self.outcome = CommitOutcome(
                CommitResult.FAILED, cause=f"commit crashed: {type(err).__name__}: {err}"
            )
        finally:
            self.done.set()


class Finalizer:
    """The queue of saves in flight and their agreement, commit or failure (one per rank)."""

    def __init__(
        self,
        *,
        config: CheckpointConfig,
        storage: Storage,
        coord: Coordinator,
        run_id: str,
        limits: Limits,
        observer: SaveObserver | None,
        log: Any,
        forget_writer: Callable[[WriterProcess], None],
        on_idle: Callable[[], None],
        fence: Callable[[], None] | None = None,
        on_committed: Callable[[int, float, Mapping[str, Any]], None] | None = None,
        before_publish: Callable[[int, float, Mapping[str, Any]], None] | None = None,
    ) -> None:
        """Wire the finalizer.

        Args:
            config: the manager's config.
            storage: the checkpoint root.
            coord: the checkpoint process group.
            run_id: the run identity written into manifests.
            limits: local wait limits of requests.
            observer: receives a `SaveReport` per finished save.
            log: bound logger.
            forget_writer: called with a writer this rank had to kill.
            on_idle: called after a commit that left nothing in flight (wakes retention).
            fence: the coordinator's lease check (raises `LeaseLostError` once the lease was
                taken over): before each manifest write and each removal of an attempt.
            on_committed: on every rank, called with each committed step, its commit time
                and the metrics its manifest holds (on the coordinator: rank 0's report
                carries them; elsewhere empty): the memory tier's durable floor, and
                retention again (a manifest read back from another attempt has its own).
            before_publish: on the coordinator, called on its finalizer thread with a step's
                commit time and metrics once its manifest is built and before it is
                published, so that no listing can show the step first ([Note: retention
                learns a commit from the finalizer] in `_retention/deleter.py`; told when the
                training thread read the commit, a retention pass between the two read the
                manifest, and a CI run's retention test saw it).
        """
        self._config = config
        self._storage = storage
        self._coord = coord
        self._run_id = run_id
        self._limits = limits
        self._observer = observer
        self._log = log
        self._forget_writer = forget_writer
        self._on_idle = on_idle
        self._fence = fence
        self._on_committed = on_committed
        self._before_publish = before_publish
        self.pending: collections.deque[SaveRequest] = collections.deque()
        """Saves in flight, oldest first."""
        self.unclean_steps: set[int] = set()
        """Steps whose failed attempt was not removed (an error, or another commit's manifest
        holds the folder): never saved again by this run."""
        self.last_committed: tuple[int, float] | None = None
        """`(step, commit time)` of the newest commit known to this run."""
        # The oldest request's progress ([Note: a non-blocking finalize never waits for a
        # peer]); `_retire` resets it.
        self._phase = Phase.AGREE
        self._round: Pending[Any] | None = None  # its collective in flight, if any
        self._report: bytes | None = None  # this rank's encoded report, once its files are written
        self._report_size = 0  # the agreed (MAX) report size, for the gather
        self._job: CommitJob | None = None  # the coordinator's commit of it
        self._commit_started = 0.0  # monotonic time its agreement completed
        self._failure: _Failure | None = None  # its clean-up, once it failed
        # The next round opens AGREE or COMMIT ([Note: a blocking finalize opens a phase
        # once its own part can end it]).
        self._opening = True
        # The coordinator's commits run here.
        self._thread: BackgroundThread | None = None
        # [Note: the top manifest's tensor records are reused] in commit.py (commit thread).
        self._top_tensors = TopTensors()

    def run(self, *, blocking: bool) -> None:
        """Finalize the oldest requests while all ranks agree they are settled.

        Args:
            blocking: wait until every request in flight is committed or failed; else
                return as soon as the collective in flight is unfinished ([Note: a
                non-blocking finalize never waits for a peer]).

        Raises:
            SaveFailedError: a save failed on some rank (raised on every rank).
            CheckpointError: ranks disagree on the request to finalize.
        """
        while self.pending:
            request = self.pending[0]
            try:
                if self._round is None:
                    if blocking and self._opening:
                        self._await_own_part(request)
                    self._opening = False
                    self._round = self._issue(request)
                if not blocking and not self._round.ready():
                    return  # read by a later call
                done, self._round = self._round, None
                result = done.result()
            except CheckpointError as err:
                self._abandon(request, str(err))
                raise SaveFailedError(request.step, {self._coord.rank: str(err)}) from err
            if self._phase not in _RAW_PHASES:
                result = _Poll.of(request.request_id, result)
                if not result.consistent:
                    cause = (
                        f"ranks disagree on which save to finalize (request "
                        f"{request.request_id}, step {request.step}): call "
                        "save()/maybe_finalize() on every rank alike"
                    )
                    self._abandon(request, cause)
                    raise CheckpointError(cause)
            try:
                if self._advance(request, result):
                    continue  # the next phase's collective is issued at once
                if not blocking:
                    if self._coord.world_size > 1:
                        self._round = self._issue(request)  # read by the next call
                    return
                self._wait_locally(request)
            except SaveFailedError:
                raise
            except CheckpointError as err:  # a collective of the commit itself failed
                self._abandon(request, str(err))
                raise SaveFailedError(request.step, {self._coord.rank: str(err)}) from err

    def _issue(self, request: SaveRequest) -> Pending[Any]:
        """Issue the oldest request's next collective for its phase (without waiting)."""
        rid = request.request_id
        if self._phase is Phase.REPORTS:
            # This rank was OK in the agreeing round, so its report was encoded.
            assert self._report is not None
            return self._coord.gather_bytes_async(self._report, self._report_size)
        if self._failure is not None:  # [Note: a failed save is cleaned up in rounds too]
            failure = self._failure
            if self._phase is Phase.STOPPED:
                return self._coord.max_async([Status.FAILED, rid, -rid, len(failure.body), 0, 0])
            flagged = (b"\x01" if failure.kept else b"\x00") + failure.body
            return self._coord.all_gather_bytes_async(flagged, 1 + failure.size)
        if self._phase is Phase.COMMIT:
            code, when, job = _Code.RUNNING, 0, self._job
            if job is not None and job.done.is_set():
                committed = job.outcome.result is CommitResult.COMMITTED
                code = _Code.COMMITTED if committed else _Code.NOT_COMMITTED
                when = _bits_of(job.outcome.committed_unix_s) if committed else 0
            return self._coord.max_async([Status.OK, rid, -rid, 0, code, when])
        status = request.local_status(self._limits)
        nbytes = 0
        if status == Status.OK:
            # The bulk was pickled by the staging job; this frames it ([Note: the report is
            # encoded before the files are durable] in report.py).
            if self._report is None:
                try:
                    self._report = encode_report(request.contribution, request.report_body)
                except Exception as err:  # reaches every rank as this rank's failure
                    request.fail(f"report encoding failed: {type(err).__name__}: {err}")
                    return self._coord.max_async([Status.FAILED, rid, -rid, 0, 0, 0])
            nbytes = len(self._report)
        return self._coord.max_async([status, rid, -rid, nbytes, 0, 0])

    def _worker(self) -> BackgroundThread:
        if self._thread is None:
            self._thread = BackgroundThread("ckpt-finalize")
        return self._thread

    def _advance(self, request: SaveRequest, result: Any) -> bool:
        """Act on a completed round of the oldest request; True when its phase moved on."""
        if self._phase is Phase.REPORTS:
            self._start_commit(request, result)
            return True
        if self._phase is Phase.CAUSES:
            self._failed(request, result)  # raises
        poll: _Poll = result
        if self._phase is Phase.STOPPED:
            self._remove_failed_attempt(request, poll.report_nbytes)
            return True
        if self._phase is Phase.AGREE:
            if poll.status == Status.WRITING:
                return False
            if poll.status == Status.FAILED:
                self._begin_failure(request)
                return True
            self._commit_started = time.monotonic()
            self._report_size = poll.report_nbytes
            self._phase = Phase.REPORTS
            return True
        if poll.code == _Code.RUNNING:
            return False
        if poll.code == _Code.COMMITTED:
            self._committed(request, poll.committed_unix_s)
        else:
            self._begin_commit_failure()
        return True

    def _await_own_part(self, request: SaveRequest) -> None:
        """A blocking finalize, before the first round of AGREE or COMMIT: wait (bounded) until
        this rank's own part could let that round end the phase.

        [Note: a blocking finalize opens a phase once its own part can end it] A round issued
        while this rank is still staging or writing (AGREE), or while the coordinator's commit
        job still runs (COMMIT), can only come back unfinished, and costs a collective and a
        handful of thread wake-ups on every rank for nothing: `wait_until_finished()` right
        after `save()` opened AGREE while its own copy was running and COMMIT the moment it
        queued the job, 4.1-4.8 rounds per save where 2 end it. So the opening round waits
        first for that news, at most as long as the pause after a round that changed nothing
        ([Note: a blocking finalize polls the agreement]): `OWN_WRITE_POLL_S` for its own
        write, `AGREE_POLL_S` for the commit job. A peer's failure arrives at most that much
        later, as between any two rounds; the peers, whose rounds wait for this rank's
        anyway, are not held longer than before. Non-blocking calls never wait: they issue at
        once, and a blocking call then waits on the round they left in flight.
        """
        if self._failure is not None:
            return
        if self._phase is Phase.COMMIT:
            if self._job is not None:
                self._job.done.wait(AGREE_POLL_S)
            return
        if self._phase is not Phase.AGREE:
            return
        deadline = time.monotonic() + OWN_WRITE_POLL_S
        while request.local_status(self._limits) == Status.WRITING:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            request.wait_for_progress(left)

    def _wait_locally(self, request: SaveRequest) -> None:
        """A blocking finalize's pause between rounds that changed nothing: wait for news
        of this rank's own part ([Note: a blocking finalize polls the agreement])."""
        if self._phase is Phase.COMMIT:
            if self._job is not None:
                self._job.done.wait(AGREE_POLL_S)
            # Other ranks do not pause: the coordinator paces the rounds.
        elif request.state in (SaveState.OK, SaveState.FAILED):
            request.wait_for_progress(AGREE_POLL_S)  # settled here: a peer is still writing
        else:
            request.wait_for_progress(OWN_WRITE_POLL_S)  # its own news ends the wait

    def _stop_local_writer(self, request: SaveRequest) -> None:
        """Kill this rank's writer if it may still touch the request's files or buffer."""
        # Cancel first, then wait for the staging job: afterwards it can no longer hand the
        # request to a writer behind our back (and reuse of the slab is safe).
        request.cancel()
        request.handed_off.wait(self._config.staging_timeout_s)
        writer = request.writer
        if request.abort_sent:  # it drops the file and answers: no need to restart it
            request.await_answer(self._config.writer_start_timeout_s)
        if writer is None or request.answered or writer.exit_code() is not None:
            return
        writer.kill()
        self._forget_writer(writer)  # restarted by the next save()

    def _abandon(self, request: SaveRequest, cause: str) -> None:
        """Local clean-up when the group cannot agree any more (a peer is gone)."""
        if self._job is not None:
            # Its manifest write may still land: wait, so nothing else touches the step
            # folder meanwhile (a committed folder is kept by every removal path anyway).
            self._job.done.wait(self._config.finalize_timeout_s)
        request.fail(cause)
        self._stop_local_writer(request)
        self._retire(request, SaveResult.FAILED, 0.0)

    def _begin_failure(self, request: SaveRequest) -> None:
        """A write failed somewhere: stop this rank's writer, then the STOPPED round."""
        local = request.error  # this rank's cause as the agreement found it (None: no failure)
        self._stop_local_writer(request)
        if self._config.async_mode is AsyncMode.TEMPORAL and request.writer is not None:
            request.writer.kill()
        self._failure = _Failure(body=json.dumps(local).encode())
        self._phase = Phase.STOPPED

    def _begin_commit_failure(self) -> None:
        """The coordinator did not commit: its outcome goes to every rank (after STOPPED:
        the writes are all done, so that round stops nothing)."""
        outcome = self._job.outcome if self._job is not None else None
        body = pickle.dumps(outcome) if outcome is not None else b""
        self._failure = _Failure(body=body, outcome=outcome, commit=True)
        self._phase = Phase.STOPPED

    def _remove_failed_attempt(self, request: SaveRequest, size: int) -> None:
        """Every writer is stopped: the coordinator removes the failed attempt's folder."""
        failure = self._failure
        assert failure is not None
        failure.size = size
        if self._coord.is_coordinator:
            outcome = failure.outcome
            if outcome is not None and outcome.result in (
                CommitResult.CONFLICT,
                CommitResult.FENCED,
            ):
                failure.kept = True  # the folder is the other commit's, or the root another run's
            else:
                failure.kept = not self._remove_attempt(request.step)
        self._phase = Phase.CAUSES

    def _failed(self, request: SaveRequest, payloads: Sequence[bytes]) -> None:
        """Every rank's cause (or the coordinator's outcome) arrived: retire and raise."""
        failure = self._failure
        assert failure is not None
        if payloads[0][:1] == b"\x01":
            self.unclean_steps.add(request.step)
        if failure.commit:
            # Pickled by this run's coordinator ([Note: a failed save is cleaned up in rounds
            # too]), never read from storage.
            outcome = pickle.loads(payloads[0][1:])
            assert isinstance(outcome, CommitOutcome)
            cause = f"commit failed on the coordinator: {outcome.cause}"
            request.fail(cause)
            self._retire(request, SaveResult.FAILED, time.monotonic() - self._commit_started)
            # Every rank raises the same SaveFailedError; on a conflict its __cause__ is the
            # CommitConflictError, when fenced the LeaseLostError, else there is none.
            raise SaveFailedError(request.step, {0: cause}) from outcome.conflict
        said = [json.loads(p[1:]) for p in payloads]
        causes = {r: str(c) for r, c in enumerate(said) if c is not None}
        request.fail("; ".join(f"rank {r}: {c}" for r, c in sorted(causes.items())))
        self._retire(request, SaveResult.FAILED, 0.0)
        raise SaveFailedError(request.step, causes)

    def _remove_attempt(self, step: int) -> bool:
        """Remove the failed attempt's folder; False when it stays (error, or a manifest).

        See [Note: a folder with a manifest is never removed by a failure path] in
        `_store/steps.py`.
        """
        try:
            if self._fence is not None:
                self._fence()  # a fenced run removes nothing: the root is another run's now
            return remove_uncommitted_step(self._storage, step)
        except CheckpointError as err:
            self._log.warning("ckpt_failed_attempt_not_removed", ckpt_step=step, error=str(err))
            return False

    def _start_commit(self, request: SaveRequest, payloads: Sequence[bytes] | None) -> None:
        """The reports arrived: the coordinator queues its commit on the finalizer thread."""
        self._phase = Phase.COMMIT
        self._opening = True
        self._report = None
        if payloads is None:
            return
        job = CommitJob()
        self._job = job
        step, created = request.step, request.created_unix_s
        # Every rank resolves the same config, so the coordinator's spread is everyone's.
        spread = int(request.contribution.get("spread_prefixes", 0))

        def commit() -> CommitOutcome:
            # Unpickled here, off the training thread: at scale it is every rank's report.
            lists = [report_tensor_list(p) for p in payloads] + [str(spread).encode()]
            tensors = self._top_tensors.cached(lists)
            reports = [decode_report(p, tensors=tensors is None) for p in payloads]
            if tensors is None:
                # On a disagreement, commit_step merges again and reports it as the outcome.
                with contextlib.suppress(ValueError):
                    tensors = self._top_tensors.merge(lists, reports)
            return commit_step(
                self._storage,
                fence=self._fence,
                step=step,
                run_id=self._run_id,
                created_unix_s=created,
                reports=reports,
                spread_prefixes=spread,
                tensors=tensors,
                before_publish=self._announce,
            )

        self._worker().submit(lambda: job.run(commit))

    def _announce(self, manifest: Manifest) -> None:
        if self._before_publish is not None:
            self._before_publish(manifest.step, manifest.committed_unix_s, manifest.metrics)

    def close(self, timeout_s: float) -> None:
        """Stop the finalizer's thread (after the job it runs, if any)."""
        if self._thread is not None:
            self._thread.close(timeout_s)
            self._thread = None

    def _committed(self, request: SaveRequest, committed_unix_s: float) -> None:
        self.last_committed = (request.step, committed_unix_s)
        if self._on_committed is not None:
            metrics = request.contribution.get("metrics") or {}
            self._on_committed(request.step, committed_unix_s, metrics)
        self._retire(request, SaveResult.COMMITTED, time.monotonic() - self._commit_started)
        self._log.info("ckpt_committed", ckpt_step=request.step)
        if not self.pending:
            self._on_idle()

    def _retire(self, request: SaveRequest, result: SaveResult, finalize_s: float) -> None:
        if self.pending and self.pending[0] is request:
            self.pending.popleft()
        # The next request starts from AGREE (a round of this one still in flight is dropped:
        # only a broken group leaves one, and nothing is issued on it again).
        self._phase, self._round, self._report, self._job = Phase.AGREE, None, None, None
        self._opening = True
        self._failure = None
        if request.writer is not None and self._config.async_mode is AsyncMode.TEMPORAL:
            request.writer.stop(self._config.writer_start_timeout_s)  # reap the one-shot writer
        latency = time.monotonic() - request.started
        sync = self._config.async_mode is AsyncMode.SYNC
        report = SaveReport(
            step=request.step,
            result=result,
            # In sync mode the whole save, commit included, blocks the training loop.
            stall_s=latency if sync else request.stall_s,
            staging_s=request.staging_s,
            write_s=request.write_s,
            finalize_s=finalize_s,
            latency_s=latency,
            num_bytes=int(request.contribution["size"]) if result is SaveResult.COMMITTED else 0,
            error=request.error if result is SaveResult.FAILED else None,
        )
        if result is SaveResult.FAILED:
            self._log.error("ckpt_save_failed", ckpt_step=request.step, error=request.error)
        if self._observer is not None:
            try:
                self._observer.on_save_finished(report)
            except Exception as err:  # an observer must not break checkpointing
                self._log.warning("ckpt_observer_failed", error=str(err))
