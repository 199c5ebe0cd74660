"""`CheckpointManager`: save asynchronously, commit across ranks, retain, restore.

Save pipeline of one step (every rank, same steps)::

    save()            [trainer]   wait for a free slot (stall), flatten, plan the file,
                                  hand the snapshot job to the staging thread, return
    staging thread                copy tensors into shared memory (overlaps forward/backward),
                                  checksumming each chunk as it lands (CRC-32C), then
                                  send the write request to the writer process
    before_optimizer_step()       fence: wait for the copy (stall) before tensors change
    writer process                atomic write of the shard file from the slab, answer "done"
    maybe_finalize()  [trainer]   poll (async, read by a later call) the oldest request's
                                  status; all OK -> gather the reports (async), the
                                  coordinator writes manifest.json exclusively on its
                                  finalizer thread, later polls carry the outcome; any
                                  FAILED -> every rank raises SaveFailedError naming ranks
                                  and causes

With the memory tier (`CheckpointConfig.memory`) the shared memory is a slot file on a tmpfs
that outlives the rank, the staging copy adds the leaves the shard file leaves out, and the
slot's meta is written once copied; `save(..., durable=False)` stops there. `restore()` tries
the newest step every rank holds in memory before the durable tier ([Note: the memory tier]
in `_memory/`).

`write_in_flight()` tells a caller that must never stall on storage whether a durable
`save()` now would wait for a write still in progress on this rank
(`_save/request.write_blocking_next_save`); the caller agrees across ranks and saves later.

[Note: finalize at a step boundary] Agreement runs on the training thread at the same
control-flow point on every rank (never from a background thread), so the collectives of
the dedicated gloo group line up without extra barriers; every one is bounded by
`finalize_timeout_s`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import structlog

from ckpt_manager._config import AsyncMode, CheckpointConfig
from ckpt_manager._coord import Coordinator, Status
from ckpt_manager._format.dtensor import unwrap_dtensors, wrap_dtensors
from ckpt_manager._format.layout import shard_file_name
from ckpt_manager._format.shard_file import FileLayout
from ckpt_manager._format.tree import Flattened, LeafMemo, TensorLeaf, flatten
from ckpt_manager._load.quarantine import Quarantine
from ckpt_manager._load.recover import restore_agreed
from ckpt_manager._memory.restore import restore_from_memory
from ckpt_manager._memory.tier import MemoryTier
from ckpt_manager._retention.deleter import Deleter
from ckpt_manager._root import BackgroundOpen, RootOutcome, open_root, outcome_of, probe_root
from ckpt_manager._save.device_copy import DeviceFence
from ckpt_manager._save.finalize import Finalizer
from ckpt_manager._save.pipeline import LocalPipeline
from ckpt_manager._save.plan import PlanCache, leaves_to_write
from ckpt_manager._save.report import ReportCache
from ckpt_manager._save.request import Limits, SaveRequest, write_blocking_next_save
from ckpt_manager._save.snapshots import Snapshots
from ckpt_manager._save.writer_proc import WriterProcess
from ckpt_manager._store.lease import Lease
from ckpt_manager._store.steps import committed_steps
from ckpt_manager._store.storage import Storage
from ckpt_manager._types import (
    FINALIZE_CALLS_KEPT,
    ManagerStats,
    RestoreProgress,
    RestoreResult,
    SaveObserver,
)
from ckpt_manager.errors import (
    CheckpointError,
    CheckpointTimeoutError,
    LeaseHeldError,
    SaveFailedError,
    StaleMemoryRestoreError,
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
            run_id: identity of this run for the lease (default: random, from rank 0); with
                the memory tier, also of its snapshots: a restarted rank restores from memory
                only under the same run id.
            observer: receives a `SaveReport` per finished save (and, optionally, each memory
                snapshot: `SaveObserver`).

        Raises:
            ValueError: the root cannot be opened, the config does not fit it, or the memory
                tier's directory does not exist.
            LeaseHeldError: another live run holds the root (raised on every rank).
        """
        self.config = config if config is not None else CheckpointConfig()
        memory = self.config.memory
        if memory is not None and not os.path.isdir(memory.directory):
            # Before any collective: a rank that raises later would leave its peers waiting.
            raise ValueError(
                f"memory tier directory {memory.directory!r} does not exist: the caller "
                "creates it (on a tmpfs such as /dev/shm) before the checkpoint manager starts"
            )
        self._storage = Storage(root_uri, self.config.storage_options)
        if (
            not self._storage.capabilities.shared_across_processes
            and self.config.async_mode is not AsyncMode.SYNC
        ):
            raise ValueError(
                f"{root_uri!r} lives in this process only; writer processes cannot see it: "
                "use CheckpointConfig(async_mode=AsyncMode.SYNC)"
            )
        self._coord = Coordinator(self.config.finalize_timeout_s)
        # The finalizer's own group: its polls stay in flight between calls, so no other
        # collective may share their group ([Note: collectives the training thread does not
        # wait for] in `_coord.py`).
        self._final_coord = Coordinator(self.config.finalize_timeout_s)
        self.rank = self._coord.rank
        """This rank."""
        self.world_size = self._coord.world_size
        """Ranks in the run."""
        self.run_id: str = self._coord.broadcast(run_id if run_id else uuid.uuid4().hex)
        """Run identity (rank 0's)."""
        self._log = _log.bind(rank=self.rank)
        self._memory: MemoryTier | None = None
        self._snapshots: Snapshots | None = None
        if memory is not None:
            self._memory = MemoryTier(
                memory,
                rank=self.rank,
                world_size=self.world_size,
                run_id=self.run_id,
                max_extra=self.config.max_inflight,
            )
            self._snapshots = Snapshots(self._memory, observer, self.rank, self._log)
        self._limits = Limits(
            self.config.staging_timeout_s,
            self.config.writer_start_timeout_s,
            self.config.write_timeout_s,
        )
        self._next_request_id = 0
        self._restored_from: int | None = None
        self._restoring: int | None = None  # the candidate a restore is reading now
        self._closed = False
        self._lease: Lease | None = None
        self._opening: BackgroundOpen | None = None  # coordinator, while the root is pending
        self._root_pending = False
        self._root_deferred = False  # [Note: the root opens after a memory restore]
        self._memory_restored: int | None = None  # the step a memory restore returned
        self._deferred_polls = 0  # `write_in_flight()` calls while the opening is deferred
        self._restore_returned = False
        # The newest step `save()` queued durably ([Note: whose leftover] in the deleter).
        self._newest_durable_save: int | None = None
        self._deleter: Deleter | None = None
        self._final = Finalizer(
            config=self.config,
            storage=self._storage,
            coord=self._final_coord,
            run_id=self.run_id,
            limits=self._limits,
            observer=observer,
            log=self._log,
            forget_writer=self._forget_writer,
            on_idle=self._wake_deleter,
            fence=self._confirm_lease,
            on_committed=self._note_committed,
            before_publish=self._note_commit_to_retention,
        )
        self._pending = self._final.pending  # the same deque: saves in flight, oldest first
        self._finalize_calls: collections.deque[float] = collections.deque(
            maxlen=FINALIZE_CALLS_KEPT
        )
        self._open_root()
        self._pipeline = LocalPipeline(
            self.config, self._storage, self.rank, self._log, self._memory
        )
        self._plans = PlanCache()  # [Note: the plan cache] in _save/plan.py
        self._leaves = LeafMemo()  # [Note: a sharded leaf is validated once] in _format/tree.py
        # [Note: the report skeleton is reused while the layout is unchanged] in report.py
        self._reports = ReportCache()

    # ----------------------------------------------------------------- start-up
    def _open_root(self, *, at_start: bool = True) -> None:
        """Open the root (collective), or leave it pending ([Note: a rank starts while its
        durable root is unreachable] in `_root.py`) or, at start, deferred ([Note: the root
        opens after a memory restore] there). A failure at start also ends the manager's
        groups (the constructor raises); a later one leaves them to `close()`."""
        self._root_deferred = False
        outcome: RootOutcome | None = None
        if self._coord.is_coordinator:
            outcome = self._open_on_coordinator(allow_defer=at_start)
        outcome = self._coord.broadcast(outcome)
        assert outcome is not None
        if outcome.kind == "deferred":
            self._root_pending = self._root_deferred = True
            self._log.info("ckpt_root_open_deferred", reason=outcome.message)
            return
        if outcome.kind == "pending":
            self._root_pending = True
            self._log.warning(
                "ckpt_root_unreachable_training_continues",
                reason=outcome.message,
                note="memory snapshots go on; durable saves wait for the root to open",
            )
            return
        if outcome.kind != "ok":
            if at_start:
                self._final_coord.destroy()
                self._coord.destroy()
            if outcome.kind == "lease":
                raise LeaseHeldError(outcome.message)
            raise CheckpointError(outcome.message)
        self._root_opened(outcome)

    def _open_on_coordinator(self, *, allow_defer: bool) -> RootOutcome:
        if allow_defer and self._memory is not None and self._memory.holds_this_run():
            return RootOutcome("deferred", "a memory restore may follow")
        if self._memory is not None:
            unreachable = probe_root(self._storage, self.config)
            if unreachable is not None:
                self._opening = BackgroundOpen(self._storage, self.run_id, self.config, unreachable)
                return RootOutcome("pending", unreachable)
        try:
            opened = open_root(self._storage, self.run_id, self.config)
        except CheckpointError as err:
            return outcome_of(err)
        self._lease = opened.lease
        return RootOutcome("ok", latest=opened.latest)

    def _sync_root(self, step: int) -> None:
        """Every rank learns how the pending root's opening went (collective: the first
        durable save after a start with the root unreachable).

        Raises:
            LeaseHeldError: another live run holds the root.
            SaveFailedError: the root is still unreachable (after waiting up to half the
                collective timeout), or refused the opening; the next durable save tries
                again.
        """
        outcome: RootOutcome | None = None
        if self._opening is not None:  # the coordinator
            wait_s = 0.0 if self._opening.done() else self.config.finalize_timeout_s / 2
            outcome = self._opening.wait(wait_s)
            if outcome.kind == "ok":
                self._lease = self._opening.take().lease
                self._opening.close(0)
                self._opening = None
            elif outcome.kind == "error":  # refused for good this time: start over
                self._opening.close(0)
                self._opening = BackgroundOpen(
                    self._storage, self.run_id, self.config, outcome.message
                )
        outcome = self._coord.broadcast(outcome)
        assert outcome is not None
        if outcome.kind == "lease":
            raise LeaseHeldError(outcome.message)
        if outcome.kind != "ok":
            raise SaveFailedError(step, {0: outcome.message})
        self._root_pending = False
        self._log.info("ckpt_root_open", ckpt_step=step)
        self._root_opened(outcome)

    def _begin_deferred_open(self) -> None:
        """Start a deferred opening in the background (local: the coordinator's thread does
        the work; every rank stays pending until `_sync_root`)."""
        if not self._root_deferred:
            return
        self._root_deferred = False
        if self._coord.is_coordinator:
            self._opening = BackgroundOpen(
                self._storage, self.run_id, self.config, "deferred behind the memory restore"
            )

    def _check_memory_restore(self, latest: tuple[int, float] | None) -> None:
        """Raise if the memory restore went back past a commit the root holds ([Note: the
        root opens after a memory restore] in `_root.py`): drop this rank's snapshots and
        record the commit as the floor first, so a restart restores it durably."""
        restored, self._memory_restored = self._memory_restored, None
        if restored is None or latest is None or latest[0] <= restored:
            return
        assert self._memory is not None
        if self._snapshots is not None:
            with contextlib.suppress(CheckpointError):
                self._snapshots.collect(self.config.staging_timeout_s, everything=True)
        self._memory.drop_timeline(latest[0])
        error = StaleMemoryRestoreError(restored, latest[0])
        self._log.error("ckpt_memory_restore_stale", error=str(error))
        raise error

    def _check_opening(self) -> None:
        """On the coordinator, as soon as a deferred opening has ended: the check above."""
        opening = self._opening
        if self._memory_restored is None or opening is None or not opening.done():
            return
        outcome = opening.wait(0)
        if outcome.kind == "ok":
            self._check_memory_restore(outcome.latest)

    def _root_opened(self, outcome: RootOutcome) -> None:
        self._check_memory_restore(outcome.latest)
        if outcome.latest is not None:
            self._final.last_committed = (int(outcome.latest[0]), float(outcome.latest[1]))
        if self._coord.is_coordinator:
            self._deleter = Deleter(
                self._storage,
                self.config.retention,
                # A fenced run deletes nothing: the deleter waits as if a save were in flight.
                saving=lambda: bool(self._pending) or self._lease_lost(),
                protected=self._protected_steps,
                grace_s=self.config.uncommitted_grace_s,
                retry_s=self.config.deletion_retry_s,
                newest_saved=lambda: self._newest_durable_save,
            )
            # [Note: retention waits for the run's restore] The deleter does nothing (not even
            # on its timer) until this run has restored (`restore()` returned) or committed:
            # before that, the step the run will restore from is unknown, and with a corrupt
            # newest step a tightened policy would delete the only restorable one. From then
            # on the restored step (and, during a later restore, the candidate being read) is
            # protected, so the newest step known to verify is never deleted.
            if self._restore_returned:  # the root opened after the restore
                self._deleter.arm()

    def _confirm_lease(self) -> None:
        if self._lease is not None:
            self._lease.confirm()

    def _held_lease(self) -> None:
        """`_confirm_lease`, and a refusal while the root is pending: no lease is held yet, so
        nothing in the root may change ([Note: a rank starts while its durable root is
        unreachable] in `_root.py`)."""
        if self._root_pending:
            raise CheckpointError("the root's lease is not held yet (the root is not open)")
        self._confirm_lease()

    def _lease_lost(self) -> bool:
        return self._lease is not None and self._lease.lost

    def _forget_writer(self, writer: WriterProcess) -> None:
        # The pipeline starts after the root is open; it exists once anything is finalized.
        self._pipeline.forget_writer(writer)

    def _wake_deleter(self) -> None:
        if self._deleter is not None:
            self._deleter.trigger()

    def _note_commit_to_retention(
        self, step: int, committed_unix_s: float, metrics: Mapping[str, Any]
    ) -> None:
        if self._deleter is not None:  # the coordinator's
            self._deleter.note_committed(step, committed_unix_s, metrics)

    def _note_committed(
        self, step: int, committed_unix_s: float, metrics: Mapping[str, Any]
    ) -> None:
        # Told again once committed: a manifest another attempt had published first (read
        # back by the commit) carries its own time and metrics.
        self._note_commit_to_retention(step, committed_unix_s, metrics)
        if self._memory is not None:  # [Note: a memory step older than a durable one is stale]
            self._memory.record_durable(step)

    def _protected_steps(self) -> set[int]:
        # Read by the deleter's thread; each attribute is replaced whole, never mutated.
        return {s for s in (self._restored_from, self._restoring) if s is not None}

    def _choose_for_restore(self, step: int) -> None:
        self._restoring = step

    # ----------------------------------------------------------------- save
    def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, Any] | None = None,
        *,
        durable: bool = True,
        replicate: bool = True,
    ) -> None:
        """Start saving `state` as `step`; returns once the snapshot is queued.

        Every rank calls it with the same step. Tensors must not change until
        `before_optimizer_step()` returns (the copy runs in the background until then).

        Args:
            step: training step (greater than every committed step and every memory
                snapshot; a durable save may repeat the newest memory-only step).
            state: nested dicts/lists of tensors, ShardedTensorLike, DTensor (each rank its
                local shard, replicas once), RankLocal, JSON values.
            metrics: JSON values stored in the manifest (used by `KeepBest`; a memory-only
                save keeps none).
            durable: write the step to storage and commit it. False (the memory tier only):
                the snapshot into a memory slot is all it does: no writer, no manifest, no
                agreement across ranks.
            replicate: whether the memory snapshot goes to the peer ring (`SlotMeta.replicate`:
                the daemon's replica sender passes over one saved with False; no effect
                without the memory tier).

        Raises:
            ValueError: bad step, metrics or state, or `durable=False` without the memory
                tier.
            TypeError: a state leaf of a type it does not take (e.g. a numpy array, a sparse
                tensor).
            SaveFailedError: an older save that had to be finalized first failed (raised
                after this save is queued: it goes on), or, in `AsyncMode.SYNC`, this one.
            CheckpointError: the manager is closed, a collective failed, or an earlier memory
                snapshot of this rank failed (e.g. its tmpfs is full).
        """
        started = time.monotonic()
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if not isinstance(durable, bool):
            raise ValueError(f"durable must be True or False, got {durable!r}")
        if not isinstance(replicate, bool):
            raise ValueError(f"replicate must be True or False, got {replicate!r}")
        if not durable and self._memory is None:
            raise ValueError(
                "save(..., durable=False) keeps the step in memory only, and the memory tier "
                "is off: configure CheckpointConfig(memory=MemoryTierConfig(directory=...)) "
                "or save with durable=True"
            )
        metrics = dict(metrics or {})
        try:
            json.dumps(metrics, allow_nan=True)
        except (TypeError, ValueError) as err:
            raise ValueError(f"metrics must be JSON values: {err}") from err
        self._begin_deferred_open()  # [Note: the root opens after a memory restore]
        self._check_opening()
        if durable and self._root_pending:
            self._sync_root(step)  # the newest commit is known once the root is open
        if self._snapshots is not None:
            self._snapshots.collect(settle_s=self.config.staging_timeout_s)
        newest = max([r.step for r in self._pending], default=-1)
        if self._final.last_committed is not None:
            newest = max(newest, self._final.last_committed[0])
        if step <= newest:
            raise ValueError(
                f"step {step} is not after the newest saved step {newest}: a step is never "
                "written twice (to roll back, delete the newer steps first, e.g. with "
                "`ckptctl prune`, or save under another root)"
            )
        in_memory = self._memory.newest_step if self._memory is not None else None
        if in_memory is not None and (step < in_memory or (step == in_memory and not durable)):
            raise ValueError(
                f"step {step} is not after the newest memory snapshot {in_memory}: steps "
                "only go forward"
            )
        if not durable:
            self._snapshot_only(step, state, started, replicate)
            return
        if step in self._final.unclean_steps:
            raise CheckpointError(
                f"step {step}: the folder of its failed save was not removed (a delete "
                "failed, or another attempt's manifest holds it); save a later step"
            )
        # [Note: an older save's failure does not cost this save] Making room can finalize an
        # older save that failed; its error is raised only once this save is queued, so a
        # caller that counts failures and trains on still gets this step saved.
        older_failure: SaveFailedError | None = None
        while len(self._pending) >= self.config.max_inflight:
            try:
                self._final.run(blocking=True)
            except SaveFailedError as err:  # the failed request is retired: room was made
                older_failure = err
        request = self._prepare(step, state, metrics, started, replicate)
        self._pending.append(request)
        self._newest_durable_save = step
        if self._snapshots is not None and request.memory is not None:
            self._snapshots.track(request)
        self._pipeline.submit(request)
        request.stall_s += time.monotonic() - started
        if self.config.async_mode is AsyncMode.SYNC:
            self._final.run(blocking=True)
        if older_failure is not None:
            raise older_failure

    def _prepare(
        self, step: int, state: Any, metrics: dict[str, Any], started: float, replicate: bool
    ) -> SaveRequest:
        flat = flatten(state, keep_replicas=self._memory is not None, memo=self._leaves)
        leaves = leaves_to_write(flat, self.rank)
        spread = self.config.spread_for(self._storage.root_uri)
        file_name = shard_file_name(self.rank, spread) if leaves else None
        layout, records = self._plans.plan(leaves, file_name)
        slot = next(i for i in range(self.config.max_inflight) if not self._slot_in_use(i))
        job = None
        if self._snapshots is not None:
            job = self._snapshots.begin(
                step, flat, leaves, self._pending, durable=True, replicate=replicate
            )
        writer = self._pipeline.writer_for_next_save()
        request = SaveRequest(
            request_id=self._next_request_id,
            step=step,
            created_unix_s=time.time(),
            started=started,
            slot=slot,
            layout=layout,
            file_name=file_name,
            contribution={},
            # [Note: the rank's index is built off the training thread] in _save/pipeline.py
            build_pending_index=lambda: self._reports.prepare(
                step=step,
                rank=self.rank,
                flat=flat,
                records=records,
                file_name=file_name,
                metrics=metrics,
                spread_prefixes=spread,
            ),
            writer=writer,
            memory=job,
        )
        request.tensors = [x.tensor for x in leaves]
        request.device_fence = DeviceFence.after_current_work(
            request.tensors if job is None else [x.tensor for x in flat.leaves]
        )
        self._next_request_id += 1
        return request

    def _slot_in_use(self, slot: int) -> bool:
        return any(r.slot == slot for r in self._pending)

    def reserve_memory(self, state: Any) -> bool:
        """Allocate, in the background, the memory slots the next snapshots of `state` will
        take, so that no snapshot's fence waits for a slot file nor a step after one for
        the next slot's ([Note: the first slots allocated ahead] in `_save/snapshots.py`).

        Call it once the state has its final size (after the first optimizer step, which
        creates the optimizer's state), before or right after the first snapshot. It returns
        at once and raises nothing for a failed allocation: the snapshot that takes the slot
        allocates it then and reports a failure as usual.

        Args:
            state: the state the next `save()` will be given (the same structure).

        Returns:
            True when an allocation was queued; False without the memory tier, or when the
            next snapshot would take an extra slot or none (those are allocated only when a
            snapshot takes them).

        Raises:
            TypeError, ValueError: `state` holds something `save()` refuses (as it would).
            CheckpointError: the manager is closed.
        """
        self._check_open()
        if self._snapshots is None:
            return False
        slots = self._snapshots.slots_to_reserve(self._pending)
        if not slots:
            return False
        flat, leaves, layout = self._memory_payload(state)
        self._pipeline.reserve(slots, flat, leaves, layout)
        return True

    def _memory_payload(self, state: Any) -> tuple[Flattened, list[TensorLeaf], FileLayout]:
        """`state` flattened for a memory snapshot, the leaves its durable file holds, and
        that file's layout (the payload starts with those bytes: the same, cached, plan)."""
        flat = flatten(state, keep_replicas=True, memo=self._leaves)
        leaves = leaves_to_write(flat, self.rank)
        spread = self.config.spread_for(self._storage.root_uri)
        layout, _ = self._plans.plan(leaves, shard_file_name(self.rank, spread) if leaves else None)
        return flat, leaves, layout

    def _snapshot_only(self, step: int, state: Any, started: float, replicate: bool) -> None:
        """`save(..., durable=False)`: the memory snapshot alone."""
        assert self._snapshots is not None
        flat, leaves, layout = self._memory_payload(state)
        job = self._snapshots.begin(
            step, flat, leaves, self._pending, durable=False, replicate=replicate
        )
        if job is not None:
            request = self._snapshots.memory_only(step, started, layout, job)
            self._pipeline.submit(request)
            request.stall_s += time.monotonic() - started
        self._snapshots.tier.last_save_s = time.monotonic() - started

    def before_optimizer_step(self) -> None:
        """Fence: return once every snapshot copy is done, so tensors may change.

        A CUDA snapshot is fenced on the device instead: the host waits only until its copies
        are enqueued, then the current stream waits for them ([Note: CUDA staging]).

        Raises:
            CheckpointTimeoutError: a copy did not finish (CUDA: was not enqueued) within
                `staging_timeout_s`.
        """
        memory_only = self._snapshots.uncopied() if self._snapshots is not None else []
        for request in [*self._pending, *memory_only]:
            if request.copied.is_set():
                continue
            t0 = time.monotonic()
            fence = request.device_fence
            signal = request.copied if fence is None else fence.enqueued
            finished = signal.wait(self.config.staging_timeout_s)
            if finished and fence is not None:
                fence.order_compute_after_copy()
            request.stall_s += time.monotonic() - t0
            if not finished:
                raise CheckpointTimeoutError(
                    f"snapshot copy of step {request.step} did not finish within "
                    f"{self.config.staging_timeout_s:.0f} s"
                )
        if self._snapshots is not None:
            self._snapshots.collect()

    # ----------------------------------------------------------------- finalize
    def maybe_finalize(self) -> None:
        """Commit finished saves without blocking; call on every rank at every step.

        Costs nothing when no save is in flight; otherwise it reads the collective a previous
        call issued if it has completed, and issues the next one, never waiting for a peer
        (a small all-reduce per call; one gather of the reports per save; the commit itself
        runs on the coordinator's finalizer thread): [Note: a non-blocking finalize never waits
        for a peer] in `_save/finalize.py`. A save therefore retires a few calls after its
        last rank's files are written. Each call's time is kept in
        `stats().recent_finalize_call_s`.

        Raises:
            SaveFailedError: a save failed on some rank (raised on every rank).
            CheckpointError: a checkpoint collective failed (a peer died or timed out).
        """
        self._check_open()
        if self._snapshots is not None:
            self._snapshots.collect()
        if not self._pending:
            return
        t0 = time.monotonic()
        try:
            self._final.run(blocking=False)
        finally:
            self._finalize_calls.append(time.monotonic() - t0)

    def wait_until_finished(self) -> None:
        """Block until every save in flight is committed or failed (collective), and every
        memory snapshot is recorded.

        Raises:
            SaveFailedError: a save failed on some rank.
            CheckpointError: a memory-only snapshot of this rank failed.
        """
        self._check_open()
        self._final.run(blocking=True)
        if self._snapshots is not None:
            self._snapshots.collect(self.config.staging_timeout_s, everything=True)
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

    def write_in_flight(self) -> bool:
        """Whether a durable `save()` now would wait for a save in flight that is still being
        written on this rank (local, no collective; polls the writer without blocking).

        A caller that must never stall on storage asks every rank, agrees (any rank: every
        rank defers, `save()` being collective), and saves later instead.
        """
        self._check_open()
        if self._root_deferred:  # [Note: the root opens after a memory restore]
            self._deferred_polls += 1
            if self._deferred_polls < 2:
                return self._coord.is_coordinator
            self._begin_deferred_open()
        self._check_opening()
        if self._opening is not None and not self._opening.done():
            return True  # [Note: a rank starts while its durable root is unreachable]
        return (
            write_blocking_next_save(self._pending, self.config.max_inflight, self._limits)
            is not None
        )

    # ----------------------------------------------------------------- queries
    def latest_step(self) -> int | None:
        """Newest committed step under the root (manifest present), or None."""
        steps = committed_steps(self._storage)
        return steps[-1] if steps else None

    def memory_steps(self) -> list[int]:
        """Steps this rank's memory slots hold, ascending ([] without the memory tier).

        Read from the slots' metas alone, unverified and not agreed across ranks: a hint that
        a memory restore may find something (`restore()` verifies and agrees). Reads no storage.
        """
        if self._memory is None:
            return []
        metas = self._memory.files.read_metas().values()
        return sorted(
            {m["step"] for m in metas if isinstance(m, dict) and isinstance(m.get("step"), int)}
        )

    def all_steps(self) -> list[int]:
        """Every committed step under the root, ascending."""
        return committed_steps(self._storage)

    def stats(self) -> ManagerStats:
        """In-flight saves (count, oldest), the last commit and the memory tier's counters."""
        last = self._final.last_committed
        memory = self._memory
        oldest = self._pending[0] if self._pending else None
        return ManagerStats(
            inflight=len(self._pending),
            last_committed_step=last[0] if last else None,
            last_committed_unix_s=last[1] if last else None,
            recent_finalize_call_s=tuple(self._finalize_calls),
            num_memory_snapshots=memory.num_snapshots if memory else 0,
            num_memory_snapshots_skipped=memory.num_skipped if memory else 0,
            last_memory_snapshot_bytes=memory.last_snapshot_bytes if memory else 0,
            last_memory_save_s=memory.last_save_s if memory else 0.0,
            memory_staging_cpu_s=memory.staging_cpu_s if memory else 0.0,
            memory_slot_allocations=memory.slot_allocations if memory else 0,
            memory_bytes_held=memory.held_bytes() if memory else 0,
            newest_memory_step=memory.newest_step if memory else None,
            num_memory_snapshots_failed=memory.num_failed if memory else 0,
            oldest_inflight_step=oldest.step if oldest else None,
            oldest_inflight_unix_s=oldest.created_unix_s if oldest else None,
        )

    @property
    def writer_pid(self) -> int | None:
        """Pid of the persistent writer process (None in other modes or before start)."""
        writer = self._pipeline.writer
        return writer.pid if writer is not None else None

    @property
    def storage(self) -> Storage:
        """The checkpoint root."""
        return self._storage

    # ----------------------------------------------------------------- restore
    def restore(
        self,
        step: int | None = None,
        into: Any = None,
        *,
        on_progress: Callable[[RestoreProgress], None] | None = None,
    ) -> RestoreResult | None:
        """Restore a step on every rank (collective).

        With the memory tier on and no explicit step, the newest step that every rank holds
        complete and verified in its memory slots is restored first, from those slots alone
        (no storage read); otherwise, or when that fails, the durable tier as below, with
        `fallback_reason` saying why memory was not used. Memory snapshots newer than the
        step restored are emptied (the run continues from it).

        Args:
            step: the step; None restores the newest committed step whose files verify,
                skipping (with a warning) corrupt ones.
            into: optional template: its tensors / sharded tensors / DTensors (their local
                shards) are filled in place
                (resharded from the saved offsets at any world size) and its structure
                is returned.
            on_progress: called on this thread after every read from storage (each checksum
                chunk, each stored piece or 64 MiB part of one) with the bytes read so far;
                a caller beats a liveness heartbeat from it. It should not raise: an
                exception from it counts as a failed read of that step.

        Returns:
            `RestoreResult(step, state, source, fallback_reason)`, or None when no valid
            checkpoint exists and `step` is None.

        Raises:
            StepNotFoundError: the explicit step is not committed.
            CorruptCheckpointError: the explicit step fails verification.
            CheckpointError: the template does not match the checkpoint.
        """
        self._check_open()
        if self._snapshots is not None:
            # A snapshot still being written must not land after the restore sorted the slots;
            # a failed one was logged, and the restore does not fail for it.
            with contextlib.suppress(CheckpointError):
                self._snapshots.collect(self.config.staging_timeout_s, everything=True)
        template = wrap_dtensors(into) if into is not None else None
        reason: str | None = None
        result: RestoreResult | None = None
        try:
            if self._memory is not None and step is None:
                last = self._final.last_committed
                known = last[0] if last is not None else None
                memory = restore_from_memory(self._memory, self._coord, template, known)
                if memory.step is not None:
                    self._log.info("ckpt_restored", ckpt_step=memory.step, source=memory.source)
                    if self._root_pending:  # checked once the root opens
                        self._memory_restored = memory.step
                    state = unwrap_dtensors(memory.state)
                    result = RestoreResult(memory.step, state, memory.source)
                else:
                    reason = memory.reason
                    self._log.warning("ckpt_memory_restore_fallback", reason=reason)
            if result is None:
                if self._root_deferred:  # [Note: the root opens after a memory restore]
                    self._open_root(at_start=False)
                # [Note: a corrupt step is moved aside, never silently deleted] in
                # `_store/quarantine.py`: the corrupt steps the restore skips move aside
                # under the lease, and their step numbers are free to save again.
                quarantine = Quarantine(
                    self._storage, self._coord, run_id=self.run_id, fence=self._held_lease
                )
                durable = restore_agreed(
                    self._storage,
                    self._coord,
                    step,
                    template,
                    verify_checksums=self.config.verify_checksums,
                    on_choose=self._choose_for_restore,
                    on_progress=on_progress,
                    quarantine=quarantine,
                )
                if quarantine.moved:
                    self._final.last_committed = quarantine.newest_committed
                if durable is not None:
                    state = unwrap_dtensors(durable.state)
                    result = RestoreResult(durable.step, state, "durable", reason)
                    if self._memory is not None:
                        self._memory.record_durable(durable.step)
            if result is not None:
                self._restored_from = result.step  # before `_restoring` is cleared: no gap
        finally:
            self._restoring = None
        if self._memory is not None:
            self._memory.after_restore(result.step if result is not None else None)
        self._restore_returned = True
        if self._deleter is not None:
            self._deleter.arm()  # [Note: retention waits for the run's restore]
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
                self._final.run(blocking=True)
        finally:
            self._closed = True
            self._shutdown()

    def _shutdown(self) -> None:
        timeout = self.config.writer_start_timeout_s
        self._pipeline.close(self._pending)
        self._pending.clear()
        self._final.close(timeout)
        if self._deleter is not None:
            self._deleter.close(timeout)
        if self._opening is not None:
            self._opening.close(timeout)
        if self._lease is not None:
            self._lease.release()
        self._final_coord.destroy()
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
