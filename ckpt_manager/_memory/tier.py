"""One rank's memory tier: which slot a snapshot takes, what the slots hold, its counters.

The training thread owns the bookkeeping (`choose`, `begin`, `finish`, `after_restore`); the
staging thread allocates slot files and writes metas (`allocate`, `complete`) for the
`SnapshotJob` it is copying. See [Note: the memory tier] in `_memory/__init__.py`.

[Note: which slot a snapshot takes] A snapshot never goes to
  - the slot of the newest complete snapshot (if this one dies half-copied, that one remains),
  - a pinned slot: one a durable write still reads (its request is in flight), or one a
    snapshot is still being copied into,
  - the slot of the kept step, the one a peer's replica held by this node also holds
    ([Note: a node keeps the step its peer's replica holds] in `keep.py`), unless no other
    slot (nor an extra one) is left: that pin yields, a snapshot is never skipped for it.
Among the configured `slots` it takes an empty one, else the one with the oldest step. When
all of those are excluded (a slow durable write pins one, the newest holds the other), it takes
an extra slot beyond `slots` if its file can be allocated: `max_inflight` of them for durable
writes, and one more for the kept step, so that a durable write in flight does not make the
kept step yield (a quiet node-loss run had 3 of 6 losses fall back to durable that way). An
extra slot whose file cannot be allocated is not tried again, and that snapshot is skipped
(counted, logged once with the reason); the other extra slots stay in use. The loop never waits
for a durable write to free a slot. Extra slot files are allocated only when a snapshot is about
to take them (ahead by one snapshot: [Note: slot files allocated ahead]), so a run without a kept
step (one node) never allocates the last one unless a snapshot still being copied pins a slot
too.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import structlog

from ckpt_manager._config import MemoryTierConfig
from ckpt_manager._format.checksum import ChecksumAlgorithm
from ckpt_manager._format.tree import Flattened, TensorLeaf
from ckpt_manager._memory.floor import write_floor
from ckpt_manager._memory.keep import KeptStep
from ckpt_manager._memory.meta import MetaEncoder, parsed_metas
from ckpt_manager._memory.plan import MemoryPlan, MemoryPlanCache
from ckpt_manager._memory.slots import SlotFiles
from ckpt_manager.errors import CheckpointError

__all__ = ["MemoryTier", "SnapshotJob"]

_log = structlog.get_logger("ckpt_manager")


@dataclasses.dataclass(eq=False)
class SnapshotJob:
    """The memory part of one save: the slot it fills and how that went."""

    slot: int
    """The slot being filled."""
    step: int
    """The step."""
    flat: Flattened | None
    """The flattened state (dropped once the meta is written)."""
    durable: list[TensorLeaf]
    """The leaves the durable file holds (`plan.leaves_to_write`)."""
    extra: bool
    """The slot is beyond the configured `slots` (allocation failure skips, not fails)."""
    plan: MemoryPlan | None = None
    """The payload's plan (set by the staging thread)."""
    ext_tensors: list[Any] = dataclasses.field(default_factory=list)
    """The extension's tensors (held until copied)."""
    ok: bool = False
    """The payload is complete and its meta written."""
    skipped: str | None = None
    """Why the snapshot was skipped (an extra slot could not be allocated)."""
    error: str | None = None
    """Why the snapshot failed."""
    replicate: bool = True
    """Whether the peer ring replicates it (its meta says so: `SlotMeta.replicate`)."""
    ahead: int | None = None
    """The slot the next snapshot will likely take: the staging thread allocates its file once
    this one is copied ([Note: slot files allocated ahead])."""


