"""`NewFiles`: wakes the replica sender when a file is renamed into the tier's directory.

[Note: the sender wakes on a new meta] A rank's meta is renamed into place once its snapshot is
complete (`ckpt_manager/_memory/slots.py`), so an `IN_MOVED_TO` inotify event on the tier's
directory says a snapshot may be ready to stream. The sender used to look every 20 ms: half a
poll (10 ms) at the median before a replica even started, out of a lag that has to stay
under two of the default job's ~80 ms steps for a node loss to cost at most 2 steps, and 50
looks a second over the slot files. Now it sleeps until an event (or `wake()`: a new ring,
`close`) and looks then, and still every `FALLBACK_S` (an event lost to a full inotify queue, a
filesystem without inotify). Without inotify (not Linux, or no watch left:
`fs.inotify.max_user_watches`) it polls every `POLL_S` as before.

inotify is reached through libc with ctypes (no dependency); the descriptors are
non-blocking and close-on-exec, and the watch's queue is drained on every wake.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select

import structlog

__all__ = ["FALLBACK_S", "POLL_S", "NewFiles"]

log = structlog.get_logger("trainingd.replica")

POLL_S = 0.02
"""Poll interval without inotify."""
FALLBACK_S = 0.5
"""Longest sleep with inotify: a look even without an event."""

_IN_MOVED_TO = 0x00000080
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC


def _inotify_on(directory: str) -> int | None:
    """A non-blocking inotify descriptor watching renames into `directory` (None: none)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        init, add = libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError):
        return None
    add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    fd = int(init(_IN_NONBLOCK | _IN_CLOEXEC))
    if fd < 0:
        return None
    if add(fd, os.fsencode(directory), _IN_MOVED_TO) < 0:
        err = ctypes.get_errno()
        os.close(fd)
        log.info("replica_watch_unavailable", directory=directory, error=os.strerror(err))
        return None
    return fd


class NewFiles:
    """Sleeps until a file is renamed into `directory`, `wake()` is called, or a timeout.

    Args:
        directory: the directory to watch (it exists).
    """

    def __init__(self, directory: str) -> None:
        self._inotify = _inotify_on(directory)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def watching(self) -> bool:
        """Whether renames wake `wait` (else it polls every `POLL_S`)."""
        return self._inotify is not None

    def wait(self, *, files: bool = True, timeout_s: float | None = None) -> None:
        """Return on a rename into the directory (`files`), `wake()`, or after `timeout_s`
        (by default `FALLBACK_S` while watching, `POLL_S` otherwise)."""
        if timeout_s is None:
            timeout_s = FALLBACK_S if self.watching else POLL_S
        fds = [self._wake_r]
        if files and self._inotify is not None:
            fds.append(self._inotify)
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select(fds, [], [], timeout_s)
            for fd in ready:
                _drain(fd)

    def wake(self) -> None:
        """End the current (or the next) `wait` at once."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Close the descriptors (idempotent)."""
        for fd in (self._inotify, self._wake_r, self._wake_w):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._inotify, self._wake_r, self._wake_w = None, -1, -1


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, OSError):
        while os.read(fd, 65536):
            pass
