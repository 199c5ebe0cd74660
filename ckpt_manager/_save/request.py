"""One save in flight on one rank: its buffers, writer, timings and local state.

State machine (local view; the global one is agreed in `maybe_finalize`), held in one place,
`SaveRequest.state`, and changed only through the guarded methods below (one lock, because
the staging thread and the training thread both move it)::

    STAGING --start_writing()--> WRITING --finish_ok()--> OK
       |                            |                      |
       '------- fail() / cancel() --+----------------------'--> FAILED (terminal)

- STAGING: the staging buffer is being allocated and filled; no writer has the request.
- WRITING: a writer (process, or the inline sync write) has it. A streamed local write
  enters WRITING before the copy starts; the copy then feeds the writer as it goes.
- OK: this rank's file is durable (or it had nothing to write).
- FAILED: a local failure (`error` says why), or the save failed elsewhere (`cancel()`; the
  agreed causes are recorded with `fail()` afterwards). OK -> FAILED is allowed for that
  reason: a rank's part can succeed while the save as a whole fails.

Late news about a FAILED save (a writer answering after the cancel) changes nothing; any other
transition outside the diagram is a bug and raises `InvalidTransitionError`.

`copied` and `handed_off` are not states but thread signals: the optimizer-step fence, and
"the staging job is over" (after which it can no longer dispatch behind a canceller's back).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import structlog

from ckpt_manager._coord import Status
from ckpt_manager._format.checksum import SAVE_ALGORITHM, ChecksumAlgorithm
from ckpt_manager._format.shard_file import FileLayout
from ckpt_manager._memory.tier import SnapshotJob
from ckpt_manager._save.device_copy import DeviceFence
from ckpt_manager._save.staging import Slab
from ckpt_manager._save.writer_proc import WriterProcess

__all__ = [
    "InvalidTransitionError",
    "Limits",
    "SaveRequest",
    "SaveState",
    "write_blocking_next_save",
]


_log = structlog.get_logger("ckpt_manager")


class SaveState(enum.Enum):
    """Where one rank's part of a save is (see the module docstring)."""

    STAGING = "staging"
    WRITING = "writing"
    OK = "ok"
    FAILED = "failed"


_TRANSITIONS: dict[SaveState, frozenset[SaveState]] = {
    SaveState.STAGING: frozenset({SaveState.WRITING, SaveState.FAILED}),
    SaveState.WRITING: frozenset({SaveState.OK, SaveState.FAILED}),
    SaveState.OK: frozenset({SaveState.FAILED}),
    SaveState.FAILED: frozenset(),
}
_AS_STATUS = {
    SaveState.STAGING: Status.WRITING,
    SaveState.WRITING: Status.WRITING,
    SaveState.OK: Status.OK,
    SaveState.FAILED: Status.FAILED,
}


