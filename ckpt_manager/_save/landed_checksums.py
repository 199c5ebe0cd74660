"""The CRC-32C of a CUDA snapshot, taken part by part as its device-to-host copy lands.

[Note: the CUDA checksum overlaps the copy] The bytes arrive in the pinned slab by DMA, so the
checksum is one pass over the slab on the host. Taken after the whole copy, it added its own
time to the copy's; on an H200 a 4 GiB save staged at 8.76 GB/s, where the copy alone ran at
55 GB/s and ISA-L's CRC-32C at 12 GB/s on one of that host's cores. Here each part is handed
to a checksum thread as its progress mark passes, while the copy engine writes the next ones,
and the parts' CRCs are folded in order ([Note: CRC-32C of parts, combined] in checksum.py):
the save is staged a part after the slower of the copy and the checksum threads together.
One thread (overlap alone) staged the 4 GiB at 11.14 GB/s on the H200, the checksum's rate.

    LandedChecksums   a slab's file and payload checksums; `landed(upto)` as bytes arrive,
                      `finish()` for both values, `close()` waits for every part.
    checksum_threads  how many threads checksum parts: this process's cores, at most 4.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ckpt_manager._format.checksum import (
    SAVE_ALGORITHM,
    ChecksumAlgorithm,
    crc32c_at,
    crc32c_combine,
)
from ckpt_manager._save.staging import Slab

__all__ = ["LandedChecksums", "checksum_threads"]

PART_BYTES = 32 << 20
"""The largest part one thread checksums (the copy's progress marks are this far apart)."""
_MAX_THREADS = 4
"""Beyond four, ranks sharing a host's cores would take them from each other's training."""


class _SharedPool:
    """The process's checksum threads, started on first use (a CUDA save), none after a fork."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        os.register_at_fork(after_in_child=self._forget)

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(checksum_threads(), thread_name_prefix="ckpt-crc")
            return self._pool

    def _forget(self) -> None:
        # A forked child has the pool object but none of its threads.
        self._lock = threading.Lock()
        self._pool = None


def checksum_threads() -> int:
    """Threads that checksum parts: the cores this process may run on, at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, cores))


_POOL = _SharedPool()


class LandedChecksums:
    """A slab's file checksum (`[0, split)`) and payload checksum (`[split, total)`, continuing
    from the file's), taken as the slab's bytes land.

    Args:
        slab: the slab the copy writes (its first `total` bytes).
        split: where the shard file's bytes end (the memory tier's payload goes on).
        total: bytes the copy writes.
        then: told each `upto` after its parts are handed out (a streaming writer).
        threads: checksum threads (default `checksum_threads()`; 1: on the caller's thread).
    """

    def __init__(
        self,
        slab: Slab,
        split: int,
        total: int,
        then: Callable[[int], None] | None,
        threads: int | None = None,
    ) -> None:
        if slab.tensor is None:
            raise RuntimeError(f"staging buffer {slab.slab_id} is closed")
        if SAVE_ALGORITHM is not ChecksumAlgorithm.CRC32C:  # the fold is CRC-32C's
            raise RuntimeError(f"parts of a {SAVE_ALGORITHM} checksum cannot be combined")
        self._slab = slab  # kept mapped while a part is read
        self._address = slab.tensor.data_ptr()
        self._split, self._total, self._then = split, total, then
        threads = checksum_threads() if threads is None else threads
        self._pool = _POOL.get() if threads > 1 else None
        self._done = 0
        self._parts: list[tuple[int, int, Future[int] | int]] = []

    def landed(self, upto: int) -> None:
        """Bytes `[0, upto)` are in the slab: checksum the new ones, then tell `then`."""
        upto = min(upto, self._total)
        start = self._done
        if upto <= start:
            return
        while start < upto:
            end = min(upto, start + PART_BYTES)
            if start < self._split < end:  # a part lies wholly in the file or the payload
                end = self._split
            address, nbytes = self._address + start, end - start
            if self._pool is None:
                self._parts.append((start, end, crc32c_at(address, nbytes)))
            else:
                self._parts.append((start, end, self._pool.submit(crc32c_at, address, nbytes)))
            start = end
        self._done = upto
        if self._then is not None:
            self._then(upto)

    def finish(self) -> tuple[int, int]:
        """(file checksum, payload checksum) once every byte has landed."""
        self.landed(self._total)
        file, payload = 0, None
        for start, end, part in self._parts:
            value = part if isinstance(part, int) else part.result()
            if end <= self._split:
                file = crc32c_combine(file, value, end - start)
            else:
                payload = crc32c_combine(file if payload is None else payload, value, end - start)
        return file, file if payload is None else payload

    def close(self) -> None:
        """Wait for every part handed out (none reads the slab after this)."""
        for _, _, part in self._parts:
            if not isinstance(part, int):
                part.cancel()
        for _, _, part in self._parts:
            if not isinstance(part, int) and not part.cancelled():
                part.exception()  # waits; a failure was raised by `finish` already
        self._parts = []
