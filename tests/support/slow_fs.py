"""A slow local filesystem for tests: `slowfile:///abs/path`, whose checkpoint reads take time.

`SlowLocalFileSystem` is fsspec's local filesystem under its own protocol. Reads of checkpoint
data files (under a `step-*` folder, manifests excepted) first wait while a pause file exists,
then sleep a fixed delay. A restore from it is as slow as the test wants, or stuck on storage
until the test removes the pause file: a real reader blocked in a real read, with no mock
inside the checkpoint manager.

Settings come from the environment, so rank processes started by a daemon under test get them
too (they import this module through a test job, `tests/daemon/_slow_fs_job.py`):
`SLOWFS_READ_DELAY_S` and `SLOWFS_PAUSE_FILE`. In-process tests set the class attributes.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = ["PAUSE_FILE_ENV", "PROTOCOL", "READ_DELAY_ENV", "SlowLocalFileSystem", "register"]

PROTOCOL = "slowfile"
READ_DELAY_ENV = "SLOWFS_READ_DELAY_S"
"""Seconds each checkpoint data read sleeps."""
PAUSE_FILE_ENV = "SLOWFS_PAUSE_FILE"
"""While this file exists, checkpoint data reads wait (at most `MAX_PAUSE_S`)."""
MAX_PAUSE_S = 150.0
"""A paused read fails after this long, so a test that forgets to resume cannot hang a run."""


class SlowLocalFileSystem(LocalFileSystem):
    """Local files whose checkpoint data reads sleep, and wait while a pause file exists."""

    protocol = (PROTOCOL,)
    read_delay_s: float | None = None
    """Per-read delay for in-process tests (None: `$SLOWFS_READ_DELAY_S`, else 0)."""
    pause: threading.Event | None = None
    """In-process pause: while set, data reads wait until it is cleared."""
    num_data_reads = 0
    """Checkpoint data reads so far in this process (all instances)."""
    num_data_bytes = 0
    """Bytes those reads returned."""
    num_waiting = 0
    """Reads waiting at the pause right now (in this process)."""
    _lock = threading.Lock()

    def cat_file(self, path: Any, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
        """Read bytes `[start, end)`; checkpoint data reads are slowed (see the module)."""
        slowed = _is_data_file(str(path))
        if slowed:
            self._wait_while_paused()
            delay = SlowLocalFileSystem.read_delay_s
            if delay is None:
                delay = float(os.environ.get(READ_DELAY_ENV, "0") or 0)
            if delay > 0:
                time.sleep(delay)
        data = super().cat_file(path, start=start, end=end, **kwargs)
        if slowed:
            with SlowLocalFileSystem._lock:
                SlowLocalFileSystem.num_data_reads += 1
                SlowLocalFileSystem.num_data_bytes += len(data)
        return data

    def _wait_while_paused(self) -> None:
        pause_file = os.environ.get(PAUSE_FILE_ENV, "")
        deadline = time.monotonic() + MAX_PAUSE_S

        def paused() -> bool:
            event = SlowLocalFileSystem.pause
            return (event is not None and event.is_set()) or bool(
                pause_file and os.path.exists(pause_file)
            )

        if not paused():
            return
        with SlowLocalFileSystem._lock:
            SlowLocalFileSystem.num_waiting += 1
        try:
            while paused():
                if time.monotonic() > deadline:
                    raise OSError(f"slowfile: paused for more than {MAX_PAUSE_S} s")
                time.sleep(0.02)
        finally:
            with SlowLocalFileSystem._lock:
                SlowLocalFileSystem.num_waiting -= 1


def _is_data_file(path: str) -> bool:
    parent, _, name = path.rpartition("/")
    return parent.rpartition("/")[2].startswith("step-") and name != "manifest.json"


def register() -> None:
    """Make `slowfile://` URLs open `SlowLocalFileSystem` in this process."""
    fsspec.register_implementation(PROTOCOL, SlowLocalFileSystem, clobber=True)
