"""Finalizing saves across ranks: agree, commit or fail, report.

The manager queues every `SaveRequest` here (`pending`, oldest first). `run()` takes the
oldest, MAX-agrees its status over the checkpoint group (OK < WRITING < FAILED), and then
commits it (gather contributions, the coordinator writes the manifest exclusively, broadcast
the outcome) or fails it on every rank (gather causes, stop writers, remove the attempt,
raise `SaveFailedError`). A folder that holds a manifest is never removed: when the commit
finds another attempt's manifest there (`CommitResult.CONFLICT`), every rank raises
`SaveFailedError` chained to `CommitConflictError` and the folder stays as it is. Each
finished request becomes a `SaveReport` for the observer. See [Note: finalize at a step
boundary] in `_manager.py`: `run()` is only ever called from the training thread.

[Note: the commit runs off the training thread] The coordinator's part of a commit (building
the top manifest from the gathered reports, the lease checks, the exclusive PUT, reading back
a manifest found there) takes milliseconds to seconds on an object store, and every rank's
training thread used to wait for it inside `maybe_finalize`. Now the round that agrees a
request is written everywhere gathers the reports and hands them to the coordinator's commit
thread (`CommitJob`), and returns. While the job runs the coordinator reports WRITING in the
usual agreement all-reduce, so every rank's later `maybe_finalize` costs that one 24-byte
all-reduce; the round that finds it done broadcasts the outcome and retires the request on
every rank alike. A blocking finalize polls the same way. Requests still commit in order
(only the oldest is ever agreed), and every guarantee of the synchronous commit holds: the
exclusive manifest write is the commit, a failed or conflicting commit raises the same
`SaveFailedError` on every rank, an uncommitted attempt's folder is removed by the
coordinator after the outcome is known (never while its commit may still write).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ckpt_manager._config import AsyncMode, CheckpointConfig
from ckpt_manager._coord import Agreement, Coordinator, Status
from ckpt_manager._save.commit import CommitOutcome, CommitResult, commit_step, rank_report
from ckpt_manager._save.request import Limits, SaveRequest
from ckpt_manager._save.staging import BackgroundThread
from ckpt_manager._save.writer_proc import WriterProcess
from ckpt_manager._store.catalog import remove_uncommitted_step
from ckpt_manager._store.storage import Storage
from ckpt_manager._types import SaveObserver, SaveReport, SaveResult
from ckpt_manager.errors import CheckpointError, SaveFailedError

__all__ = ["AGREE_POLL_S", "CommitJob", "Finalizer"]

AGREE_POLL_S = 0.05
"""Interval of agreement rounds while a blocking finalize waits for some rank's write."""


