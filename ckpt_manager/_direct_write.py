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

__all__ = ["DIRECT_ALIGN", "write_at_start"]

DIRECT_ALIGN = 4096
_DIRECT_MIN_BYTES = 4 << 20
_CHUNK = 64 << 20
_O_DIRECT: int | None = getattr(os, "O_DIRECT", None)


def write_at_start(fd: int, path: str, data: memoryview) -> None:
    """Write all of `data` at offset 0 of the new, empty file `path`, open for writing as `fd`.

    The caller fsyncs `fd`; that flushes the direct and the buffered parts alike.
    """
    view = data.cast("B") if (data.format, data.ndim) != ("B", 1) else data
    done = _write_direct(path, view) if _direct_candidate(view) else 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + _CHUNK], done)


def _direct_candidate(view: memoryview) -> bool:
    if _O_DIRECT is None or view.readonly or len(view) < _DIRECT_MIN_BYTES:
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return address % DIRECT_ALIGN == 0


def _write_direct(path: str, view: memoryview) -> int:
    """Write the block-aligned prefix of `view` with `O_DIRECT`; returns bytes written."""
    assert _O_DIRECT is not None
    aligned = len(view) // DIRECT_ALIGN * DIRECT_ALIGN
    try:
        fd = os.open(path, os.O_WRONLY | _O_DIRECT)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return 0
        raise
    done = 0
    try:
        while done < aligned:
            try:
                n = os.pwrite(fd, view[done : min(done + _CHUNK, aligned)], done)
            except OSError as err:
                if err.errno == errno.EINVAL:  # refused after all: finish buffered
                    return done
                raise
            done += n
            if n % DIRECT_ALIGN:  # a short, unaligned write: the rest must go buffered
                return done
    finally:
        os.close(fd)
    return done
