"""Publishes a rank phase that lasts: a checkpoint call that blocks says `checkpointing`.

[Note: a blocked checkpoint call says checkpointing]
Inside the training loop a rank's snapshot says `training`, and is written at step boundaries
(`telemetry.py`). A checkpoint call that blocks (a `save()` waiting for a slot because the
writer is stuck, a synchronous write to slow storage) would keep saying `training` for as long
as it blocks: nobody writes the snapshot meanwhile. Publishing `checkpointing` before every
checkpoint call and `training` after it would cost two file writes per step for calls that
almost always return in microseconds. So the loop only *enters* the phase (an attribute set,
`RankTelemetry.in_phase`) and arms this watch; the watch's thread publishes the snapshot if the
phase is still held `LINGER_S` later, and the loop publishes again when the call returns late.
A quick call publishes nothing.

One thread per rank process, started at the first `arm` (never in the fork server: ranks arm
it after they start), woken every `LINGER_S / 2`; `close()` ends it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["LINGER_S", "PhaseWatch"]

LINGER_S = 0.5
"""How long a phase must last before the watch publishes it."""


class PhaseWatch:
    """Calls `publish` once when an armed deadline passes; thread-safe.

    Args:
        publish: writes the rank's snapshot now (from the watch's thread).
        linger_s: how long after `arm` it publishes.
        clock: monotonic time source.
    """

    def __init__(
        self,
        publish: Callable[[], object],
        *,
        linger_s: float = LINGER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._publish = publish
        self._linger_s = linger_s
        self._clock = clock
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False
        """Whether the last armed phase was published by the watch (the caller publishes
        again when it leaves the phase)."""

    def arm(self) -> None:
        """Publish in `linger_s` unless `disarm` comes first."""
        with self._lock:
            self._deadline = self._clock() + self._linger_s
            self.fired = False
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="trainingd-phase-watch", daemon=True
                )
                self._thread.start()

    def disarm(self) -> bool:
        """Cancel the pending publish; returns whether the watch published the phase."""
        with self._lock:
            self._deadline = None
            return self.fired

    def close(self, timeout_s: float = 2.0) -> None:
        """End the thread (idempotent)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._linger_s / 2):
            with self._lock:
                due = self._deadline is not None and self._clock() >= self._deadline
                if due:
                    self._deadline = None
                    self.fired = True
            if due:
                self._publish()
