"""The rank progress word: the step and step phase a rank is in, in shared memory.

[Note: progress goes through a shared-memory word, not the snapshot]
The daemon declares a rank hung when its progress stops (`daemon/agent/hang.py`), and must say
where it stopped: in the data loader, the forward or backward pass, the optimizer step, a
checkpoint call, or a collective (where a healthy rank waits for a hung peer). The snapshot
(`snapshot.py`) cannot say that: it is written at most every `publish_interval_s`, so the
phase a rank entered just before it blocked is rarely in it, and writing it at every phase
change would cost several file writes per step. Instead each rank maps one small file
(`ranks/local-<k>.progress`, 24 bytes) and stores `(step, phase, sequence)` into it at every
phase change: three stores into a page of memory, no system call, well under a microsecond.
The daemon's supervisor reads it every tick and keeps, on its own clock, when the word last
changed; the sequence number makes a change visible even when step and phase repeat.

A torn read (the rank writing while the daemon reads) can only look like a change, i.e. like
progress: it delays a detection by one tick, never invents a hang.
"""

from __future__ import annotations

import enum
import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

__all__ = ["ProgressPhase", "ProgressReading", "ProgressWord", "progress_path", "read_progress"]

_FORMAT = struct.Struct("<qiiQ")  # step, phase code, pad, sequence
_CODES: tuple[str, ...] = (
    "starting",
    "loading",
    "restoring",
    "data",
    "forward",
    "backward",
    "optimizer",
    "collective",
    "checkpoint",
    "finishing",
    "exited",
)


class ProgressPhase(enum.StrEnum):
    """Where in its work a rank is (finer than `RankPhase` inside the training loop)."""

    STARTING = "starting"
    """Process start, process group, job build."""
    LOADING = "loading"
    """Building the job (model, data)."""
    RESTORING = "restoring"
    """Wrapping the model and restoring a checkpoint (beats while bytes arrive)."""
    DATA = "data"
    """Taking the step's batches from the loader."""
    FORWARD = "forward"
    """The forward pass of a micro-batch."""
    BACKWARD = "backward"
    """The backward pass of a micro-batch (gradient collectives included)."""
    OPTIMIZER = "optimizer"
    """Clipping, the optimizer step, the LR schedule."""
    COLLECTIVE = "collective"
    """The per-step agreement all-reduce: a rank here waits for its peers."""
    CHECKPOINT = "checkpoint"
    """A checkpoint call (save, finalize) or the final drain."""
    FINISHING = "finishing"
    """Left the loop: final saves, sample, barrier."""
    EXITED = "exited"
    """The rank's entry point returned or raised."""

    @property
    def code(self) -> int:
        """The phase's number in the word."""
        return _CODES.index(self.value)

    @property
    def waiting(self) -> bool:
        """Whether a rank stuck here is waiting for a peer rather than the cause of a hang."""
        return self is ProgressPhase.COLLECTIVE

    @property
    def startup(self) -> bool:
        """Whether the phase is before training (covered by the start-up budget)."""
        return self in (ProgressPhase.STARTING, ProgressPhase.LOADING, ProgressPhase.RESTORING)


class ProgressReading(NamedTuple):
    """One read of a progress word."""

    step: int
    """Step the rank is in (the last completed one until the optimizer step ends)."""
    phase: ProgressPhase
    """Where in the step."""
    sequence: int
    """Number of marks so far (changes at every mark)."""


def progress_path(run_dir: Path, local_rank: int) -> Path:
    """Where local rank `local_rank` keeps its progress word inside the per-run directory."""
    return run_dir / "ranks" / f"local-{local_rank}.progress"


class ProgressWord:
    """The rank's side: a mapped word updated at every `mark`.

    Args:
        path: the word's file (`progress_path`); created (replacing an older incarnation's).
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(bytes(_FORMAT.size))
        # A fresh file, renamed in place: a reader never maps an older incarnation's word.
        os.replace(tmp, path)
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), _FORMAT.size)
        self._sequence = 0
        self._step = 0

    def mark(self, phase: ProgressPhase, step: int | None = None) -> None:
        """Record that the rank entered `phase` (at `step`; None keeps the last step)."""
        if step is not None:
            self._step = step
        self._sequence += 1
        _FORMAT.pack_into(self._map, 0, self._step, phase.code, 0, self._sequence)

    def close(self) -> None:
        """Unmap the word (the file stays for the daemon to read)."""
        self._map.close()


def read_progress(path: Path) -> ProgressReading | None:
    """Read a rank's progress word; None when it is missing, short or holds no known phase."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _FORMAT.size:
        return None
    step, code, _, sequence = _FORMAT.unpack_from(data)
    if not 0 <= code < len(_CODES) or sequence == 0:
        return None
    return ProgressReading(step, ProgressPhase(_CODES[code]), sequence)