class CommitJob:
    """The coordinator's commit of one request, run on its commit thread."""

    def __init__(self) -> None:
        """An unfinished job (`done` unset, no outcome yet)."""
        self.done = threading.Event()
        """Set when `outcome` is final."""
        self.outcome = CommitOutcome(CommitResult.FAILED, cause="the commit did not run")
        """The commit's outcome (FAILED until it ran)."""

    def run(self, storage: Storage, fence: Callable[[], None] | None, **commit: Any) -> None:
        """Commit (`commit_step` with `commit`'s arguments), record the outcome, set `done`."""
        try:
            self.outcome = commit_step(storage, fence=fence, **commit)
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
        self.pending: collections.deque[SaveRequest] = collections.deque()
        """Saves in flight, oldest first."""
        self.unclean_steps: set[int] = set()
        """Steps whose failed attempt was not removed (an error, or another commit's manifest
        holds the folder): never saved again by this run."""
        self.last_committed: tuple[int, float] | None = None
        """`(step, commit time)` of the newest commit known to this run."""
        # request id -> (monotonic start, the coordinator's job or None on other ranks) for
        # the request whose commit has started ([Note: the commit runs off the training
        # thread]); at most the oldest request is ever in here.
        self._committing: dict[int, tuple[float, CommitJob | None]] = {}
        self._commit_thread: BackgroundThread | None = None

    def run(self, *, blocking: bool) -> None:
        """Finalize the oldest requests while all ranks agree they are settled.

        Args:
            blocking: wait for this rank's part of each request (else stop at the first
                one still writing anywhere).

        Raises:
            SaveFailedError: a save failed on some rank (raised on every rank).
            CheckpointError: ranks disagree on the request to finalize.
        """
        while self.pending:
            request = self.pending[0]
            try:
                agreement = self._agree(request, blocking=blocking)
            except CheckpointError as err:
                self._abandon(request, str(err))
                raise SaveFailedError(request.step, {self._coord.rank: str(err)}) from err
            t0 = time.monotonic()
            if not agreement.consistent:
                cause = (
                    f"ranks disagree on which save to finalize (request {request.request_id}, "
                    f"step {request.step}): call save()/maybe_finalize() on every rank alike"
                )
                self._abandon(request, cause)
                raise CheckpointError(cause)
            if agreement.status == Status.WRITING:
                return
            try:
                if agreement.status == Status.FAILED:
                    self._fail(request)
                if request.request_id not in self._committing:
                    self._start_commit(request, t0)
                    if not blocking:
                        return  # the next call polls it: one all-reduce
                    continue
                self._finish_commit(request)
            except SaveFailedError:
                raise
            except CheckpointError as err:  # a collective of the commit itself failed
                self._abandon(request, str(err))
                raise SaveFailedError(request.step, {self._coord.rank: str(err)}) from err

    def _agree(self, request: SaveRequest, *, blocking: bool) -> Agreement:
        """One agreement round; when `blocking`, rounds until no rank is still writing.

        [Note: a blocking finalize polls the agreement] A rank never sits inside a collective
        waiting for a peer's write: a slow writer elsewhere would outlast the group's timeout
        (`finalize_timeout_s`), fail the save on every rank and break the group. Instead all
        ranks exchange their local status every `AGREE_POLL_S` (a 24-byte all-reduce) until
        the MAX is OK or FAILED, waiting on their own writer in between. How long a write may
        take is bounded by `write_timeout_s` alone: the late rank's own `local_status` fails
        it (and kills its writer) when that runs out, and FAILED dominates the next round.
        Ranks leave the loop on the same round's result, so they stay in step.
        """
        while True:
            job = self._job_of(request)
            if job is not None and not job.done.is_set():
                status = Status.WRITING  # the coordinator's commit is still running
            else:
                status = request.local_status(self._limits)
            agreement = self._coord.agree(request.request_id, status)
            if not blocking or not agreement.consistent or agreement.status != Status.WRITING:
                return agreement
            if job is not None and not job.done.is_set():
                job.done.wait(AGREE_POLL_S)
            else:
                request.wait_for_progress(AGREE_POLL_S)

    def _job_of(self, request: SaveRequest) -> CommitJob | None:
        started = self._committing.get(request.request_id)
        return None if started is None else started[1]

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
        started = self._committing.pop(request.request_id, None)
        if started is not None and started[1] is not None:
            # Its manifest write may still land: wait, so nothing else touches the step
            # folder meanwhile (a committed folder is kept by every removal path anyway).
            started[1].done.wait(self._config.finalize_timeout_s)
        request.fail(cause)
        self._stop_local_writer(request)
        self._retire(request, SaveResult.FAILED, 0.0)

    def _fail(self, request: SaveRequest) -> None:
        local = request.error if request.error is not None else None
        causes = {r: c for r, c in enumerate(self._coord.all_gather(local)) if c is not None}
        self._stop_local_writer(request)
        if self._config.async_mode is AsyncMode.TEMPORAL and request.writer is not None:
            request.writer.kill()
        removed = True
        self._coord.barrier()  # every writer of this request is stopped
        if self._coord.is_coordinator:
            removed = self._remove_attempt(request.step)
        if not self._coord.broadcast(removed):
            self.unclean_steps.add(request.step)
        request.fail("; ".join(f"rank {r}: {c}" for r, c in sorted(causes.items())))
        self._retire(request, SaveResult.FAILED, 0.0)
        raise SaveFailedError(request.step, causes)

    def _remove_attempt(self, step: int) -> bool:
        """Remove the failed attempt's folder; False when it stays (error, or a manifest).

        See [Note: a folder with a manifest is never removed by a failure path] in
        `_store/catalog.py`.
        """
        try:
            if self._fence is not None:
                self._fence()  # a fenced run removes nothing: the root is another run's now
            return remove_uncommitted_step(self._storage, step)
        except CheckpointError as err:
            self._log.warning("ckpt_failed_attempt_not_removed", ckpt_step=step, error=str(err))
            return False

    def _start_commit(self, request: SaveRequest, t0: float) -> None:
        """Gather the reports; the coordinator queues its commit on the commit thread."""
        gathered = self._coord.gather(rank_report(request.contribution))
        job = None
        if gathered is not None:
            job = CommitJob()
            if self._commit_thread is None:
                self._commit_thread = BackgroundThread("ckpt-commit")
            self._commit_thread.submit(self._commit_job(job, request, gathered))
        self._committing[request.request_id] = (t0, job)

    def _commit_job(
        self, job: CommitJob, request: SaveRequest, reports: Sequence[Any]
    ) -> Callable[[], None]:
        step, created = request.step, request.created_unix_s
        # Every rank resolves the same config, so the coordinator's spread is everyone's.
        spread = int(request.contribution.get("spread_prefixes", 0))

        def run() -> None:
            job.run(
                self._storage,
                self._fence,
                step=step,
                run_id=self._run_id,
                created_unix_s=created,
                reports=reports,
                spread_prefixes=spread,
            )

        return run

    def close(self, timeout_s: float) -> None:
        """Stop the commit thread (after the job it runs, if any)."""
        if self._commit_thread is not None:
            self._commit_thread.close(timeout_s)
            self._commit_thread = None

    def _finish_commit(self, request: SaveRequest) -> None:
        t0, job = self._committing.pop(request.request_id)
        outcome = job.outcome if job is not None else CommitOutcome(CommitResult.COMMITTED)
        outcome = self._coord.broadcast(outcome)
        if outcome.result is not CommitResult.COMMITTED:
            cause = f"commit failed on the coordinator: {outcome.cause}"
            if outcome.result in (CommitResult.CONFLICT, CommitResult.FENCED):
                # The folder is the other commit's, or the root is another run's now.
                removed = False
            else:
                removed = self._remove_attempt(request.step) if self._coord.is_coordinator else True
                removed = self._coord.broadcast(removed)
            if not removed:
                self.unclean_steps.add(request.step)
            request.fail(cause)
            self._retire(request, SaveResult.FAILED, time.monotonic() - t0)
            # Every rank raises the same SaveFailedError; on a conflict its __cause__ is the
            # CommitConflictError, when fenced the LeaseLostError (broadcast from the
            # coordinator), else there is none.
            raise SaveFailedError(request.step, {0: cause}) from outcome.conflict
        self.last_committed = (request.step, outcome.committed_unix_s)
        self._retire(request, SaveResult.COMMITTED, time.monotonic() - t0)
        self._log.info("ckpt_committed", ckpt_step=request.step)
        if not self.pending:
            self._on_idle()

    def _retire(self, request: SaveRequest, result: SaveResult, finalize_s: float) -> None:
        if self.pending and self.pending[0] is request:
            self.pending.popleft()
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
