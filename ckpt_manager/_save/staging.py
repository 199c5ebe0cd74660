"""Staging: shared-memory buffers for snapshots and the thread that fills them.

A `Slab` is one anonymous shared-memory file (`memfd`), or a memory-tier slot file on a
tmpfs ([Note: the memory tier] in `_memory/`), mapped in the trainer and, through
fd passing, in the writer: the trainer copies tensors into it (streaming stores where the
C helper is built: `chunk_copy.py`; checksumming each chunk as it is copied: [Note: the
checksum rides on the staging copy]), the writer writes it out. Slabs
are allocated once per in-flight slot and reused across saves while the state fits, so the
steady state allocates nothing. A memfd has no name, so nothing leaks if a process is killed.
Where the host's shmem THP mode is `advise`, a slab asks for huge pages ([Note: huge-page
slabs]).
For a CUDA snapshot a slab is page-locked once (`pin`), so the device-to-host copy lands in it
by DMA (`device_copy.py`); `close()` unlocks it.

`BackgroundThread` runs queued jobs on one long-lived daemon thread owned by the manager
(a queue and a sentinel); the manager waits on each job's own event, with a timeout. The
staging thread may run a few nice steps below the training thread ([Note: the staging thread
yields to training]).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import structlog
import torch

from ckpt_manager._format.checksum import SAVE_ALGORITHM, ChecksumAlgorithm, checksum, crc32c_at
from ckpt_manager._format.shard_file import FileLayout, TensorSlot
from ckpt_manager._save.chunk_copy import STAGING_COPY, byte_copy

__all__ = [
    "FUSED_CHUNK_BYTES",
    "BackgroundThread",
    "Slab",
    "copy_into_slab",
    "copy_into_slot",
    "copy_payload_into_slab",
    "lower_thread_priority",
    "shmem_thp_mode",
]

_MIN_CAPACITY = 1 << 16
_log = structlog.get_logger("ckpt_manager.staging")


class Slab:
    """A reusable shared-memory staging buffer."""

    def __init__(self, slab_id: int, capacity: int, *, fd: int | None = None) -> None:
        """Allocate and populate `capacity` bytes of shared memory.

        Args:
            slab_id: unique per manager.
            capacity: size in bytes.
            fd: map this file instead of a new memfd (a memory-tier slot file, whose
                `capacity` bytes the caller allocated with `posix_fallocate`); the slab owns
                the descriptor from now on.
        """
        self.slab_id = slab_id
        """Unique per manager; the writer caches mappings by it."""
        self.capacity = max(_MIN_CAPACITY, capacity) if fd is None else capacity
        """Size in bytes."""
        self.fd = (
            os.memfd_create(f"trainingd-ckpt-{os.getpid()}-{slab_id}", os.MFD_CLOEXEC)
            if fd is None
            else fd
        )
        """The memfd or slot file (sent to writers)."""
        advised = None
        if fd is None:
            os.ftruncate(self.fd, self.capacity)
            if shmem_thp_mode() == "advise":
                advised = _map_huge_advised(self.fd, self.capacity)
        self.huge_pages_advised = advised is not None
        """Whether the mapping asked for transparent huge pages ([Note: huge-page slabs])."""
        if advised is None:
            # Allocate and map every page now: first-touch faults during the snapshot copy
            # would make the first save's copy several times slower than a memcpy. (A slot
            # file is allocated already: there this finds every page present.) Allocated
            # first, a page's fault cannot fail for want of memory (no SIGBUS).
            if fd is None:
                os.posix_fallocate(self.fd, 0, self.capacity)
            advised = mmap.mmap(self.fd, self.capacity, flags=mmap.MAP_SHARED)
        self._mm = advised
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)
        """The whole buffer as a uint8 tensor."""
        if not self.huge_pages_advised:
            _fault_in_page_by_page(self.tensor)
        self._pinned = False
        self.copy_program: _CopyProgram | None = None
        """The last copy's steps ([Note: the copy program is made once per layout])."""

    def pin(self) -> None:
        """Page-lock the buffer for CUDA copies (`cudaHostRegister`, once per slab).

        Raises:
            RuntimeError: the buffer is closed, or CUDA refused (the message says why).
        """
        if self._pinned:
            return
        if self.tensor is None:
            raise RuntimeError(f"staging buffer {self.slab_id} is closed")
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        # cudaHostRegisterPortable: page-locked for every GPU's context, not only for the one
        # current on the staging thread (device 0 unless set there).
        portable = 1
        torch.cuda.check_error(
            cudart.cudaHostRegister(self.tensor.data_ptr(), self.capacity, portable)
        )
        self._pinned = True

    def view(self, nbytes: int) -> memoryview:
        """The first `nbytes` as a memoryview (for in-process writes)."""
        return memoryview(self._mm)[:nbytes]

    def close(self) -> None:
        """Unmap and close; call once no tensor or view of it is alive."""
        if self._pinned and self.tensor is not None:
            with contextlib.suppress(RuntimeError):  # best effort: the mapping goes anyway
                cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
                torch.cuda.check_error(cudart.cudaHostUnregister(self.tensor.data_ptr()))
            self._pinned = False
        self.tensor = None
        self.copy_program = None  # its slot views hold the mapping
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


