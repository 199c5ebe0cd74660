"""`O_DIRECT` writes from registered buffers through `io_uring` (Linux, x86-64).

[Note: direct writes from registered buffers] An `O_DIRECT` `pwrite` pins every 4 KiB page
of its buffer for the duration of the call (`get_user_pages`), and unpins it after: on the
development VM that page-table walk was 40-60% of the writer's CPU (`perf`). The writer
writes from the same few staging slabs save after save, so their pages can be pinned once:
`io_uring`'s registered buffers (`IORING_REGISTER_BUFFERS`) are pinned at registration and
`IORING_OP_WRITE_FIXED` writes from them without pinning. A 512 MiB write and fsync on that VM
(`bench/direct_write.py`, 6 interleaved rounds): 0.37 memcpy of CPU [0.33-0.40] with `pwrite`,
0.15 [0.13-0.17] from the registered buffer, at the same rate (1.5-1.6 GB/s). The file is
allocated first (`fallocate`): a write that extends a file cannot complete inline on ext4 and
is handed to io_uring's worker threads, which cost more than `pwrite` (1.2-1.35 memcpys in a
prototype).

No liburing: the three system calls through `ctypes`, the rings mapped with `mmap`. Only on
x86-64, whose stores are seen in program order (the submission entry is written before the
ring's tail without a fence). Where the kernel, its seccomp profile (Docker's default profile
refuses `io_uring`) or `RLIMIT_MEMLOCK` (registered pages count against it unless the
process has `CAP_IPC_LOCK`) refuse, `DirectRing.open()` or `register()` says so with None and
the caller keeps `pwrite`. `TRAININGD_IO_URING=off` turns it off.

Only the owner of a mapping registers it (`register`: the writer process, for each staging
slab it maps), and it calls `forget` before unmapping it: a registered range stays pinned,
and the ring writes from the pages pinned at registration whatever is mapped at that address
later. Closing the ring (or the process ending) unpins everything. One thread at a time uses
a ring (`DirectRing.lock`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import struct
import threading
import weakref
from typing import NamedTuple

from ckpt_manager._store.backends.lazy_log import LazyLogger

__all__ = ["IO_URING_ENV", "DirectRing", "buffer_address", "ring_opened", "shared_ring"]

IO_URING_ENV = "TRAININGD_IO_URING"
"""`off` (or `0`, `no`, `false`): never use io_uring for direct writes."""


_log = LazyLogger("ckpt_manager.uring")  # [Note: the writer starts without structlog]


_SYS_SETUP, _SYS_ENTER, _SYS_REGISTER = 425, 426, 427  # x86-64
_REGISTER_BUFFERS, _UNREGISTER_BUFFERS = 0, 1
_ENTER_GETEVENTS = 1
_OP_WRITE_FIXED = 5
_OFF_SQES = 0x10000000
_FEAT_SINGLE_MMAP = 1
_ENTRIES = 32
_CHUNK = 8 << 20
"""Bytes per submitted write (a few in flight keep the device busy)."""
_IN_FLIGHT = 8
_MAX_BUFFERS = 16
"""Registered ranges kept (a writer has a slab per in-flight save and two memory slots)."""
_MAX_REGISTER = 1 << 30
"""The kernel's limit on one registered buffer; a larger range is registered in pieces."""
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # struct io_uring_sqe, 64 bytes
_CQE = struct.Struct("<QiI")  # struct io_uring_cqe, 16 bytes


class _Params(ctypes.Structure):
    """`struct io_uring_params` (with its two offset structs flattened)."""

    _fields_ = [
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        # io_sqring_offsets: head, tail, ring_mask, ring_entries, flags, dropped, array, resv1
        ("sq_off", ctypes.c_uint32 * 8),
        ("sq_user_addr", ctypes.c_uint64),
        # io_cqring_offsets: head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1
        ("cq_off", ctypes.c_uint32 * 8),
        ("cq_user_addr", ctypes.c_uint64),
    ]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _enabled() -> bool:
    setting = os.environ.get(IO_URING_ENV, "").strip().lower()
    return setting not in ("off", "0", "no", "false")


class _Range(NamedTuple):
    """A registered mapping: its pages `[start, end)` and the mapping object itself."""

    start: int
    end: int
    owner: weakref.ref[mmap.mmap]


def buffer_address(buffer: mmap.mmap | memoryview) -> int:
    """The address of a writable buffer's first byte."""
    holder = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder


def _alive(registered: _Range) -> bool:
    owner = registered.owner()
    return owner is not None and not owner.closed


