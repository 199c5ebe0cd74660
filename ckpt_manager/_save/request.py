"""One save in flight on one rank: its buffers, writer, timings and local status.

State machine (local view; the global one is agreed in `maybe_finalize`)::

    STAGING --copy done--> WRITING --writer "done ok"--> OK
       |                     |--writer error / death / timeout--> FAILED
       '--copy error--> FAILED
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, NamedTuple

from ckpt_manager._coord import Status
from ckpt_manager._save.staging import Slab
from ckpt_manager._save.writer_proc import WriterProcess
from ckpt_manager._store.format import FileLayout

__all__ = ["Limits", "SaveRequest"]


class Limits(NamedTuple):
    """Time limits of the local part of a save."""

    staging_s: float
    """Snapshot copy."""
    start_s: float
    """Writer process start."""
    write_s: float
    """Writer making the file durable."""


@dataclasses.dataclass(eq=False)
class SaveRequest:
    """A save between `save()` and commit or failure."""

    request_id: int
    """Per-manager sequence number, identical on every rank."""
    step: int
    """Training step."""
    created_unix_s: float
    """Wall time of `save()`."""
    started: float
    """Monotonic time of `save()`."""
    slot: int
    """Staging slot index."""
    layout: FileLayout
    """Planned shard file."""
    file_name: str | None
    """Shard file name relative to the step folder (None: nothing to write)."""
    contribution: dict[str, Any]
    """This rank's manifest part."""
    slab: Slab | None = None
    """Staging buffer (chosen by the staging thread, which also allocates it)."""
    tensors: list[Any] = dataclasses.field(default_factory=list)
    """Tensors to copy into the slab; dropped once copied."""
    writer: WriterProcess | None = None
    """The process writing it (None in sync mode or with nothing to write)."""
    copied: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set when the snapshot copy finished or failed (the optimizer-step fence)."""
    handed_off: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set when the staging job is over: dispatched to the writer, failed or cancelled."""
    cancelled: bool = False
    """The save failed elsewhere: the staging job must not dispatch it any more."""
    dispatched: float | None = None
    """Monotonic time the writer got the request."""
    stall_s: float = 0.0
    """Training-loop time blocked on this save."""
    staging_s: float = 0.0
    """Snapshot copy time."""
    write_s: float = 0.0
    """Writer time."""
    done: bool = False
    """The file is durable (or there was none)."""
    answered: bool = False
    """The writer has answered this request (it no longer touches its buffer)."""
    abort_sent: bool = False
    """A streamed write was told that its copy failed: the writer answers instead of
    waiting for more bytes, so it need not be killed."""
    error: str | None = None
    """Local failure cause."""

    def fail(self, cause: str) -> None:
        """Record a local failure (the first cause wins)."""
        if self.error is None:
            self.error = cause

    def await_answer(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the writer's answer (taken and recorded); True if in."""
        writer = self.writer
        deadline = time.monotonic() + timeout_s
        while writer is not None and not self.answered:
            if writer.exit_code() is not None or time.monotonic() > deadline:
                break
            writer.poll(0.05)
            self._take(writer)
        return self.answered

    def local_status(self, limits: Limits) -> int:
        """Poll without blocking: OK, WRITING or FAILED (may kill a writer that timed out)."""
        if self.error is not None:
            return Status.FAILED
        if self.done:
            return Status.OK
        if not self.handed_off.is_set() or self.dispatched is None:
            if time.monotonic() - self.started > limits.staging_s + limits.start_s:
                self.fail(f"snapshot copy did not finish within {limits.staging_s:.0f} s")
                return Status.FAILED
            return Status.WRITING
        writer = self.writer
        if writer is None:
            return Status.FAILED if self.error else Status.OK
        writer.poll(0.0)
        if self._take(writer):
            return Status.FAILED if self.error else Status.OK
        code = writer.exit_code()
        if code is not None:
            writer.poll(0.0)
            if self._take(writer):
                return Status.FAILED if self.error else Status.OK
            self.fail(f"writer process {writer.pid} exited with code {code} before finishing")
            return Status.FAILED
        now = time.monotonic()
        if not writer.ready and now - writer.started_monotonic > limits.start_s:
            writer.kill()
            self.fail(f"writer process {writer.pid} did not start within {limits.start_s:.0f} s")
            return Status.FAILED
        if now - self.dispatched > limits.write_s:
            writer.kill()
            self.fail(f"writer did not finish within write_timeout_s={limits.write_s:.0f} s")
            return Status.FAILED
        return Status.WRITING

    def _take(self, writer: WriterProcess) -> bool:
        reply = writer.take_response(self.request_id)
        if reply is None:
            return False
        self.answered = True
        self.write_s = float(reply.get("write_s", 0.0))
        if reply.get("ok"):
            self.contribution["size"] = int(reply["size"])
            self.contribution["crc32"] = int(reply["crc32"])
            self.done = True
        else:
            self.fail(f"writer failed: {reply.get('error')}")
        return True

    def wait_local(self, limits: Limits) -> int:
        """Block until this rank's part is OK or FAILED (bounded by the timeouts)."""
        while True:
            status = self.local_status(limits)
            if status != Status.WRITING:
                return status
            if not self.handed_off.is_set():
                self.handed_off.wait(0.05)
            elif self.writer is not None:
                self.writer.poll(0.05)
            else:
                time.sleep(0.01)
