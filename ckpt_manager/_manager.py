"""`CheckpointManager`: save asynchronously, commit across ranks, retain, restore.

Save pipeline of one step (every rank, same steps)::

    save()            [trainer]   wait for a free slot (stall), flatten, plan the file,
                                  hand the snapshot job to the staging thread, return
    staging thread                copy tensors into shared memory (overlaps forward/backward),
                                  then send the write request to the writer process
    before_optimizer_step()       fence: wait for the copy (stall) before tensors change
    writer process                crc32 + atomic write of the shard file, answer "done"
    maybe_finalize()  [trainer]   MAX-agree on the oldest request; all OK -> gather
                                  contributions, coordinator writes manifest.json
                                  exclusively, broadcast outcome; any FAILED -> every rank
                                  raises SaveFailedError naming ranks and causes

[Note: finalize at a step boundary] Agreement runs on the training thread at the same
control-flow point on every rank (never from a background thread), so the collectives of
the dedicated gloo group line up without extra barriers; every one is bounded by
`finalize_timeout_s`.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import structlog
import torch

from ckpt_manager._commit import build_contribution, commit_manifest, leaves_to_write
from ckpt_manager._config import AsyncMode, CheckpointConfig
from ckpt_manager._coord import Coordinator, Status
from ckpt_manager._deleter import Deleter
from ckpt_manager._format import plan_layout
from ckpt_manager._lease import Lease
from ckpt_manager._manifest import shard_file_name, step_dir
from ckpt_manager._recover import restore_agreed
from ckpt_manager._request import Limits, SaveRequest
from ckpt_manager._restore import committed_steps, drop_dead_attempts
from ckpt_manager._staging import BackgroundThread, Slab, copy_into_slab
from ckpt_manager._storage import Storage
from ckpt_manager._tree import flatten
from ckpt_manager._types import ManagerStats, RestoreResult, SaveObserver, SaveReport, SaveResult
from ckpt_manager._writer import write_shard
from ckpt_manager._writer_proc import WriterProcess
from ckpt_manager.errors import (
    CheckpointError,
    CheckpointTimeoutError,
    LeaseHeldError,
    SaveFailedError,
)

__all__ = ["CheckpointManager"]

_log = structlog.get_logger("ckpt_manager")


class CheckpointManager:
    """Asynchronous, coordinated, atomic checkpoints of one run under one root.

    Construct it on every rank (it is collective: it creates the checkpoint gloo group and
    takes the root's lease on rank 0). Call `save()`, `maybe_finalize()` and `restore()` on
    every rank at the same steps.
    """

    def __init__(
        self,
        root_uri: str,
        config: CheckpointConfig | None = None,
        *,
        run_id: str | None = None,
        observer: SaveObserver | None = None,
    ) -> None:
        """Open the root, take the lease, start the writer.

        Args:
            root_uri: local path, `file://`, `s3://bucket/prefix`, `memory://` or any fsspec URL.
            config: behaviour; defaults to `CheckpointConfig()`.
            run_id: identity of this run for the lease (default: random, from rank 0).
            observer: receives a `SaveReport` per finished save.

        Raises:
            ValueError: the root cannot be opened or the config does not fit it.
            LeaseHeldError: another live run holds the root (raised on every rank).
        """
        self.config = config if config is not None else CheckpointConfig()
        self._storage = Storage(root_uri, self.config.storage_options)
        if (
            not self._storage.shared_across_processes
            and self.config.async_mode is not AsyncMode.SYNC
        ):
            raise ValueError(
                f"{root_uri!r} lives in this process only; writer processes cannot see it: "
                "use CheckpointConfig(async_mode=AsyncMode.SYNC)"
            )
        self._observer = observer
        self._coord = Coordinator(self.config.finalize_timeout_s)
        self.rank = self._coord.rank
        """This rank."""
        self.world_size = self._coord.world_size
        """Ranks in the run."""
        self.run_id: str = self._coord.broadcast(run_id if run_id else uuid.uuid4().hex)
        """Run identity (rank 0's)."""
        self._log = _log.bind(rank=self.rank)
        self._limits = Limits(
            self.config.staging_timeout_s,
            self.config.writer_start_timeout_s,
            self.config.write_timeout_s,
        )
        self._pending: collections.deque[SaveRequest] = collections.deque()
        self._slabs: list[Slab | None] = [None] * self.config.max_inflight
        self._next_request_id = 0
        self._next_slab_id = 0
        self._unclean_steps: set[int] = set()
        self._restored_from: int | None = None
        self._closed = False
        self._lease: Lease | None = None
        self._deleter: Deleter | None = None
        self._stager: BackgroundThread | None = None
        self._writer: WriterProcess | None = None
        self._last_committed: tuple[int, float] | None = None
        self._open_root()
        if self.config.async_mode is not AsyncMode.SYNC:
            self._stager = BackgroundThread(f"ckpt-stager-{self.rank}")
        if self.config.async_mode is AsyncMode.PERSISTENT:
            self._writer = WriterProcess(self.rank)

    # ----------------------------------------------------------------- start-up
    def _open_root(self) -> None:
        outcome: tuple[str, str, Any] | None = None
        if self._coord.is_coordinator:
            try:
                self._lease = Lease(self._storage, self.run_id, self.config.lease_ttl_s)
                self._lease.acquire()
                outcome = ("ok", "", drop_dead_attempts(self._storage))
            except LeaseHeldError as err:
                outcome = ("lease", str(err), None)
            except CheckpointError as err:
                outcome = ("error", str(err), None)
        outcome = self._coord.broadcast(outcome)
        assert outcome is not None
        kind, message, latest = outcome
        if kind != "ok":
            if self._lease is not None and kind != "lease":
                self._lease.release()
            self._coord.destroy()
            raise LeaseHeldError(message) if kind == "lease" else CheckpointError(message)
        self._last_committed = (int(latest[0]), float(latest[1])) if latest is not None else None
        if self._coord.is_coordinator:
            self._deleter = Deleter(
                self._storage,
                self.config.retention,
                saving=lambda: bool(self._pending),
                protected=self._protected_steps,
                grace_s=self.config.uncommitted_grace_s,
                retry_s=self.config.deletion_retry_s,
            )
            # No pass before this run's first commit: the run may still restore an old step.

    def _protected_steps(self) -> set[int]:
        return {self._restored_from} if self._restored_from is not None else set()

    # ----------------------------------------------------------------- save
    def save(self, step: int, state: Any, metrics: Mapping[str, Any] | None = None) -> None:
        """Start saving `state` as `step`; returns once the snapshot is queued.

        Every rank calls it with the same step. Tensors must not change until
        `before_optimizer_step()` returns (the copy runs in the background until then).

        Args:
            step: training step (greater than every committed step).
            state: nested dicts/lists of tensors, ShardedTensorLike, RankLocal, JSON values.
            metrics: JSON values stored in the manifest (used by `KeepBest`).

        Raises:
            ValueError: bad step, metrics or state.
            SaveFailedError: an older save that had to be finalized first failed.
            CheckpointError: the manager is closed or a collective failed.
        """
        started = time.monotonic()
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        metrics = dict(metrics or {})
        try:
            json.dumps(metrics, allow_nan=True)
        except (TypeError, ValueError) as err:
            raise ValueError(f"metrics must be JSON values: {err}") from err
        newest = max([r.step for r in self._pending], default=-1)
        if self._last_committed is not None:
            newest = max(newest, self._last_committed[0])
        if step <= newest:
            raise ValueError(
                f"step {step} is not after the newest saved step {newest}: a step is never "
                "written twice (to roll back, delete the newer steps first, e.g. with "
                "`ckptctl prune`, or save under another root)"
            )
        if step in self._unclean_steps:
            raise CheckpointError(
                f"step {step}: the folder of its failed save could not be removed; "
                "save a later step"
            )
        while len(self._pending) >= self.config.max_inflight:
            self._finalize(blocking=True)
        request = self._prepare(step, state, metrics, started)
        self._pending.append(request)
        if self.config.async_mode is AsyncMode.SYNC:
            self._stage_and_dispatch(request)
            request.stall_s += time.monotonic() - started
            self._finalize(blocking=True)
            return
        assert self._stager is not None
        self._stager.submit(lambda: self._stage_and_dispatch(request))
        request.stall_s += time.monotonic() - started

    def _prepare(
        self, step: int, state: Any, metrics: dict[str, Any], started: float
    ) -> SaveRequest:
        flat = flatten(state)
        leaves = leaves_to_write(flat, self.rank)
        layout = plan_layout([(x.key, x.tensor.dtype, tuple(x.tensor.shape)) for x in leaves])
        file_name = shard_file_name(self.rank) if leaves else None
        slot = next(i for i in range(self.config.max_inflight) if not self._slot_in_use(i))
        if self.config.async_mode is AsyncMode.PERSISTENT and (
            self._writer is None or self._writer.exit_code() is not None
        ):
            if self._writer is not None:
                self._log.warning("ckpt_writer_restarted", old_pid=self._writer.pid)
                self._writer.kill()
            self._writer = WriterProcess(self.rank)
        request = SaveRequest(
            request_id=self._next_request_id,
            step=step,
            created_unix_s=time.time(),
            started=started,
            slot=slot,
            layout=layout,
            file_name=file_name,
            contribution=build_contribution(self.rank, flat, leaves, layout, file_name, metrics),
            writer=self._writer if self.config.async_mode is AsyncMode.PERSISTENT else None,
        )
        request.tensors = [x.tensor for x in leaves]
        self._next_request_id += 1
        return request

    def _slot_in_use(self, slot: int) -> bool:
        return any(r.slot == slot for r in self._pending)

    def _slab_for(self, slot: int, nbytes: int) -> Slab:
        """The slot's staging buffer, (re)allocated when too small (staging thread only)."""
        slab = self._slabs[slot]
        if slab is not None and slab.capacity >= nbytes:
            return slab
        if slab is not None:
            if self._writer is not None:
                self._writer.drop_slab(slab.slab_id)
            slab.close()
        slab = self._slabs[slot] = Slab(self._next_slab_id, nbytes)
        self._next_slab_id += 1
        return slab

    def _stage_and_dispatch(self, request: SaveRequest) -> None:
        """Staging-thread job (inline in sync mode): copy, then hand to the writer."""
        try:
            self._stage(request)
            if request.error is None and not request.cancelled:
                self._dispatch(request)
        finally:
            request.copied.set()
            request.handed_off.set()

    def _stage(self, request: SaveRequest) -> None:
        tensors: list[torch.Tensor] = request.tensors
        try:
            t0 = time.monotonic()
            # Allocating here, not in save(), keeps even the first save() non-blocking.
            request.slab = self._slab_for(request.slot, request.layout.total_bytes)
            copy_into_slab(request.slab, request.layout, tensors)
            request.staging_s = time.monotonic() - t0
        except Exception as err:
            request.fail(f"snapshot copy failed: {type(err).__name__}: {err}")
        finally:
            request.tensors = []
            request.copied.set()  # the training loop may now change the tensors

    def _dispatch(self, request: SaveRequest) -> None:
        slab = request.slab
        assert slab is not None
        if request.file_name is None:
            request.done = True
            request.dispatched = time.monotonic()
            return
        name = f"{step_dir(request.step)}/{request.file_name}"
        if self.config.async_mode is AsyncMode.SYNC:
            self._write_inline(request, name)
            return
        try:
            if self.config.async_mode is AsyncMode.TEMPORAL:
                request.writer = WriterProcess(self.rank)
            assert request.writer is not None
            request.dispatched = time.monotonic()
            request.writer.submit(slab, self._write_message(request, name, slab))
            if self.config.async_mode is AsyncMode.TEMPORAL:
                request.writer.request_stop()
        except OSError as err:
            request.fail(f"writer process unreachable: {err}")

    def _write_message(self, request: SaveRequest, name: str, slab: Slab) -> dict[str, Any]:
        return {
            "op": "write",
            "request_id": request.request_id,
            "step": request.step,
            "name": name,
            "slab_id": slab.slab_id,
            "nbytes": request.layout.total_bytes,
            "root_uri": self._storage.root_uri,
            "storage_options": dict(self._storage.storage_options),
            "chunk_bytes": self.config.upload_chunk_bytes,
            "concurrency": self.config.upload_concurrency,
        }

    def _write_inline(self, request: SaveRequest, name: str) -> None:
        request.dispatched = t0 = time.monotonic()
        assert request.slab is not None
        view = request.slab.view(request.layout.total_bytes)
        try:
            size, crc = write_shard(
                self._storage,
                name,
                view,
                chunk_bytes=self.config.upload_chunk_bytes,
                concurrency=self.config.upload_concurrency,
            )
            request.contribution.update(size=size, crc32=crc)
            request.done = True
        except CheckpointError as err:
            request.fail(f"write failed: {err}")
        finally:
            view.release()
            request.write_s = time.monotonic() - t0

    def before_optimizer_step(self) -> None:
        """Fence: return once every snapshot copy is done, so tensors may change.

        Raises:
            CheckpointTimeoutError: a copy did not finish within `staging_timeout_s`.
        """
        for request in list(self._pending):
            if request.copied.is_set():
                continue
            t0 = time.monotonic()
            finished = request.copied.wait(self.config.staging_timeout_s)
            request.stall_s += time.monotonic() - t0
            if not finished:
                raise CheckpointTimeoutError(
                    f"snapshot copy of step {request.step} did not finish within "
                    f"{self.config.staging_timeout_s:.0f} s"
                )

    # ----------------------------------------------------------------- finalize
    def maybe_finalize(self) -> None:
        """Commit finished saves without blocking; call on every rank at every step.

        Costs nothing when no save is in flight; otherwise one small all-reduce on the
        checkpoint group per call.

        Raises:
            SaveFailedError: a save failed on some rank (raised on every rank).
            CheckpointError: a checkpoint collective failed (a peer died or timed out).
        """
        self._check_open()
        self._finalize(blocking=False)

    def wait_until_finished(self) -> None:
        """Block until every save in flight is committed or failed (collective).

        Raises:
            SaveFailedError: a save failed on some rank.
        """
        self._check_open()
        self._finalize(blocking=True)
        if self._deleter is not None:
            self._deleter.flush(self.config.finalize_timeout_s)

    def check_for_errors(self) -> None:
        """Raise now if a save in flight already failed on this rank (local, no collective).

        The same failure is still agreed and raised on every rank by the next
        `maybe_finalize()` / `wait_until_finished()`.

        Raises:
            SaveFailedError: this rank's part of an in-flight save failed.
        """
        for request in self._pending:
            if request.local_status(self._limits) == Status.FAILED:
                raise SaveFailedError(request.step, {self.rank: request.error or "failed"})

    def _finalize(self, *, blocking: bool) -> None:
        while self._pending:
            request = self._pending[0]
            if blocking:
                status = request.wait_local(self._limits)
            else:
                status = request.local_status(self._limits)
            t0 = time.monotonic()
            try:
                agreement = self._coord.agree(request.request_id, status)
            except CheckpointError as err:
                self._abandon(request, str(err))
                raise SaveFailedError(request.step, {self.rank: str(err)}) from err
            if not agreement.consistent:
                cause = (
                    f"ranks disagree on which save to finalize (request {request.request_id}, "
                    "step {request.step}): call save()/maybe_finalize() on every rank alike"
                )
                self._abandon(request, cause)
                raise CheckpointError(cause)
            if agreement.status == Status.WRITING:
                return
            try:
                if agreement.status == Status.FAILED:
                    self._fail(request)
                self._commit(request, t0)
            except SaveFailedError:
                raise
            except CheckpointError as err:  # a collective of the commit itself failed
                self._abandon(request, str(err))
                raise SaveFailedError(request.step, {self.rank: str(err)}) from err

    def _stop_local_writer(self, request: SaveRequest) -> None:
        """Kill this rank's writer if it may still touch the request's files or buffer."""
        # Cancel first, then wait for the staging job: afterwards it can no longer hand the
        # request to a writer behind our back (and reuse of the slab is safe).
        request.cancelled = True
        request.handed_off.wait(self.config.staging_timeout_s)
        writer = request.writer
        if writer is None or request.answered or writer.exit_code() is not None:
            return
        writer.kill()
        if writer is self._writer:
            self._writer = None  # restarted by the next save()

    def _abandon(self, request: SaveRequest, cause: str) -> None:
        """Local clean-up when the group cannot agree any more (a peer is gone)."""
        request.fail(cause)
        self._stop_local_writer(request)
        self._retire(request, SaveResult.FAILED, 0.0)

    def _fail(self, request: SaveRequest) -> None:
        local = request.error if request.error is not None else None
        causes = {r: c for r, c in enumerate(self._coord.all_gather(local)) if c is not None}
        self._stop_local_writer(request)
        if self.config.async_mode is AsyncMode.TEMPORAL and request.writer is not None:
            request.writer.kill()
        removed = True
        self._coord.barrier()  # every writer of this request is stopped
        if self._coord.is_coordinator:
            removed = self._remove_attempt(request.step)
        if not self._coord.broadcast(removed):
            self._unclean_steps.add(request.step)
        request.fail("; ".join(f"rank {r}: {c}" for r, c in sorted(causes.items())))
        self._retire(request, SaveResult.FAILED, 0.0)
        raise SaveFailedError(request.step, causes)

    def _remove_attempt(self, step: int) -> bool:
        try:
            self._storage.remove_tree(step_dir(step))
            return True
        except CheckpointError as err:
            self._log.warning("ckpt_failed_attempt_not_removed", ckpt_step=step, error=str(err))
            return False

    def _commit(self, request: SaveRequest, t0: float) -> None:
        gathered = self._coord.gather(request.contribution)
        outcome: tuple[bool, str | float] = (True, 0.0)
        if gathered is not None:
            outcome = commit_manifest(
                self._storage,
                step=request.step,
                run_id=self.run_id,
                created_unix_s=request.created_unix_s,
                contributions=gathered,
            )
        ok, detail = self._coord.broadcast(outcome)
        if not ok:
            cause = f"commit failed on the coordinator: {detail}"
            removed = self._remove_attempt(request.step) if self._coord.is_coordinator else True
            if not self._coord.broadcast(removed):
                self._unclean_steps.add(request.step)
            request.fail(cause)
            self._retire(request, SaveResult.FAILED, time.monotonic() - t0)
            raise SaveFailedError(request.step, {0: cause})
        assert isinstance(detail, float)
        self._last_committed = (request.step, detail)
        self._retire(request, SaveResult.COMMITTED, time.monotonic() - t0)
        self._log.info("ckpt_committed", ckpt_step=request.step)
        if self._deleter is not None and not self._pending:
            self._deleter.trigger()

    def _retire(self, request: SaveRequest, result: SaveResult, finalize_s: float) -> None:
        if self._pending and self._pending[0] is request:
            self._pending.popleft()
        if request.writer is not None and self.config.async_mode is AsyncMode.TEMPORAL:
            request.writer.stop(self.config.writer_start_timeout_s)  # reap the one-shot writer
        latency = time.monotonic() - request.started
        sync = self.config.async_mode is AsyncMode.SYNC
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

    # ----------------------------------------------------------------- queries
    def latest_step(self) -> int | None:
        """Newest committed step under the root (manifest present), or None."""
        steps = committed_steps(self._storage)
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Every committed step under the root, ascending."""
        return committed_steps(self._storage)

    def stats(self) -> ManagerStats:
        """In-flight count and the last commit."""
        last = self._last_committed
        return ManagerStats(
            inflight=len(self._pending),
            last_committed_step=last[0] if last else None,
            last_committed_unix_s=last[1] if last else None,
        )

    @property
    def writer_pid(self) -> int | None:
        """Pid of the persistent writer process (None in other modes or before start)."""
        return self._writer.pid if self._writer is not None else None

    @property
    def storage(self) -> Storage:
        """The checkpoint root."""
        return self._storage

    # ----------------------------------------------------------------- restore
    def restore(self, step: int | None = None, into: Any = None) -> RestoreResult | None:
        """Restore a step on every rank (collective).

        Args:
            step: the step; None restores the newest committed step whose files verify,
                skipping (with a warning) corrupt ones.
            into: optional template: its tensors / sharded tensors are filled in place
                (resharded from the saved offsets at any world size) and its structure
                is returned.

        Returns:
            `RestoreResult(step, state)`, or None when no valid checkpoint exists and
            `step` is None.

        Raises:
            StepNotFoundError: the explicit step is not committed.
            CorruptCheckpointError: the explicit step fails verification.
            CheckpointError: the template does not match the checkpoint.
        """
        self._check_open()
        result = restore_agreed(
            self._storage,
            self._coord,
            step,
            into,
            verify_checksums=self.config.verify_checksums,
        )
        if result is not None:
            self._restored_from = result.step
        return result

    # ----------------------------------------------------------------- shutdown
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("the checkpoint manager is closed")

    def close(self) -> None:
        """Finish saves in flight (collective), stop the writer and threads, drop the lease.

        Raises:
            SaveFailedError: a save in flight failed (everything is still shut down).
        """
        if self._closed:
            return
        try:
            if self._pending:
                self._finalize(blocking=True)
        finally:
            self._closed = True
            self._shutdown()

    def _shutdown(self) -> None:
        timeout = self.config.writer_start_timeout_s
        if self._stager is not None:
            self._stager.close(timeout)
        for request in self._pending:
            if request.writer is not None and request.writer is not self._writer:
                request.writer.kill()
        self._pending.clear()
        if self._writer is not None:
            self._writer.stop(timeout)
            self._writer = None
        if self._deleter is not None:
            self._deleter.close(timeout)
        if self._lease is not None:
            self._lease.release()
        for slab in self._slabs:
            if slab is not None:
                slab.close()
        self._slabs = [None] * self.config.max_inflight
        self._coord.destroy()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError as err:  # keep the body's exception, not ours
            self._log.error("ckpt_close_failed", error=str(err))