_SHMEM_THP_PATH = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap module has no name for it


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def _fault_in_page_by_page(buf: torch.Tensor) -> None:
    """Map every page of `buf` (a shared mapping whose pages are allocated) by reading one
    byte of each, with the GIL released.

    [Note: a slab is faulted in page by page] Populating a mapping in one call
    (`MADV_POPULATE_WRITE`, `MAP_POPULATE`) holds the process's mmap lock until every page is
    in; every other thread's `mmap`/`munmap`, e.g. the training thread's allocator freeing a
    large tensor, waits for all of it, and a waiting writer holds up new page faults too. On
    the staging thread, below training's priority on a busy core, the call also waits for
    the CPU while it holds the lock: on the 2-core VM (`bench/slab_fault_in.py`: a nice-10
    thread mapping 268 MB slot files while a nice-0 thread allocates and frees 64 MiB
    tensors, two busy processes beside them) the nice-0 thread's p99 iteration took 640-723
    ms (max 653-840) with one populate call, against 55-73 ms with the pages faulted in one at
    a time as here (102-119 ms with that thread copying memory instead). Each read fault
    takes the lock for a moment; on a shared mapping of a tmpfs file it maps the page
    writable, so the copy takes no fault later (68.8k faults for 268 MB here, 6 in the first
    write after them). A torch reduction over one byte per page releases the GIL ([Note: a
    slab is populated without the GIL]: the staging thread must not stop the training
    thread's Python either).
    """
    int(buf[:: mmap.PAGESIZE].sum())