class InvalidTransitionError(RuntimeError):
    """A save was moved along an edge the state machine does not have (a bug, not a fault)."""


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
    """This rank's part of the commit (`report.prepare_rank`; filled in by
    `build_pending_index` when that is set)."""
    build_pending_index: Callable[[], dict[str, Any]] | None = None
    """Builds `contribution` on the staging thread, before anything is dispatched (None:
    built already). [Note: the rank's index is built off the training thread]"""
    slab: Slab | None = None
    """Staging buffer (chosen by the staging thread, which also allocates it)."""
    tensors: list[Any] = dataclasses.field(default_factory=list)
    """Tensors to copy into the slab; dropped once copied."""
    writer: WriterProcess | None = None
    """The process writing it (None in sync mode or with nothing to write)."""
    device_fence: DeviceFence | None = None
    """CUDA snapshot: the copy's events, fenced on the compute stream (None: CPU tensors)."""
    copied: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set when the snapshot copy finished or failed (the CPU optimizer-step fence)."""
    handed_off: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set when the staging job is over: dispatched to the writer, failed or cancelled."""
    dispatched: float | None = None
    """Monotonic time the request entered WRITING."""
    stall_s: float = 0.0
    """Training-loop time blocked on this save."""
    staging_s: float = 0.0
    """Snapshot copy time."""
    staging_cpu_s: float = 0.0
    """CPU time of the staging thread's job (`time.thread_time`: copy, checksum, meta)."""
    write_s: float = 0.0
    """Writer time."""
    report_body: bytes | None = None
    """The bulk of this rank's report (tensors, tree, metrics), pickled by the staging job
    before the request can reach OK ([Note: the report is encoded before the files are
    durable] in `_save/report.py`)."""
    checksum: int | None = None
    """The staged file's checksum by `checksum.SAVE_ALGORITHM`, computed by the staging copy
    (set before `handed_off`; None until then)."""
    durable: bool = True
    """Written to storage and committed; False: a memory snapshot only (`memory` is set, and
    the request never enters the finalizer's queue nor leaves STAGING unless it fails)."""
    memory: SnapshotJob | None = None
    """The memory tier's part: the slot the staging copy fills (None: a plain staging
    buffer, no snapshot)."""
    answered: bool = False
    """The writer has answered this request (it no longer touches its buffer)."""
    abort_sent: bool = False
    """A streamed write was told that its copy failed: the writer answers instead of
    waiting for more bytes, so it need not be killed."""
    _state: SaveState = SaveState.STAGING
    _error: str | None = None
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> SaveState:
        """The local state (see the module docstring)."""
        return self._state

    @property
    def error(self) -> str | None:
        """The first recorded failure cause (None while the save has not failed, and between
        `cancel()` and the agreed causes)."""
        return self._error

    def _move(self, new: SaveState) -> bool:
        """Take the edge to `new` (caller holds the lock); False if the save already failed."""
        if new in _TRANSITIONS[self._state]:
            self._state = new
            return True
        if self._state is SaveState.FAILED:
            return False  # late news about a failed save changes nothing
        raise InvalidTransitionError(
            f"save of step {self.step} (request {self.request_id}): "
            f"{self._state.value} -> {new.value} is not a transition"
        )

    def start_writing(self) -> bool:
        """STAGING -> WRITING when a writer takes the request; False if it failed meanwhile
        (cancelled elsewhere, or a local failure): then nothing may be dispatched."""
        with self._lock:
            if not self._move(SaveState.WRITING):
                return False
            self.dispatched = time.monotonic()
            return True

    def finish_ok(
        self,
        *,
        size: int | None = None,
        index: tuple[int, int] | None = None,
    ) -> bool:
        """WRITING -> OK: the file is durable (`size` and the staged checksum recorded) or
        there was none (`size` None), and so is the rank's index object (`index`: its size
        and CRC-32, recorded).

        Returns False (and records nothing) if the save had already failed.
        """
        with self._lock:
            if size is not None and self.checksum is None:
                # The staging thread sets it before handing off; a reply taken earlier (an
                # abort path) cannot vouch for the bytes. A save already failed (or
                # cancelled, its cause still to come) keeps its state and cause.
                if self._state is not SaveState.FAILED:
                    self._move(SaveState.FAILED)
                    self._error = "file written before its snapshot copy reported a checksum"
                return False
            if not self._move(SaveState.OK):
                return False
            if size is not None and self.checksum is not None:
                self.contribution["size"] = size
                self.contribution["crc32"] = self.checksum
                if SAVE_ALGORITHM is not ChecksumAlgorithm.CRC32:
                    self.contribution["checksum_algorithm"] = SAVE_ALGORITHM.value
            if index is not None:
                self.contribution["index_size"], self.contribution["index_crc32"] = index
            return True

    def fail(self, cause: str) -> None:
        """Any state -> FAILED; the first recorded cause wins."""
        with self._lock:
            if self._state is not SaveState.FAILED:
                self._move(SaveState.FAILED)
            if self._error is None:
                self._error = cause

    def cancel(self) -> None:
        """The save failed elsewhere: -> FAILED with no local cause (the agreed causes are
        recorded by `fail()` once known). The staging job will not dispatch it any more."""
        with self._lock:
            if self._state is not SaveState.FAILED:
                self._move(SaveState.FAILED)

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
        state = self._state
        if state is SaveState.OK or state is SaveState.FAILED:
            return _AS_STATUS[state]
        if state is SaveState.STAGING or not self.handed_off.is_set():
            if time.monotonic() - self.started > limits.staging_s + limits.start_s:
                self.fail(f"snapshot copy did not finish within {limits.staging_s:.0f} s")
            return _AS_STATUS[self._state]
        writer = self.writer
        if writer is None:  # the inline write ends in OK or FAILED; anything else is a crash
            self.fail("the staging job ended without handing the request to a writer")
            return _AS_STATUS[self._state]
        writer.poll(0.0)
        if self._take(writer):
            return _AS_STATUS[self._state]
        code = writer.exit_code()
        if code is not None:
            writer.poll(0.0)
            if not self._take(writer):
                self.fail(f"writer process {writer.pid} exited with code {code} before finishing")
            return _AS_STATUS[self._state]
        now = time.monotonic()
        if not writer.ready and now - writer.started_monotonic > limits.start_s:
            writer.kill()
            self.fail(f"writer process {writer.pid} did not start within {limits.start_s:.0f} s")
        elif self.dispatched is not None and now - self.dispatched > limits.write_s:
            writer.kill()
            self.fail(f"writer did not finish within write_timeout_s={limits.write_s:.0f} s")
        return _AS_STATUS[self._state]

    def _take(self, writer: WriterProcess) -> bool:
        reply = writer.take_response(self.request_id)
        if reply is None:
            return False
        self.answered = True
        self.write_s = float(reply.get("write_s", 0.0))
        if reply.get("retries"):
            _log.warning(
                "ckpt_write_retried",
                ckpt_step=self.step,
                retries=int(reply["retries"]),
                last_error=reply.get("retried_error"),
            )
        if reply.get("ok"):
            index = reply.get("index")
            self.finish_ok(
                size=int(reply["size"]),
                index=None if index is None else (int(index[0]), int(index[1])),
            )
        else:
            self.fail(f"writer failed: {reply.get('error')}")
        return True

    def wait_for_progress(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for news on this rank's part (staging done, a writer
        message); returns early when some arrives. Polled by the finalizer between rounds."""
        if self._state is SaveState.OK or self._state is SaveState.FAILED:
            time.sleep(timeout_s)  # settled here; peers are still writing
        elif not self.handed_off.is_set():
            self.handed_off.wait(timeout_s)
        elif self.writer is not None:
            self.writer.poll(timeout_s)
        else:
            time.sleep(timeout_s)


def write_blocking_next_save(
    pending: Sequence[SaveRequest], max_inflight: int, limits: Limits
) -> SaveRequest | None:
    """The save in flight whose write a durable `save()` now would wait for, or None.

    A `save()` with `max_inflight` saves in flight first finalizes the oldest ones until one
    slot is free. That wait is on storage while one of them is still staging or writing on
    this rank; one whose files are written (or that already failed here) only needs the
    agreement and its commit, moments, and is not counted. Each request is polled without
    blocking (`local_status`: a writer's answer is taken, a writer past `write_timeout_s` is
    killed and the request failed, exactly as `maybe_finalize` would), so a write that ended
    since the last poll counts as ended (`CheckpointManager.write_in_flight`).

    Args:
        pending: the saves in flight, oldest first.
        max_inflight: the manager's `max_inflight`.
        limits: the time limits the poll enforces.
    """
    must_retire = len(pending) - max_inflight + 1
    for request in list(pending)[: max(must_retire, 0)]:
        if request.local_status(limits) == Status.WRITING:
            return request
    return None
