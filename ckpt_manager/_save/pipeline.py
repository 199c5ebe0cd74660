"""One rank's save pipeline: staging buffers, the staging thread and the writer process.

`CheckpointManager.save()` prepares a `SaveRequest`; `LocalPipeline.submit()` copies its
tensors into the slot's shared-memory `Slab` (on the staging thread, or inline in sync mode)
and hands the buffer to a writer: the persistent writer process, a one-shot process
(temporal mode) or `write_shard` inline (sync mode). Agreement and commit across ranks stay
in the manager; this module never runs a collective.

With the memory tier on, a request that carries a `SnapshotJob` is staged into its memory
slot (a slot file's slab) instead, followed by the leaves the durable file leaves out; once
copied, the slot's meta is written. A memory-only request (`durable=False`) ends there
([Note: the memory tier] in `_memory/`).

Owns (and `close()` releases): the staging thread, the persistent writer, the slabs (a
memory slot's file stays: it outlives the process by design).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from ckpt_manager._config import AsyncMode, CheckpointConfig
from ckpt_manager._format.checksum import SAVE_ALGORITHM
from ckpt_manager._format.layout import step_dir
from ckpt_manager._format.shard_file import FileLayout
from ckpt_manager._format.tree import Flattened, TensorLeaf
from ckpt_manager._memory.tier import MemoryTier, SnapshotJob
from ckpt_manager._save.chunk_copy import STAGING_COPY
from ckpt_manager._save.device_copy import copy_to_pinned_slab
from ckpt_manager._save.landed_checksums import LandedChecksums
from ckpt_manager._save.report import encode_report_body
from ckpt_manager._save.request import SaveRequest, SaveState
from ckpt_manager._save.staging import BackgroundThread, Slab, copy_payload_into_slab
from ckpt_manager._save.writer import write_shard_retrying
from ckpt_manager._save.writer_proc import WriterProcess
from ckpt_manager._store.indexes import write_finished_index
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CheckpointError

__all__ = ["LocalPipeline"]


class LocalPipeline:
    """Copies a rank's snapshot into shared memory and hands it to the mode's writer."""

    def __init__(
        self,
        config: CheckpointConfig,
        storage: Storage,
        rank: int,
        log: Any,
        memory: MemoryTier | None = None,
    ) -> None:
        """Start the staging thread (async modes) and the persistent writer (persistent)."""
        self._config = config
        self._storage = storage
        self._rank = rank
        self._log = log
        self._memory = memory
        self._slabs: list[Slab | None] = [None] * config.max_inflight
        self._memory_slabs: dict[int, Slab] = {}  # by memory slot
        self._next_slab_id = 0
        self._stager: BackgroundThread | None = None
        self._writer: WriterProcess | None = None
        if config.async_mode is not AsyncMode.SYNC:
            self._stager = BackgroundThread(f"ckpt-stager-{rank}", nice=config.staging_nice)
        # Said once per manager: a build without the C helper copies with ordinary stores.
        log.info("ckpt_staging_copy", kind=STAGING_COPY.value)
        if config.async_mode is AsyncMode.PERSISTENT:
            self._writer = WriterProcess(rank)

    @property
    def writer(self) -> WriterProcess | None:
        """The persistent writer process (None in other modes, or after it was killed)."""
        return self._writer

    def writer_for_next_save(self) -> WriterProcess | None:
        """The persistent writer, restarted if it died or was killed; None in other modes."""
        if self._config.async_mode is not AsyncMode.PERSISTENT:
            return None
        if self._writer is None or self._writer.exit_code() is not None:
            if self._writer is not None:
                self._log.warning("ckpt_writer_restarted", old_pid=self._writer.pid)
                self._writer.kill()
            self._writer = WriterProcess(self._rank)
        return self._writer

    def forget_writer(self, writer: WriterProcess) -> None:
        """`writer` was killed: the next save starts a fresh persistent writer."""
        if writer is self._writer:
            self._writer = None

    def submit(self, request: SaveRequest) -> None:
        """Stage and dispatch `request`: inline in sync mode, else on the staging thread."""
        if self._stager is None:
            self._stage_and_dispatch(request)
            return
        self._stager.submit(lambda: self._stage_and_dispatch(request))

    def close(self, pending: Iterable[SaveRequest]) -> None:
        """Stop the staging thread and writers (killing one-shot writers of `pending`)."""
        timeout = self._config.writer_start_timeout_s
        if self._stager is not None:
            self._stager.close(timeout)
        for request in pending:
            if request.writer is not None and request.writer is not self._writer:
                request.writer.kill()
        if self._writer is not None:
            self._writer.stop(timeout)
            self._writer = None
        for slab in [*self._slabs, *self._memory_slabs.values()]:
            if slab is not None:
                slab.close()
        self._slabs = [None] * self._config.max_inflight
        self._memory_slabs = {}

    def _release(self, slab: Slab) -> None:
        """Unmap an outgrown slab here and in the writer (staging thread only)."""
        if self._writer is not None:
            self._writer.drop_slab(slab.slab_id)
        slab.close()

    def _slab_for(self, slot: int, nbytes: int) -> Slab:
        """The slot's staging buffer, (re)allocated when too small (staging thread only)."""
        slab = self._slabs[slot]
        if slab is not None and slab.capacity >= nbytes:
            return slab
        if slab is not None:
            self._release(slab)
        slab = self._slabs[slot] = Slab(self._next_slab_id, nbytes)
        self._next_slab_id += 1
        return slab

    def _memory_slab_for(self, job: SnapshotJob, nbytes: int) -> Slab | None:
        """The memory slot's slab, its file (re)allocated when too small (staging thread
        only); None: an extra slot could not be allocated (the job is skipped).

        Raises:
            CheckpointError: a configured slot could not be allocated (a full tmpfs).
        """
        assert self._memory is not None
        slab = self._memory_slabs.get(job.slot)
        if slab is not None and slab.capacity >= nbytes:
            return slab
        if slab is not None:
            self._release(slab)
            del self._memory_slabs[job.slot]
        started = time.monotonic()
        allocated = self._memory.allocate(job, nbytes)
        if allocated is None:
            return None
        fd, capacity = allocated
        return self._map_slot(job.slot, fd, capacity, started, ahead=False)

    def _map_slot(self, slot: int, fd: int, capacity: int, started: float, *, ahead: bool) -> Slab:
        """Map an allocated slot file as `slot`'s slab (it owns `fd` from now on) and log the
        allocation with its time since `started`."""
        try:
            slab = Slab(self._next_slab_id, capacity, fd=fd)
        except BaseException:
            os.close(fd)
            raise
        self._next_slab_id += 1
        self._memory_slabs[slot] = slab
        self._log.info(
            "ckpt_memory_slot_allocated",
            rank=self._rank,
            slot=slot,
            bytes=capacity,
            seconds=round(time.monotonic() - started, 4),
            ahead=ahead,
        )
        return slab

    def _stage_and_dispatch(self, request: SaveRequest) -> None:
        """Staging-thread job (inline in sync mode): copy, then hand to the writer.

        [Note: streamed writes] To local disk (a store with
        `capabilities.progressive_write`), a writer process gets the request before the
        copy starts and writes each part of the file as soon as it is staged (progress
        messages every 32 MiB), so the write overlaps the copy instead of following it.
        Object stores upload whole parts after the copy, so they gain nothing from it.
        """
        cpu_started = time.thread_time()
        try:
            if request.durable and not self._build_pending_index(request):
                return
            slab = self._allocate(request)
            if slab is None:
                return
            if not request.durable:
                self._copy(request, slab)  # the snapshot is all a memory-only save does
            elif self._streams(request):
                self._stage_streamed(request, slab)
            elif self._copy(request, slab) and self._encode_report_body(request):
                self._dispatch(request)  # a no-op if the save failed meanwhile
        finally:
            if request.device_fence is not None:
                request.device_fence.enqueued.set()  # a failed copy enqueued nothing
            request.staging_cpu_s += time.thread_time() - cpu_started
            request.copied.set()
            request.handed_off.set()
        if request.memory is not None and request.memory.ok:
            self._allocate_ahead(request.memory)

    def reserve(
        self, slots: list[int], flat: Flattened, durable: list[TensorLeaf], layout: FileLayout
    ) -> None:
        """Allocate and map memory `slots` for `flat`'s snapshots before snapshots take them
        ([Note: the first slots allocated ahead] in `snapshots.py`): on the staging thread,
        or inline in sync mode. Nothing is raised: a snapshot that takes a slot allocates it
        if this could not, and reports a failure as usual."""
        if self._stager is None:
            self._reserve(slots, flat, durable, layout)
            return
        self._stager.submit(lambda: self._reserve(slots, flat, durable, layout))

    def _reserve(
        self, slots: list[int], flat: Flattened, durable: list[TensorLeaf], layout: FileLayout
    ) -> None:
        assert self._memory is not None
        try:
            # The plan is cached: the snapshots that take the slots reuse it.
            plan, _ = self._memory.plans.plan(flat, durable, layout)
        except Exception as err:  # the snapshot plans again and reports it
            self._log.warning("ckpt_memory_reserve_failed", rank=self._rank, error=str(err))
            return
        for slot in slots:
            if slot not in self._memory_slabs:
                self._map_ahead(slot, plan.payload.total_bytes)

    def _allocate_ahead(self, job: SnapshotJob) -> None:
        """Map the slot the next snapshot will likely take, once this one is copied and the
        loop has gone on ([Note: slot files allocated ahead] in `_memory/tier.py`): only a
        slot not mapped here yet, so no file in use is touched."""
        slot = job.ahead
        if slot is None or slot in self._memory_slabs or job.plan is None:
            return
        self._map_ahead(slot, job.plan.payload.total_bytes)

    def _map_ahead(self, slot: int, nbytes: int) -> None:
        """Allocate and map `slot`'s file for `nbytes` ahead of the snapshot that takes it;
        a failure leaves that snapshot to allocate it (and report it)."""
        assert self._memory is not None
        started = time.monotonic()
        allocated = self._memory.allocate_ahead(slot, nbytes)
        if allocated is None:
            return  # the snapshot that takes it tries again, and reports a failure
        fd, capacity = allocated
        with contextlib.suppress(Exception):  # as above: the snapshot that takes it retries
            self._map_slot(slot, fd, capacity, started, ahead=True)

    @staticmethod
    def _build_pending_index(request: SaveRequest) -> bool:
        """Build the request's contribution (its pending index); False (and the request
        failed) if that raised.

        [Note: the rank's index is built off the training thread] The contribution (the
        rank's index as JSON, its report's tensor list) is pure data derived from the
        flattened state, which `save()` captured; building it took 0.4-0.9 ms of `save()` on
        the bench's 156-leaf state, i.e. of the stall. Here it runs before the copy and the
        dispatch (the write message carries the index), and nothing reads the contribution
        before the request reaches WRITING.
        """
        build = request.build_pending_index
        if build is None:
            return True
        request.build_pending_index = None
        try:
            request.contribution.update(build())
        except Exception as err:
            request.tensors = []
            request.fail(f"building the rank's index failed: {type(err).__name__}: {err}")
            return False
        return True

    @staticmethod
    def _encode_report_body(request: SaveRequest) -> bool:
        """Pickle the bulk of the rank's report before the request can reach OK; False (and
        the request failed) if that raised. [Note: the report is encoded before the files
        are durable] in `report.py`."""
        try:
            request.report_body = encode_report_body(request.contribution)
        except Exception as err:
            request.fail(f"report encoding failed: {type(err).__name__}: {err}")
            return False
        return True

    def _streams(self, request: SaveRequest) -> bool:
        return (
            self._config.async_mode is not AsyncMode.SYNC
            and self._storage.capabilities.progressive_write
            and request.file_name is not None
        )

    def _allocate(self, request: SaveRequest) -> Slab | None:
        """The request's staging buffer (None: allocation failed, the request too; or an
        extra memory slot could not be allocated for a memory-only request: it is skipped).
        A durable request whose extra slot could not be allocated skips its snapshot and is
        staged in a plain buffer."""
        t0 = time.monotonic()
        job = request.memory
        try:
            # Allocating here, not in save(), keeps even the first save() non-blocking.
            if job is None:
                request.slab = self._slab_for(request.slot, request.layout.total_bytes)
            else:
                assert self._memory is not None
                assert job.flat is not None
                job.plan, job.ext_tensors = self._memory.plans.plan(
                    job.flat, job.durable, request.layout
                )
                request.slab = self._memory_slab_for(job, job.plan.payload.total_bytes)
                if request.slab is None:  # an extra slot that did not fit: snapshot skipped
                    job.ext_tensors, job.flat = [], None
                    if not request.durable:
                        request.tensors = []
                        return None
                    # The durable write goes on from a plain staging buffer.
                    request.memory = None
                    request.slab = self._slab_for(request.slot, request.layout.total_bytes)
        except Exception as err:
            request.tensors = []
            if job is not None:
                job.ext_tensors, job.flat = [], None
                job.error = f"{type(err).__name__}: {err}"
            request.fail(f"snapshot copy failed: {type(err).__name__}: {err}")
            return None
        request.staging_s += time.monotonic() - t0
        return request.slab

    def _copy(
        self, request: SaveRequest, slab: Slab, on_progress: Callable[[int], None] | None = None
    ) -> bool:
        """Copy the snapshot into `slab` (with the memory tier: the whole payload, then the
        slot's meta); False (and the request failed) if the copy failed."""
        job = request.memory
        layout, tensors, split = request.layout, request.tensors, request.layout.total_bytes
        if job is not None:
            assert job.plan is not None
            layout, tensors = job.plan.payload, [*tensors, *job.ext_tensors]
        try:
            t0 = time.monotonic()
            fence = request.device_fence
            if fence is None:
                # [Note: the checksum rides on the staging copy] in staging.py
                request.checksum, payload_checksum = copy_payload_into_slab(
                    slab, layout, tensors, split, on_progress, algorithm=SAVE_ALGORITHM
                )
            else:  # [Note: CUDA staging] in device_copy.py
                sums = LandedChecksums(slab, split, layout.total_bytes, _up_to(on_progress, split))
                try:
                    copy_to_pinned_slab(slab, layout, tensors, fence, sums.landed)
                    request.checksum, payload_checksum = sums.finish()
                finally:
                    sums.close()
            request.staging_s += time.monotonic() - t0
        except Exception as err:
            if job is not None:
                job.error = f"snapshot copy failed: {type(err).__name__}: {err}"
            request.fail(f"snapshot copy failed: {type(err).__name__}: {err}")
            return False
        finally:
            request.tensors = []
            if job is not None:
                job.ext_tensors = []
            request.copied.set()  # the training loop may now change the tensors
        if job is not None:
            self._complete_snapshot(request, job, payload_checksum)
        return True

    def _complete_snapshot(self, request: SaveRequest, job: SnapshotJob, value: int) -> None:
        """Write the slot's meta: the snapshot counts from now on. A failure to write it
        fails a memory-only request; a durable one goes on (its file does not need it)."""
        assert self._memory is not None
        try:
            self._memory.complete(job, SAVE_ALGORITHM, value)
        except Exception as err:
            job.flat = None
            job.error = f"{type(err).__name__}: {err}"
            if not request.durable:
                request.fail(f"memory snapshot failed: {job.error}")

    def _stage_streamed(self, request: SaveRequest, slab: Slab) -> None:
        """Hand the request to the writer first, then copy, reporting progress."""
        self._dispatch(request, streamed=True)
        writer = request.writer
        if request.state is not SaveState.WRITING or writer is None:
            request.tensors = []
            return

        def progress(upto: int) -> None:
            try:
                writer.send_progress(request.request_id, upto)
            except OSError as err:  # the first cause wins: name the writer, not the copy
                request.fail(f"writer process {writer.pid} unreachable: {err}")
                raise

        if self._copy(request, slab, progress) and self._encode_report_body(request):
            try:
                writer.send_progress(
                    request.request_id,
                    request.layout.total_bytes,
                    checksum=_staged_checksum(request),
                )
            except OSError as err:
                request.fail(f"writer process {writer.pid} unreachable: {err}")
        else:
            with contextlib.suppress(OSError):  # the writer's own failure is reported too
                writer.send_progress(request.request_id, 0, error=request.error)
                request.abort_sent = True

    def _dispatch(self, request: SaveRequest, *, streamed: bool = False) -> None:
        slab = request.slab
        assert slab is not None
        if not request.start_writing():
            return  # the save failed meanwhile (here or on another rank): nothing to write
        if request.file_name is None:
            # No shard file, but an index (the rank's RankLocal plain values): one small
            # write on this staging thread, never on the training thread.
            try:
                entry = write_finished_index(
                    self._storage,
                    request.contribution["index_json"],
                    0,
                    0,
                    spread_prefixes=request.contribution["spread_prefixes"],
                )
            except CheckpointError as err:
                request.fail(f"write failed: {err}")
                return
            request.finish_ok(index=(entry.size, entry.crc32))
            return
        name = f"{step_dir(request.step)}/{request.file_name}"
        if self._config.async_mode is AsyncMode.SYNC:
            self._write_inline(request, name)
            return
        try:
            if self._config.async_mode is AsyncMode.TEMPORAL:
                request.writer = WriterProcess(self._rank)
            assert request.writer is not None
            request.writer.submit(slab, self._write_message(request, name, slab, streamed))
            if self._config.async_mode is AsyncMode.TEMPORAL:
                request.writer.request_stop()
        except OSError as err:
            request.fail(f"writer process unreachable: {err}")

    def _write_message(
        self, request: SaveRequest, name: str, slab: Slab, streamed: bool
    ) -> dict[str, Any]:
        return {
            "op": "write",
            "request_id": request.request_id,
            "step": request.step,
            "name": name,
            "slab_id": slab.slab_id,
            "nbytes": request.layout.total_bytes,
            "root_uri": self._storage.root_uri,
            "storage_options": dict(self._storage.storage_options),
            "chunk_bytes": self._config.upload_chunk_bytes,
            "concurrency": self._config.upload_concurrency,
            "streamed": streamed,
            "retry_for_s": self._retry_for_s(),
            "index_json": request.contribution["index_json"],
            # Streamed: the copy has not run yet; the checksum follows its last byte count.
            "checksum": None if streamed else _staged_checksum(request),
            "spread_prefixes": request.contribution["spread_prefixes"],
        }

    def _retry_for_s(self) -> float:
        """How long a writer may wait out a store outage: inside `write_timeout_s`, with room
        for one last attempt ([Note: a store outage is waited out, not failed])."""
        return max(0.0, 0.8 * self._config.write_timeout_s)

    def _write_inline(self, request: SaveRequest, name: str) -> None:
        t0 = time.monotonic()
        assert request.slab is not None
        view = request.slab.view(request.layout.total_bytes)
        try:
            size, index = write_shard_retrying(
                self._storage,
                name,
                view,
                chunk_bytes=self._config.upload_chunk_bytes,
                concurrency=self._config.upload_concurrency,
                retry_for_s=self._retry_for_s(),
                on_retry=lambda err, delay: self._log.warning(
                    "ckpt_write_retrying", ckpt_step=request.step, error=str(err), retry_in_s=delay
                ),
                index_json=request.contribution["index_json"],
                checksum=_staged_checksum(request),
                spread_prefixes=request.contribution["spread_prefixes"],
            )
            assert index is not None
            request.finish_ok(size=size, index=(index.size, index.crc32))
        except CheckpointError as err:
            request.fail(f"write failed: {err}")
        finally:
            view.release()
            request.write_s = time.monotonic() - t0


def _up_to(on_progress: Callable[[int], None] | None, limit: int) -> Callable[[int], None] | None:
    """`on_progress` told only of the file's bytes (a payload goes on past them), each count
    once and rising."""
    if on_progress is None:
        return None
    told = 0

    def progress(upto: int) -> None:
        nonlocal told
        upto = min(upto, limit)
        if upto > told:
            told = upto
            on_progress(upto)

    return progress


def _staged_checksum(request: SaveRequest) -> int:
    """The checksum the staging copy computed (it runs before any write that needs it)."""
    assert request.checksum is not None, "the staging copy sets the checksum"
    return request.checksum