def _populate_without_the_gil(mm: mmap.mmap, nbytes: int) -> bool:
    """Fault in every page of `mm` writable (`MADV_POPULATE_WRITE`) with the GIL released;
    False where the kernel has no such advice (before Linux 5.14).

    [Note: a slab is populated without the GIL] `mmap.mmap(..., MAP_POPULATE)` and
    `mmap.madvise` hold the GIL while the kernel faults the pages in: a 256 MiB slab held it
    122 ms (77 ms through `madvise`) on the development VM, so a slab made on the staging
    thread (a memory slot's first use, a durable save's buffer) stopped the training thread's
    Python as long. A ctypes call releases the GIL for its duration. Only a huge-page slab
    is populated so now ([Note: huge-page slabs]: its pages are allocated by the faults, and
    this call reports a shortage where a fault would raise SIGBUS); it holds the mmap lock
    throughout ([Note: a slab is faulted in page by page]).

    Raises:
        OSError: the kernel could not populate (a shortage of memory).
    """
    buffer = (ctypes.c_char * nbytes).from_buffer(mm)  # an export of `mm`, dropped below
    try:
        address = ctypes.addressof(buffer)
    finally:
        del buffer
    if _libc.madvise(address, nbytes, _MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return False
    raise OSError(err, f"populating a staging buffer: {os.strerror(err)}")


def shmem_thp_mode() -> str:
    """The host's transparent-huge-page mode for shared memory (`never`, `advise`,
    `within_size`, `always`, ...), or "" where the kernel does not say."""
    try:
        with open(_SHMEM_THP_PATH, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def _map_huge_advised(fd: int, capacity: int) -> mmap.mmap | None:
    """Map `fd` asking for huge pages, then populate it; None where the kernel refuses.

    [Note: huge-page slabs] With shmem THP in `advise` mode a memfd gets 2 MiB pages only
    when a mapping with `MADV_HUGEPAGE` faults them in, so the slab is populated through the
    advised mapping (`MADV_POPULATE_WRITE`, which reports a shortage as an error instead of
    a later SIGBUS) rather than by `posix_fallocate`. Huge pages mean fewer TLB misses for
    the staging copy and fewer pages for the writer's `O_DIRECT` to pin. In `within_size` and
    `always` modes `posix_fallocate` gets them by itself; in `never` (the development VM:
    there `MADV_HUGEPAGE` is accepted and changes nothing) nothing is asked. Measured on
    that VM with 4 KiB pages, filling the slab costs the same as private memory.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or capacity < 2 << 20:
        return None
    mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
    try:
        mm.madvise(advice)
        populated = _populate_without_the_gil(mm, capacity)
    except OSError:  # a shortage: the plain path decides
        populated = False
    if not populated:  # or an older kernel (no MADV_POPULATE_WRITE)
        mm.close()
        return None
    return mm


def copy_into_slot(
    buf: torch.Tensor, slot: TensorSlot, tensor: torch.Tensor, *, non_blocking: bool = False
) -> None:
    """Copy `tensor` into its slot of the byte buffer `buf` (CPU, or device-to-host async)."""
    dst = buf[slot.offset : slot.offset + slot.nbytes]
    src = tensor.detach()
    if _plain_bytes(src, slot):
        # As bytes: a plain memcpy, ~5% cheaper than the typed copy kernel.
        dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=non_blocking)
    else:
        dst.view(slot.dtype).view(slot.shape).copy_(src, non_blocking=non_blocking)


def _plain_bytes(src: torch.Tensor, slot: TensorSlot) -> bool:
    """Whether `src`'s memory holds exactly the slot's bytes: same dtype, contiguous, and no
    lazy conjugate/negative bit (a `.conj()` view's memory holds the unconjugated values;
    the typed copy resolves the bit, a byte copy would not)."""
    return (
        src.dtype == slot.dtype and src.is_contiguous() and not src.is_conj() and not src.is_neg()
    )


def copy_into_slab(
    slab: Slab,
    layout: FileLayout,
    tensors: Sequence[torch.Tensor],
    on_progress: Callable[[int], None] | None = None,
    progress_bytes: int = 32 << 20,
    *,
    algorithm: ChecksumAlgorithm = SAVE_ALGORITHM,
) -> int:
    """Copy the header and every tensor into the slab at its planned offset; returns the
    checksum (by `algorithm`) of the file's `layout.total_bytes`.

    [Note: the checksum rides on the staging copy] Each tensor is copied in chunks of
    `FUSED_CHUNK_BYTES` and each chunk is checksummed right after its copy, while it is
    still in cache: the checksum then costs its arithmetic only, not a second pass over the
    state through memory (in the writer process, as before). The writer only writes.
    A CPU tensor's bytes are copied on the two addresses (no tensor slicing per chunk) with
    streaming stores ([Note: the staging copy streams past the cache] in `_streaming_copy.c`;
    libc's `memmove` where that helper is not built), and the checksum reads the source
    chunk, which the copy just brought into cache (CRC-32C on its address: [Note: CRC-32C
    through ISA-L] in `_format/checksum.py`). Taken on the source, it also covers the copy: a
    byte the copy got wrong fails the slab's verification instead of being checksummed in.

    `on_progress(n)` is called whenever the first `n` bytes of the file are final, at least
    `progress_bytes` apart, and last with `layout.total_bytes` (a streamed write follows it).
    """
    return copy_payload_into_slab(
        slab, layout, tensors, layout.total_bytes, on_progress, progress_bytes, algorithm=algorithm
    )[0]


def copy_payload_into_slab(
    slab: Slab,
    layout: FileLayout,
    tensors: Sequence[torch.Tensor],
    split_at: int,
    on_progress: Callable[[int], None] | None = None,
    progress_bytes: int = 32 << 20,
    *,
    algorithm: ChecksumAlgorithm = SAVE_ALGORITHM,
) -> tuple[int, int]:
    """`copy_into_slab` for a memory-tier payload: the durable file's bytes `[0, split_at)`
    then more slots; returns the checksums of the first `split_at` bytes (the file's) and of
    all `layout.total_bytes` (the payload's), both from the one pass.

    `on_progress` concerns the file only: its last call says `split_at`, before the slots
    past it are copied.
    """
    buf = slab.tensor
    if buf is None:
        raise RuntimeError(f"staging buffer {slab.slab_id} is closed")
    program = slab.copy_program
    if program is None or not program.fits(buf, layout, split_at, tensors):
        program = slab.copy_program = _CopyProgram(buf, layout, split_at, tensors)
    reported = 0
    split_value: int | None = None
    view = slab.view(layout.total_bytes)
    value = 0  # the checksum of the payload's bytes [0, done)
    done = 0

    def checksummed_to(end: int) -> None:
        """`[0, end)` is checksummed: report the file's progress."""
        nonlocal done, reported
        done = end
        if on_progress is not None and end <= split_at and end - reported >= progress_bytes:
            on_progress(end)
            reported = end

    def checksum_to(end: int) -> None:
        """Checksum `[done, end)` (alignment padding included: the file holds it too)."""
        nonlocal value, done, split_value, reported
        if split_value is None and end >= split_at:
            value = split_value = checksum(algorithm, view[done:split_at], value)
            done = split_at
            if on_progress is not None and reported < split_at:
                on_progress(split_at)
                reported = split_at
        value = checksum(algorithm, view[done:end], value)
        checksummed_to(end)

    try:
        with torch.no_grad():
            buf[: program.header_bytes].copy_(program.header)
            checksum_to(program.header_bytes)
            for step in program.steps:
                if isinstance(step, _Batch):
                    torch._foreach_copy_(step.destinations, [tensors[i] for i in step.indices])
                    checksum_to(step.end)
                    continue
                slot = layout.slots[step]
                _check_shape(slot, tensors[step])
                checksum_to(slot.offset)
                value = _copy_checksummed(buf, view, slot, tensors[step], algorithm, value)
                checksummed_to(slot.offset + slot.nbytes)
            checksum_to(layout.total_bytes)
    finally:
        view.release()
    if on_progress is not None and reported < split_at:
        on_progress(split_at)
    assert split_value is not None
    return split_value, value


def _check_shape(slot: TensorSlot, tensor: torch.Tensor) -> None:
    """A tensor whose shape is not its slot's would be broadcast or read past its end."""
    if tensor.shape != slot.shape:
        raise ValueError(
            f"tensor {slot.key!r} has shape {tuple(tensor.shape)}, its slot {slot.shape}"
        )


class _Batch(NamedTuple):
    """Small tensors copied by one `torch._foreach_copy_` ([Note: small tensors in one call])."""

    indices: list[int]
    """Their positions in the save's tensor list."""
    destinations: list[torch.Tensor]
    """Their slots in the slab, as typed views of the slot's shape."""
    end: int
    """The payload offset the batch's checksum reaches (its last slot's end)."""


class _CopyProgram:
    """The steps of a staging copy into one slab, made once per layout.

    [Note: the copy program is made once per layout] Deciding per tensor what to batch and
    slicing its slot out of the slab cost some 10 microseconds a tensor of Python on the
    staging thread: for the default job's 209 leaves a memory snapshot's copy took 3.5 ms of
    CPU for 5 MiB (a memcpy of it: 0.4 ms), every step at `memory_every 1`, on a core the
    ranks train on. The plan of a copy depends only on the layout (the same object while
    the state's layout is unchanged) and on each tensor being a CPU tensor of its slot's
    dtype and shape, so the slab keeps its last program (its batches' slot views are typed
    views of the slab) and each save only checks the tensors against it.
    """

    def __init__(
        self, buf: torch.Tensor, layout: FileLayout, split_at: int, tensors: Sequence[torch.Tensor]
    ) -> None:
        self.buf = buf
        self.layout = layout
        self.split_at = split_at
        self.header = torch.frombuffer(bytearray(layout.header), dtype=torch.uint8)
        self.header_bytes = len(layout.header)
        self.steps: list[_Batch | int] = []
        self._signature: list[tuple[int, torch.dtype, torch.Size]] = []
        indices: list[int] = []
        first = 0
        for index, (slot, tensor) in enumerate(zip(layout.slots, tensors, strict=True)):
            _check_shape(slot, tensor)
            if slot.nbytes == 0:
                continue
            if _batched(slot, tensor):
                # A batch never spans the file's end (its checksum is taken there).
                if indices and (
                    slot.offset + slot.nbytes - first > _BATCH_BYTES
                    or first < split_at <= slot.offset
                ):
                    self._close_batch(indices)
                    indices = []
                if not indices:
                    first = slot.offset
                indices.append(index)
                self._signature.append((index, slot.dtype, tensor.shape))
                continue
            if indices:
                self._close_batch(indices)
                indices = []
            self.steps.append(index)
        if indices:
            self._close_batch(indices)

    def _close_batch(self, indices: list[int]) -> None:
        slots = [self.layout.slots[i] for i in indices]
        destinations = [
            self.buf[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in slots
        ]
        self.steps.append(_Batch(indices, destinations, slots[-1].offset + slots[-1].nbytes))

    def fits(
        self, buf: torch.Tensor, layout: FileLayout, split_at: int, tensors: Sequence[torch.Tensor]
    ) -> bool:
        """Whether this program copies `tensors` into `buf` by `layout` as a new one would:
        the same buffer and layout, and every batched tensor still a CPU tensor of its slot's
        dtype and shape (a typed copy would convert or broadcast anything else)."""
        if buf is not self.buf or split_at != self.split_at or len(tensors) != len(layout.slots):
            return False
        if layout is not self.layout and layout != self.layout:
            return False
        for index, dtype, shape in self._signature:
            tensor = tensors[index]
            if not tensor.is_cpu or tensor.dtype != dtype or tensor.shape != shape:
                return False
        return True


_BATCH_BYTES = 4 << 20
"""The most bytes one call copies as a batch of small tensors ([Note: small tensors in one
call]): their checksum, one pass behind the copy, still reads them from the cache."""


def _batched(slot: TensorSlot, tensor: torch.Tensor) -> bool:
    """Whether `tensor` is copied with its neighbours in one call: a plain CPU tensor smaller
    than a fused chunk.

    [Note: small tensors in one call] Every ctypes call (`memmove`, ISA-L's CRC) and every
    torch copy releases the GIL and must take it back from the training thread, which holds
    it through the Python of its forward and backward: a round trip each, tens of
    microseconds when the training thread runs Python, up to the 5 ms switch interval when
    it runs nothing else. Copying the default job's 156 small tensors one by one, with a
    CRC call per tensor and per gap, took some 500 round trips per snapshot, and the
    optimizer step's fence waited 4-14 ms (p50, loaded machine) for a 5 MiB copy. Runs of
    small tensors are copied by one `torch._foreach_copy_` and checksummed by one CRC call
    (up to `_BATCH_BYTES`): a handful of round trips per snapshot. Large tensors keep the
    chunked fused copy ([Note: the checksum rides on the staging copy]).
    """
    return (
        tensor.device.type == "cpu"
        and slot.nbytes < FUSED_CHUNK_BYTES
        and _plain_bytes(tensor.detach(), slot)
    )


FUSED_CHUNK_BYTES = 256 << 10
"""Copy-then-checksum granularity: well inside L2 (the chunk's source sits there while the
checksum reads it back), big enough that per-call overhead is noise. With `memmove` (below
glibc's `rep movsb` stop threshold, 1 MiB, its string copy measured 10-20 % cheaper than torch's
chunked copy kernel: BENCHMARKS.md, issue 20), on a 2 MiB-L2 Xeon, 580 MiB in 64 tensors
(`bench/save_cpu_floor.py`): 1.17 / 1.12 / 1.15 / 1.24 memcpys of CPU at 128 KiB / 256 KiB /
512 KiB / 1 MiB."""

_copy_bytes = byte_copy(STAGING_COPY)
"""The staging copy's byte copy ([Note: the staging copy streams past the cache])."""


def _copy_checksummed(
    buf: torch.Tensor,
    view: memoryview,
    slot: TensorSlot,
    tensor: torch.Tensor,
    algorithm: ChecksumAlgorithm,
    value: int,
) -> int:
    """Copy one tensor into its slot, checksumming it chunk by chunk behind the copy."""
    src = tensor.detach()
    if not _plain_bytes(src, slot) or src.device.type != "cpu":
        # A conversion, a gather, a conjugate view or another device: copied whole by torch's
        # typed kernel, then checksummed.
        copy_into_slot(buf, slot, tensor)
        return checksum(algorithm, view[slot.offset : slot.offset + slot.nbytes], value)
    # Raw addresses ([Note: the checksum rides on the staging copy]); `src` and the slab
    # stay alive for the whole loop. Both calls release the GIL, like torch's copy did. The
    # checksum reads the source chunk, still in cache: the slab's lines were streamed past
    # it ([Note: the staging copy streams past the cache] in `_streaming_copy.c`).
    src_address = src.data_ptr()
    dst_address = buf.data_ptr() + slot.offset
    by_address = algorithm is ChecksumAlgorithm.CRC32C
    for start in range(0, slot.nbytes, FUSED_CHUNK_BYTES):
        length = min(slot.nbytes - start, FUSED_CHUNK_BYTES)
        _copy_bytes(dst_address + start, src_address + start, length)
        if by_address:
            value = crc32c_at(src_address + start, length, value)
        else:
            chunk = (ctypes.c_char * length).from_address(src_address + start)
            value = checksum(algorithm, memoryview(chunk).cast("B"), value)
    return value


_MAX_NICE = 19


def lower_thread_priority(increment: int) -> int | None:
    """Lower the calling thread's CPU priority by `increment` nice steps (capped at 19);
    returns its nice value now, or None where the platform has no per-thread nice (logged).

    [Note: the staging thread yields to training] A snapshot's copy runs on the staging
    thread while the training thread runs the next step's forward and backward, and it must
    end before that step's optimizer step (the fence). Where the rank has no spare core (a
    CPU job using every core) the two share one, and at the same priority the scheduler
    gives the copy half of it at once: the step pays the whole copy. A few nice steps below
    the training thread (`CheckpointConfig.staging_nice`) the copy takes the core's gaps first
    (the waits on the gradient reductions' peers, the loader) and a small share beside the
    running step; at the fence the training thread blocks and the copy has the core. On the
    development VM (256 MiB job, 1 node x 2 ranks on 2 cores, `bench/staging_nice.py`,
    three interleaved passes) `memory_every 1` added 24-36 ms (median 25) to the step at
    nice 10 against 35-58 ms (41) at nice 0, lower in every pass, stall p99 3.9 ms against
    5.1; but `auto`, whose cadence then measured cheaper snapshots and took 2.2x as many, added
    4-22 ms against 1-10, and 3 of its 58 snapshots stalled 5-35 ms (the copy unfinished at
    the fence). With `bench/snapshot_stall.py` (same job), nice 15 and 19 left 13-24 % of the
    copies pending at the fence (p99 stall 16-20 ms), `SCHED_IDLE` 13-56 % (12-25 ms).
    Those figures are of the `memmove` copy (1.14 memcpys of CPU). With the streaming copy
    (0.67: [Note: the staging copy streams past the cache] in `_streaming_copy.c`), three
    interleaved passes of nice 0 / 10 / 19: `memory_every 1` added 14-32 ms (median 21.7,
    1.11 memcpys) / 9-24 (15.9, 0.81) / 3-22 (6.5, 0.33), stall p99 4.8 / 3.0 / 8.0 ms;
    `auto` -4.5-13.9 (8.6) / -7.9-12.1 (0.3) / -1.6-7.0 (1.9) ms with about as many
    snapshots at each (64 / 56 / 66), but one snapshot a run at nice 10 and 19 stalling
    10-100 ms (the slot allocation's, at the lower priority). Why a lower priority helps
    more than the CPU it moves: the ranks' gradient all-reduces wait for the slowest rank,
    so time the copy takes from one rank at one bucket and from the other at another adds
    up in the step, where the same copy in the waits costs nothing. The engine's default
    stays 0 (a library does not renice threads unasked); the daemon's `[checkpoint]
    staging_nice` defaults to 10. Linux keeps nice per thread (`setpriority` on the thread id), so
    only this thread moves; an unprivileged process may lower a priority but never raise it
    back, so the staging thread keeps it for its life.
    """
    try:
        tid = threading.get_native_id()
        nice = min(_MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError) as err:  # no per-thread nice here: runs as it is
        _log.warning("ckpt_thread_priority_unchanged", increment=increment, error=str(err))
        return None
    return nice


class BackgroundThread:
    """One daemon thread running submitted jobs in order until `close()`."""

    def __init__(self, name: str, *, nice: int = 0) -> None:
        """Start the thread, `nice` steps below the CPU priority of the thread starting it
        (a Linux nice increment, 0 to 19: `lower_thread_priority`)."""
        if not 0 <= nice <= _MAX_NICE:
            raise ValueError(f"nice={nice}: use 0 (the same priority) to {_MAX_NICE}")
        self._nice = nice
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue a job; jobs must catch their own errors (they report through events)."""
        self._queue.put(job)

    def _run(self) -> None:
        if self._nice:
            lower_thread_priority(self._nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except Exception as err:  # jobs report through their own events; keep serving
                _log.exception(
                    "ckpt_background_job_crashed", thread=self._thread.name, error=str(err)
                )

    def close(self, timeout_s: float) -> bool:
        """Send the sentinel and join; returns False if the thread is still busy."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()
