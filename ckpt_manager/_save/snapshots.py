"""The save path's side of the memory tier: claim a slot per save, record finished snapshots.

`Snapshots` (one per manager, training thread only) gives each save its `SnapshotJob` (a slot
emptied and claimed: [Note: which slot a snapshot takes] in `_memory/tier.py`), builds the
request of a memory-only save (`durable=False`: it never enters the finalizer's queue), and
records each snapshot once its staging job is over: counted, reported to the observer's
optional `on_memory_snapshot` hook, or, for a memory-only save that failed, raised as a
`CheckpointError` on the next call of the training thread.

[Note: where a memory snapshot's training-thread time goes] cProfile of rank 0's 27
memory-only `save()` calls of the default job (5 MiB, 156 leaves; load ~10 on the 2-core VM,
profiler overhead included): `flatten` about 60 ms a call (some 1000 tree nodes,
`_format/tree.py`), the rest a few ms. Before `save()` the loop's `state()` waits for the
sharded optimizer's deferred weight gathers (`sharded_state_dict`: 5-18 ms at that load),
which the next forward would otherwise overlap. The copy itself stays on the staging thread:
copying a small snapshot inside `save()` instead (tried) moved the p50 of
`trainingd_memory_snapshot_seconds` from 10-25 ms up to 25-50 ms and did not lower the step
time at `memory_every 1` (bench/recovery.py, loaded machine), once the staging copy no
longer ping-pongs the GIL ([Note: small tensors in one call] in `staging.py`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable
from typing import Any

from ckpt_manager._format.shard_file import FileLayout
from ckpt_manager._format.tree import Flattened, TensorLeaf
from ckpt_manager._memory.tier import MemoryTier, SnapshotJob
from ckpt_manager._save.device_copy import DeviceFence
from ckpt_manager._save.request import SaveRequest
from ckpt_manager._types import MEMORY_SNAPSHOT_HOOK
from ckpt_manager.errors import MemorySnapshotError

__all__ = ["Snapshots"]


class Snapshots:
    """Memory snapshots between `save()` and their record (one per manager)."""

    def __init__(self, tier: MemoryTier, observer: Any, rank: int, log: Any) -> None:
        """Track snapshots into `tier`; `observer` may define `on_memory_snapshot`."""
        self.tier = tier
        """This rank's memory tier."""
        self._observer = observer
        self._rank = rank
        self._log = log
        self._inflight: collections.deque[tuple[SaveRequest, SnapshotJob]] = collections.deque()

    def begin(
        self,
        step: int,
        flat: Flattened,
        leaves: list[TensorLeaf],
        pending: Iterable[SaveRequest],
        *,
        durable: bool,
        replicate: bool = True,
    ) -> SnapshotJob | None:
        """Claim and empty a slot for `step`'s snapshot; None: skipped (no slot free).

        Args:
            step: the step.
            flat: the flattened state.
            leaves: the leaves its durable file holds.
            pending: the durable saves in flight (their slots are pinned).
            durable: the snapshot is a durable save's (its write will pin its slot).
            replicate: whether the peer ring replicates it (`SlotMeta.replicate`).
        """
        writes, pinned = self._pinned(pending)
        choice = self.tier.choose(pinned)
        if choice is None:
            return None
        slot, extra = choice
        self.tier.begin(slot, step)
        job = SnapshotJob(slot, step, flat, leaves, extra, replicate=replicate)
        # [Note: slot files allocated ahead] By the next snapshot the copies in flight are
        # done (the fence waits for them); durable writes, this one's too, still read theirs.
        following = self.tier.likely_next(writes | {slot} if durable else writes, slot, step)
        job.ahead = None if following is None else following[0]
        return job

    def slots_to_reserve(self, pending: Iterable[SaveRequest]) -> list[int]:
        """The configured slots the next snapshots will take, in order, to allocate ahead of
        them (none that would be an extra slot).

        [Note: the first slots allocated ahead] A slot's file is allocated ahead once the
        snapshot before it is copied ([Note: slot files allocated ahead] in
        `_memory/tier.py`). That left a run's first snapshot (and the first after a restart,
        whose process maps the slot files anew) allocating its own slot before its copy, the
        fence waiting for both: on the 2-core VM, with the staging thread 10 nice steps below
        training (the daemon's default), the fence of `auto`'s first snapshot waited 10-100
        ms. And the second slot's allocation, ahead of the second snapshot, ran in the step
        after the first, which the cadence measures as that snapshot's effect
        ([Note: a snapshot's cost is also measured in the step after it] in
        `daemon/rank/memory_cadence.py`). `CheckpointManager.reserve_memory` hands every
        configured slot to the staging thread as soon as the state's size is known (the
        daemon calls it after a life's first step, once the optimizer's state exists), so
        that the snapshots that take them find them mapped.
        """
        return self.tier.next_configured_slots(self._pinned(pending)[1])

    def _pinned(self, pending: Iterable[SaveRequest]) -> tuple[set[int], set[int]]:
        """The slots durable writes in flight read, and those plus the slots of snapshots
        still being copied (neither may be overwritten)."""
        # `memory` may be dropped meanwhile by the staging thread (a skipped extra slot).
        writes = {job.slot for r in pending if (job := r.memory) is not None}
        return writes, writes | {job.slot for _, job in self._inflight}

    def track(self, request: SaveRequest) -> None:
        """Follow `request`'s snapshot (it carries a job) until its staging is over."""
        assert request.memory is not None
        self._inflight.append((request, request.memory))

    def memory_only(
        self, step: int, started: float, layout: FileLayout, job: SnapshotJob
    ) -> SaveRequest:
        """The request of a memory-only save (`durable=False`), tracked."""
        assert job.flat is not None
        request = SaveRequest(
            request_id=-1,  # never reaches a writer nor the finalizer
            step=step,
            created_unix_s=time.time(),
            started=started,
            slot=-1,
            layout=layout,
            file_name=None,
            contribution={},
            durable=False,
            memory=job,
        )
        request.tensors = [x.tensor for x in job.durable]
        request.device_fence = DeviceFence.after_current_work([x.tensor for x in job.flat.leaves])
        self.track(request)
        return request

    def uncopied(self) -> list[SaveRequest]:
        """Memory-only requests whose copy may still run (the optimizer-step fence)."""
        return [r for r, _ in self._inflight if not r.durable and not r.copied.is_set()]

    def collect(self, settle_s: float = 0.0, *, everything: bool = False) -> None:
        """Record the snapshots whose staging is over, oldest first.

        Args:
            settle_s: wait up to this long for a job whose copy is done to finish (its meta
                write, or its hand-off to the writer: moments), so that `save()` does not
                take another slot for want of it.
            everything: wait (up to `settle_s` each) for every job, copied or not.

        Raises:
            MemorySnapshotError: a memory-only snapshot failed (e.g. its tmpfs is full); the
                previous snapshot is intact and the tier goes on with the next save.
        """
        if settle_s > 0:
            for request, _ in self._inflight:
                if everything or request.copied.is_set():
                    request.handed_off.wait(settle_s)
        failures = []
        while self._inflight and self._inflight[0][0].handed_off.is_set():
            request, job = self._inflight.popleft()
            self.tier.finish(job)
            if not request.durable:
                self.tier.staging_cpu_s += request.staging_cpu_s
            if job.ok:
                assert job.plan is not None
                self._tell(job.step, job.plan.payload.total_bytes, request.stall_s)
            elif job.skipped is None and job.error is not None:
                self._log.error("ckpt_memory_snapshot_failed", ckpt_step=job.step, error=job.error)
                if not request.durable:  # a durable one fails through the agreement
                    failures.append(f"step {job.step}: {job.error}")
        if failures:
            raise MemorySnapshotError(
                f"memory snapshot failed on rank {self._rank}: {'; '.join(failures)}"
            )

    def _tell(self, step: int, num_bytes: int, seconds: float) -> None:
        hook = getattr(self._observer, MEMORY_SNAPSHOT_HOOK, None)
        if hook is None:
            return
        try:
            hook(step, num_bytes, seconds)
        except Exception as err:  # an observer must not break checkpointing
            self._log.warning("ckpt_observer_failed", error=str(err))