class MemoryTier:
    """The memory tier of one rank (one per manager)."""

    def __init__(
        self,
        config: MemoryTierConfig,
        *,
        rank: int,
        world_size: int,
        run_id: str,
        max_extra: int,
    ) -> None:
        """Open the tier's directory for `rank`.

        Args:
            config: the tier's config.
            rank: this rank.
            world_size: ranks in the run (recorded in each meta).
            run_id: the run's id (recorded in each meta; a restore refuses other runs').
            max_extra: extra slots beyond `config.slots` for durable writes in flight (the
                manager's `max_inflight`); one more is kept for the kept step.

        Raises:
            ValueError: the directory does not exist.
        """
        self.config = config
        self.files = SlotFiles(config.directory, rank)
        """This rank's slot files."""
        self.rank, self.world_size, self.run_id = rank, world_size, run_id
        self.num_slots = config.slots + max_extra + 1
        """The most slots this rank uses."""
        self.plans = MemoryPlanCache()
        """Payload plans (staging thread only)."""
        self._metas = MetaEncoder()  # staging thread only
        self.held: dict[int, int] = {}
        """Complete snapshots of this run's timeline: slot -> step (training thread)."""
        self.newest_step: int | None = None
        """The newest step snapshotted (or restored) by this manager."""
        # Slots a previous life of this rank left: the restore decides which stay
        # (`after_restore`); a save without a restore drops them all (`begin`).
        self._inherited = True
        self._sizes_lock = threading.Lock()
        self._sizes = {k: self.files.payload_size(k) for k in self.files.existing_slots()}
        self._refused: dict[int, str] = {}  # extra slots whose file could not be allocated
        self._floor: int | None = None  # the newest step `record_durable` wrote
        self._kept = KeptStep(config.directory, run_id)
        self._logged: set[str] = set()
        self.num_snapshots = 0
        """Snapshots completed."""
        self.num_skipped = 0
        """Snapshots skipped (no slot could be taken)."""
        self.num_failed = 0
        """Snapshots that failed (allocation, copy or meta write)."""
        self.last_snapshot_bytes = 0
        """Payload size of the last completed snapshot."""
        self.last_save_s = 0.0
        """Training-thread seconds of the last memory-only `save()`."""
        self.staging_cpu_s = 0.0
        """CPU seconds the staging thread spent on memory-only snapshots, all of them."""
        self.slot_allocations = 0
        """Slot files allocated (or grown) so far, ahead of a snapshot or by one: a snapshot
        whose staging allocated one paid a cost it will not pay again."""

    # ------------------------------------------------------------------ training thread
    def held_bytes(self) -> int:
        """Bytes held by this rank's slot files."""
        with self._sizes_lock:
            return sum(self._sizes.values())

    def choose(self, pinned: set[int]) -> tuple[int, bool] | None:
        """The slot the next snapshot takes and whether it is an extra one; None: skip it
        ([Note: which slot a snapshot takes])."""
        self._drop_inherited()
        choice = self._pick(pinned, self.held, self._kept.step())
        if choice is not None:
            return choice
        reason = next(iter(self._refused.values()), None) or (
            f"every slot is pinned by a durable write in flight or holds the newest snapshot "
            f"(slots {sorted(pinned)} pinned)"
        )
        self.skip(reason)
        return None

    def likely_next(self, pinned: set[int], slot: int, step: int) -> tuple[int, bool] | None:
        """The slot the snapshot after `step`'s takes if `step`'s completes into `slot` and
        `pinned` stay pinned, and whether it is an extra one; None: none would be free.

        [Note: slot files allocated ahead] A slot's first snapshot used to allocate its file
        (`posix_fallocate` and populating the mapping: 85 ms for a 268 MB state on the
        development VM) before its copy, and the loop's fence waited for both: the first
        snapshots of a run and the first one into each extra slot (a durable write pinning
        a slot) stalled 35-180 ms. The staging thread now allocates this slot's file once the
        snapshot before it is copied, while the loop is in its next forward and backward.
        """
        held = {k: s for k, s in self.held.items() if k != slot}
        held[slot] = step
        return self._pick(pinned, held, self._kept.step())

    def next_configured_slots(self, pinned: set[int]) -> list[int]:
        """The configured slots the next snapshots take, in order, while `pinned` stay pinned
        and each completes: up to the configured `slots`, ending before the first that would
        be an extra slot. Changes nothing ([Note: the first slots allocated ahead] in
        `_save/snapshots.py`)."""
        held, kept = dict(self.held), self._kept.step()
        slots: list[int] = []
        while len(slots) < self.config.slots:
            choice = self._pick(pinned, held, kept)
            if choice is None or choice[1] or choice[0] in slots:
                break
            slots.append(choice[0])
            held[choice[0]] = max(held.values(), default=-1) + 1
        return slots

    def _pick(
        self, pinned: set[int], held: dict[int, int], kept: int | None
    ) -> tuple[int, bool] | None:
        newest = max(held, key=lambda k: held[k]) if held else None
        kept_slots = {k for k, step in held.items() if step == kept}
        # The kept step yields rather than cost a snapshot: skipped steps make the ranks'
        # timelines differ more than a kept step brings them together (measured: snapshots
        # skipped while a durable write pinned the third slot, then a node loss found
        # rank 0 at [42, 43] and rank 1's replica at [40]).
        for held_back in (pinned | kept_slots, pinned):
            free = [k for k in range(self.num_slots) if k not in held_back and k != newest]
            primary = [k for k in free if k < self.config.slots]
            if primary:
                return min(primary, key=lambda k: (k in held, held.get(k, -1), k)), False
            extra = [k for k in free if k >= self.config.slots and k not in self._refused]
            if extra:
                return min(extra, key=lambda k: (k in held, held.get(k, -1), k)), True
        return None

    def skip(self, reason: str) -> None:
        """Count a skipped snapshot; log each reason once."""
        self.num_skipped += 1
        if reason not in self._logged:
            self._logged.add(reason)
            _log.warning("ckpt_memory_snapshot_skipped", rank=self.rank, reason=reason)

    def begin(self, slot: int, step: int) -> None:
        """`slot` is about to be overwritten by `step`'s snapshot: empty it first."""
        self._drop_inherited()
        self.held.pop(slot, None)
        self.files.remove_meta(slot)
        self.newest_step = step

    def finish(self, job: SnapshotJob) -> None:
        """A job's staging is over: record its outcome (training thread)."""
        if job.ok:
            self.held[job.slot] = job.step
            self.num_snapshots += 1
            assert job.plan is not None
            self.last_snapshot_bytes = job.plan.payload.total_bytes
        elif job.skipped is not None:
            if job.extra:
                self._refused[job.slot] = job.skipped
            self.skip(job.skipped)
        elif job.error is not None:
            self.num_failed += 1

    def _drop_inherited(self) -> None:
        """A save before any restore: slots from a previous life are another timeline."""
        if self._inherited:
            self._inherited = False
            self._empty_slots()

    def _empty_slots(self) -> None:
        """Remove every slot's meta (the payloads stay allocated for the next snapshots)."""
        for slot in self.files.read_metas():
            self.files.remove_meta(slot)
        self.held.clear()

    def holds_this_run(self) -> bool:
        """Whether a slot's meta names this run and world size (read from the metas alone,
        unverified): a memory restore may follow ([Note: the root opens after a memory
        restore] in `_root.py`)."""
        return any(
            meta.run_id == self.run_id and meta.world_size == self.world_size
            for meta, _ in parsed_metas(self.files.read_metas()).values()
        )

    def after_restore(self, step: int | None) -> None:
        """The run resumes at `step` (None: from scratch): keep this run's snapshots up to it,
        empty the others (a newer one belongs to a timeline the run left)."""
        self._inherited = False
        self.held.clear()
        raw_metas = self.files.read_metas()
        parsed = parsed_metas(raw_metas)
        for slot in raw_metas:
            keep = None
            if slot in parsed and step is not None:
                meta = parsed[slot][0]
                if meta.run_id == self.run_id and meta.step <= step:
                    keep = meta.step
            if keep is None:
                self.files.remove_meta(slot)
            else:
                self.held[slot] = keep
        self.newest_step = max(self.held.values(), default=step)

    def drop_timeline(self, committed: int) -> None:
        """The run's memory timeline went back past `committed`: empty every slot and record
        `committed` as the floor ([Note: the root opens after a memory restore] in
        `_root.py`)."""
        self._empty_slots()
        self.newest_step = None
        self.record_durable(committed)

    def record_durable(self, step: int) -> None:
        """The run holds `step` durably (committed or restored): raise the tier's floor
        ([Note: a memory step older than a durable one is stale] in `floor.py`)."""
        if self._floor is None or step > self._floor:
            self._floor = step
            write_floor(self.files.directory, self.rank, self.run_id, step)

    # ------------------------------------------------------------------ staging thread
    def allocate(self, job: SnapshotJob, nbytes: int) -> tuple[int, int] | None:
        """The slot file of `job`, allocated for `nbytes`: `(fd, capacity)`, or None when an
        extra slot could not be allocated (the job is then skipped).

        Raises:
            CheckpointError: a configured slot could not be allocated.
        """
        try:
            fd, capacity = self.files.allocate(job.slot, nbytes)
        except CheckpointError as err:
            if not job.extra:
                raise
            job.skipped = f"an extra slot could not be allocated: {err}"
            return None
        with self._sizes_lock:
            self._sizes[job.slot] = capacity
            self.slot_allocations += 1
        return fd, capacity

    def allocate_ahead(self, slot: int, nbytes: int) -> tuple[int, int] | None:
        """`slot`'s file allocated for `nbytes` before a snapshot takes it ([Note: slot files
        allocated ahead]): `(fd, capacity)`, or None if it could not be (the snapshot that
        takes it allocates it then, and reports a failure as usual)."""
        try:
            fd, capacity = self.files.allocate(slot, nbytes)
        except CheckpointError:
            return None
        with self._sizes_lock:
            self._sizes[slot] = capacity
            self.slot_allocations += 1
        return fd, capacity

    def complete(self, job: SnapshotJob, algorithm: ChecksumAlgorithm, checksum: int) -> None:
        """The payload of `job` is copied: write its meta (the snapshot now counts).

        Raises:
            CheckpointError: the meta could not be written.
        """
        flat, plan = job.flat, job.plan
        assert flat is not None
        assert plan is not None
        meta = self._metas.encode(
            run_id=self.run_id,
            rank=self.rank,
            world_size=self.world_size,
            step=job.step,
            plan=plan,
            algorithm=algorithm,
            checksum=checksum,
            tree=flat.tree,
            rank_local_trees=flat.rank_local_trees,
            replicate=job.replicate,
        )
        self.files.write_meta(job.slot, meta)
        job.flat = None
        job.ok = True