class DirectRing:
    """One io_uring for `O_DIRECT` writes from registered buffers."""

    def __init__(self, libc: ctypes.CDLL, ring_fd: int, params: _Params) -> None:
        """Use `open()`."""
        self._libc = libc
        self._fd = ring_fd
        self.lock = threading.Lock()
        """Held by the thread using the ring."""
        sq_off, cq_off = params.sq_off, params.cq_off
        ring_bytes = max(sq_off[6] + params.sq_entries * 4, cq_off[5] + params.cq_entries * 16)
        if not params.features & _FEAT_SINGLE_MMAP:
            raise OSError(errno.ENOSYS, "io_uring without IORING_FEAT_SINGLE_MMAP (Linux < 5.4)")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._ring = mmap.mmap(ring_fd, ring_bytes, flags=flags, offset=0)
        self._sqes = mmap.mmap(ring_fd, params.sq_entries * 64, flags=flags, offset=_OFF_SQES)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._ring))
        self._base = base  # the ring mapping's address; the mapping lives as long as self
        self._sq_head = ctypes.c_uint32.from_address(base + sq_off[0])
        self._sq_tail = ctypes.c_uint32.from_address(base + sq_off[1])
        self._sq_mask = ctypes.c_uint32.from_address(base + sq_off[2]).value
        self._sq_array = base + sq_off[6]
        self._cq_head = ctypes.c_uint32.from_address(base + cq_off[0])
        self._cq_tail = ctypes.c_uint32.from_address(base + cq_off[1])
        self._cq_mask = ctypes.c_uint32.from_address(base + cq_off[2]).value
        self._cqes = cq_off[5]
        self.bytes_written = 0
        """Bytes written through the ring since it opened."""
        self._ranges: list[_Range] = []  # registered, by buffer index
        self._refused: set[tuple[int, int]] = set()

    @classmethod
    def open(cls) -> DirectRing | None:
        """A new ring, or None where io_uring is off or unavailable (logged once per
        process by `shared_ring`)."""
        if not _enabled() or platform.machine() != "x86_64" or not hasattr(os, "O_DIRECT"):
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        params = _Params()
        ring_fd = libc.syscall(_SYS_SETUP, _ENTRIES, ctypes.byref(params))
        if ring_fd < 0:
            err = ctypes.get_errno()
            _log.info("io_uring_unavailable", error=os.strerror(err))
            return None
        try:
            return cls(libc, ring_fd, params)
        except (OSError, ValueError) as err:
            os.close(ring_fd)
            _log.info("io_uring_unavailable", error=str(err))
            return None

    def close(self) -> None:
        """Unregister every buffer and close the ring."""
        with contextlib.suppress(BufferError, ValueError):
            self._ring.close()
        with contextlib.suppress(BufferError, ValueError):
            self._sqes.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._ranges = []

    # ------------------------------------------------------------------ buffers
    def register(self, buffer: mmap.mmap) -> bool:
        """Register the mapping `buffer` (pinning its pages) for writes; False if the kernel
        refuses (e.g. `RLIMIT_MEMLOCK`; a range refused is not asked for again).

        The caller owns the mapping and calls `forget` before unmapping it: until then its
        pages stay pinned. A range is used only for views of this very mapping object, so a
        mapping closed without `forget` is never written from its stale pinned pages.
        """
        live = [r for r in self._ranges if _alive(r)]  # a closed mapping's range: dropped
        if any(r.owner() is buffer for r in live):
            if len(live) != len(self._ranges):
                self._register(live)
            return True
        page = mmap.PAGESIZE
        address = buffer_address(buffer)
        start = address // page * page
        end = -(-(address + len(buffer)) // page) * page
        wanted = [*live[-(_MAX_BUFFERS - 1) :], _Range(start, end, weakref.ref(buffer))]
        if (start, end) not in self._refused and end - start <= _MAX_REGISTER:
            if self._register(wanted):
                return True
            self._refused.add((start, end))
        self._register(live)
        return False

    def find(self, view: memoryview) -> tuple[int, int] | None:
        """`(buffer index, address)` of `view` where it lies in a registered mapping (the
        same mapping object it was registered as); None otherwise."""
        owner = view.obj
        for index, found in enumerate(self._ranges):
            if found.owner() is owner and not owner.closed:
                address = buffer_address(view)
                if found.start <= address and address + len(view) <= found.end:
                    return index, address
        return None

    def forget(self, buffer: mmap.mmap) -> None:
        """Unregister `buffer` (before it is unmapped: its pages stay pinned until then)."""
        kept = [r for r in self._ranges if r.owner() is not buffer and _alive(r)]
        if len(kept) != len(self._ranges):
            self._register(kept)

    @property
    def registered(self) -> list[tuple[int, int]]:
        """The registered `(address, length)` ranges."""
        return [(r.start, r.end - r.start) for r in self._ranges]

    def _register(self, ranges: list[_Range]) -> bool:
        if self._ranges:
            self._libc.syscall(_SYS_REGISTER, self._fd, _UNREGISTER_BUFFERS, None, 0)
            self._ranges = []
        if not ranges:
            return True
        iovecs = (_Iovec * len(ranges))(*(_Iovec(r.start, r.end - r.start) for r in ranges))
        result = self._libc.syscall(
            _SYS_REGISTER, self._fd, _REGISTER_BUFFERS, ctypes.byref(iovecs), len(ranges)
        )
        if result < 0:
            err = ctypes.get_errno()
            _log.info(
                "io_uring_register_refused",
                error=os.strerror(err),
                bytes=sum(r.end - r.start for r in ranges),
                hint="registered buffers count against RLIMIT_MEMLOCK (LimitMEMLOCK= in systemd)"
                if err == errno.ENOMEM
                else None,
            )
            return False
        self._ranges = list(ranges)
        return True

    def allocate(self, fd: int, nbytes: int) -> bool:
        """Allocate the first `nbytes` of the file `fd` (`fallocate(2)`) before writing them
        through the ring: a write extending a file does not complete inline (see the
        module's note). False where the filesystem cannot (glibc's `posix_fallocate` would
        write a byte per block instead, which costs more than it saves)."""
        return self._libc.fallocate(fd, 0, ctypes.c_int64(0), ctypes.c_int64(nbytes)) == 0

    # ------------------------------------------------------------------ writes
    def write(self, fd: int, index: int, address: int, length: int, offset: int) -> int:
        """Write `length` bytes at `address` (inside registered buffer `index`) to `fd` at
        `offset`, in chunks, a few in flight; returns how many bytes from the start were
        written (`length`, or less after a short write, as `pwrite` would).

        Raises:
            OSError: a write failed (its errno: `EINVAL` where the file refuses `O_DIRECT`).
        """
        submitted = 0
        pending: dict[int, int] = {}  # start (relative) -> chunk length, in flight
        written: dict[int, int] = {}  # start -> bytes the chunk wrote
        failure: OSError | None = None
        short = False
        while pending or (submitted < length and failure is None and not short):
            while (
                submitted < length and len(pending) < _IN_FLIGHT and failure is None and not short
            ):
                size = min(_CHUNK, length - submitted)
                self._queue(fd, index, address + submitted, size, offset + submitted, submitted)
                pending[submitted] = size
                submitted += size
            self._enter(len(pending))
            for start, result in self._reap():
                size = pending.pop(start)
                if result < 0:
                    failure = failure or OSError(-result, os.strerror(-result))
                    continue
                written[start] = result
                short = short or result < size
        if failure is not None:
            raise failure
        done = 0  # contiguous from the start: a short chunk ends it
        while done < length and written.get(done, 0) > 0:
            done += written[done]
        if length and not done:
            raise OSError(errno.EIO, "io_uring write made no progress")
        self.bytes_written += done
        return done

    def _queue(self, fd: int, index: int, address: int, size: int, offset: int, tag: int) -> None:
        tail = self._sq_tail.value
        slot = tail & self._sq_mask
        _SQE.pack_into(
            self._sqes, slot * 64, _OP_WRITE_FIXED, 0, 0, fd, offset, address, size, 0, tag,
            index, 0, 0, 0, 0,
        )  # fmt: skip
        ctypes.c_uint32.from_address(self._sq_array + slot * 4).value = slot
        self._sq_tail.value = tail + 1  # seen after the entry: x86-64 keeps store order

    def _enter(self, in_flight: int) -> None:
        to_submit = (self._sq_tail.value - self._sq_head.value) & 0xFFFFFFFF
        while True:
            result = self._libc.syscall(
                _SYS_ENTER, self._fd, to_submit, 1 if in_flight else 0, _ENTER_GETEVENTS, None, 0
            )
            if result >= 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")
            to_submit = (self._sq_tail.value - self._sq_head.value) & 0xFFFFFFFF

    def _reap(self) -> list[tuple[int, int]]:
        out = []
        head = self._cq_head.value
        while head != self._cq_tail.value:
            tag, result, _flags = _CQE.unpack_from(
                self._ring, self._cqes + (head & self._cq_mask) * 16
            )
            out.append((tag, result))
            head = (head + 1) & 0xFFFFFFFF
            self._cq_head.value = head
        return out


class _Shared:
    """The process's ring, opened once on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tried = False
        self.ring: DirectRing | None = None


_shared = _Shared()


def ring_opened() -> bool:
    """Whether `shared_ring()` was asked for in this process (so buffers may be registered)."""
    return _shared.tried


def shared_ring() -> DirectRing | None:
    """This process's ring (made on first use), or None where io_uring is unavailable."""
    with _shared.lock:
        if not _shared.tried:
            _shared.tried = True
            _shared.ring = DirectRing.open()
        return _shared.ring
