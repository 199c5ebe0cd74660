"""The save path's side of the memory tier: claim a slot per save, record finished snapshots.

`Snapshots` (one per manager, training thread only) gives each save its `SnapshotJob` (a slot
emptied and claimed: [Note: which slot a snapshot takes] in `_memory/tier.py`), builds the
request of a memory-only save (`durable=False`: it never enters the finalizer's queue), and
records each snapshot once its staging job is over: counted, reported to the observer's
optional `on_memory_snapshot` hook, or, for a memory-only save that failed, raised as a
`CheckpointError` on the next call of the training thread.
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

__all__ = ["INLINE_SNAPSHOT_BYTES", "Snapshots"]

INLINE_SNAPSHOT_BYTES = 8 << 20
"""A memory-only snapshot of at most this many bytes (its durable file's layout; on the CPU) is
copied by the training thread in `save()` when the staging thread is idle.

[Note: a small memory-only snapshot is copied inline] Handed to the staging thread, a small
snapshot's copy (a few ms of CPU) had to win the GIL from the training thread's forward and
backward, and the CPU from the other ranks' threads, before the next optimizer step's fence:
on the 2-core development VM the fence waited 4-14 ms p50 and the snapshot cost 76 ms p99
(bench/recovery.py, `snapshot_stall_ms`, loaded machine), and the GIL ping-pong slowed every
step at `memory_every 1`. Copied in `save()`, it costs the training thread the copy itself
(8 MiB: about 3 ms at the VM's 2.4 GB/s memcpy) and the fence nothing. A larger state, a CUDA
state (its device-to-host copy overlaps the next forward) and a snapshot while a durable save
is being staged still go to the staging thread, as every durable save does.

What the training thread still spends on a small snapshot (cProfile of rank 0's 27 memory-only
`save()` calls of the default job, 5 MiB, load ~10 on the 2-core VM, profiler overhead
included: 142 ms each): `flatten` 62 ms (about 1000 tree nodes, `_format/tree.py`), the
copy and CRC 25 ms, the meta (its skeleton's JSON) 12 ms, the rest under 10 ms each. Before
`save()`, the loop's `state()` waits for the sharded optimizer's deferred weight gathers
(`sharded_state_dict`: 5-18 ms at that load), which the next forward would otherwise overlap.
Those two, outside this package's reach, are what `snapshot_stall_ms` measures now.
"""


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
        self, step: int, flat: Flattened, leaves: list[TensorLeaf], pending: Iterable[SaveRequest]
    ) -> SnapshotJob | None:
        """Claim and empty a slot for `step`'s snapshot; None: skipped (no slot free).

        Args:
            step: the step.
            flat: the flattened state.
            leaves: the leaves its durable file holds.
            pending: the durable saves in flight (their slots are pinned).
        """
        pinned = {job.slot for _, job in self._inflight}
        # `memory` may be dropped meanwhile by the staging thread (a skipped extra slot).
        pinned |= {job.slot for r in pending if (job := r.memory) is not None}
        choice = self.tier.choose(pinned)
        if choice is None:
            return None
        slot, extra = choice
        self.tier.begin(slot, step)
        return SnapshotJob(slot, step, flat, leaves, extra)

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

    def copies_inline(self, request: SaveRequest, pending: Iterable[SaveRequest]) -> bool:
        """Whether the training thread copies the memory-only `request` itself
        ([Note: a small memory-only snapshot is copied inline]).

        Args:
            request: a memory-only request (tracked already).
            pending: the durable saves in flight.
        """
        if request.device_fence is not None or request.layout.total_bytes > INLINE_SNAPSHOT_BYTES:
            return False
        # The staging thread must be idle: the plan cache, the slot slabs and the meta
        # encoder are its own while it stages anything.
        others = [r for r, _ in self._inflight if r is not request]
        return all(r.handed_off.is_set() for r in [*pending, *others])

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
