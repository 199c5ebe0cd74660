"""Writing large buffers to local files past the page cache (`O_DIRECT`).

A buffered write of a 580 MiB shard cost 0.2-2.0 CPU-seconds on the development VM (the copy
into the page cache, then writeback and reclaim charged to the writer) and ran at
0.26-1.3 GB/s; with `O_DIRECT` the same write costs 0.03 CPU-seconds and runs at 1.5-1.8 GB/s
(two concurrent writers: 2.0 GB/s vs 0.6 GB/s). A checkpoint is written once and read
rarely, so caching it would only evict the training job's own pages.

`O_DIRECT` needs the buffer address, the length and the file offset aligned to the device's
logical block size; we align to 4096 bytes, a multiple of every common block size. Staging
slabs are page-aligned mmaps, so a shard goes direct but for its last partial block. That
tail, small writes, and buffers that are read-only or not aligned take the ordinary buffered
path. A filesystem that refuses `O_DIRECT` (`EINVAL`: tmpfs before Linux 6.6, some FUSE
mounts) gets buffered writes from where the direct write stopped; any other error (`ENOSPC`,
`EIO`) propagates unchanged.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable

__all__ = ["DIRECT_ALIGN", "write_at_start"]

DIRECT_ALIGN = 4096
_DIRECT_MIN_BYTES = 4 << 20
_CHUNK = 64 << 20
_O_DIRECT: int | None = getattr(os, "O_DIRECT", None)


def write_at_start(
    fd: int, path: str, data: memoryview, staged: Iterable[int] | None = None
) -> None:
    """Write all of `data` at offset 0 of the new, empty file `path`, open for writing as `fd`.

    Args:
        fd: the file, open for writing (buffered).
        path: its path (reopened with `O_DIRECT` for the aligned bulk).
        data: the bytes.
        staged: increasing counts of leading bytes of `data` that are final, ending with
            `len(data)`, each arriving as the producer finishes them (a pipelined
            snapshot): bytes are written as soon as they are final. None: all final now.

    The caller fsyncs `fd`; that flushes the direct and the buffered parts alike.
    """
    view = data.cast("B") if (data.format, data.ndim) != ("B", 1) else data
    total = len(view)
    marks = (total,) if staged is None else staged
    dfd = _open_direct(path) if _direct_candidate(view) else None
    done = 0
    try:
        for upto in marks:
            if not done <= upto <= total:
                raise ValueError(f"staged byte count {upto} outside [{done}, {total}]")
            if dfd is not None:
                aligned = upto // DIRECT_ALIGN * DIRECT_ALIGN
                done, ok = _write_direct(dfd, view, done, aligned)
                if not ok:  # refused after all: the rest goes buffered
                    os.close(dfd)
                    dfd = None
            if dfd is None or upto == total:
                while done < upto:
                    done += os.pwrite(fd, view[done : min(done + _CHUNK, upto)], done)
    finally:
        if dfd is not None:
            os.close(dfd)
    if done != total:
        raise ValueError(f"staging stopped at {done} of {total} bytes")


def _direct_candidate(view: memoryview) -> bool:
    if _O_DIRECT is None or view.readonly or len(view) < _DIRECT_MIN_BYTES:
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return address % DIRECT_ALIGN == 0


def _open_direct(path: str) -> int | None:
    """`path` reopened with `O_DIRECT`, or None where the filesystem refuses it."""
    assert _O_DIRECT is not None
    try:
        return os.open(path, os.O_WRONLY | _O_DIRECT)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return None
        raise


def _write_direct(fd: int, view: memoryview, start: int, end: int) -> tuple[int, bool]:
    """Write `view[start:end]` (block-aligned) at `start` through the `O_DIRECT` fd.

    Returns `(bytes written up to, whether O_DIRECT may be used further)`.
    """
    done = start
    while done < end:
        try:
            n = os.pwrite(fd, view[done : min(done + _CHUNK, end)], done)
        except OSError as err:
            if err.errno == errno.EINVAL:
                return done, False
            raise
        done += n
        if n % DIRECT_ALIGN:  # a short, unaligned write: the rest must go buffered
            return done, False
    return done, True
