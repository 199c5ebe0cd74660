"""Errors raised by `ckpt_manager`.

Backend errors (OSError, botocore/aiobotocore) are translated where storage is touched
(`_store/storage.py`) and chained with `raise ... from err`, so callers catch one tree::

    CheckpointError (Exception)
    ├── StorageError (+ OSError)                 a storage call failed
    │   ├── ObjectExistsError (+ FileExistsError)    exclusive create found the object
    │   ├── ObjectNotFoundError (+ FileNotFoundError) the object does not exist
    │   └── VersionMismatchError                     a conditional write found another version
    ├── StepNotFoundError (+ FileNotFoundError)  no committed checkpoint for that step
    ├── CorruptCheckpointError                   manifest or shard files fail validation
    ├── LeaseHeldError                           another live run holds the checkpoint root
    ├── LeaseLostError                           this run's lease was taken over: it is fenced
    ├── SaveFailedError                          a save failed on some rank (names rank + cause)
    ├── CommitConflictError                      the step's manifest was committed by another
    │                                            attempt (a `SaveFailedError`'s `__cause__`)
    └── CheckpointTimeoutError (+ TimeoutError)  a bounded wait ran out

The CLI's own error (`UsageError`, a wrong command line) lives with the CLI, in
`ckpt_manager/ctl/errors.py`: the engine never raises it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointTimeoutError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "LeaseHeldError",
    "LeaseLostError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "SaveFailedError",
    "StaleMemoryRestoreError",
    "StepNotFoundError",
    "StorageError",
    "VersionMismatchError",
]


class CheckpointError(Exception):
    """Base class of every error raised by the checkpoint manager."""


class StorageError(CheckpointError, OSError):
    """A storage operation failed (local disk, S3 or another fsspec backend)."""


class ObjectExistsError(StorageError, FileExistsError):
    """An exclusive create found the object already present (the manifest was committed)."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist."""


class VersionMismatchError(StorageError):
    """A conditional write (`Storage.write_if`) found the object at another version (or found
    it present / absent when the caller expected the opposite): another writer got there first."""


class StepNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists for the requested step."""


class CorruptCheckpointError(CheckpointError):
    """A committed step fails validation: bad manifest, missing, short or corrupt files."""


class LeaseHeldError(CheckpointError):
    """Another live run holds the lease on the checkpoint root; the message names the holder."""


class LeaseLostError(CheckpointError):
    """This run's lease on the root was taken over (or removed): the manager is fenced.

    A fenced manager never writes another manifest; the message names the new holder.
    """


class SaveFailedError(CheckpointError):
    """A save failed on at least one rank; raised on every rank with each rank's cause."""

    def __init__(self, step: int, causes: dict[int, str]) -> None:
        self.step = step
        """The step whose save failed."""
        self.causes = dict(causes)
        """Failure cause per failing rank."""
        detail = "; ".join(f"rank {r}: {c}" for r, c in sorted(self.causes.items()))
        super().__init__(f"checkpoint save of step {step} failed: {detail}")

    def __reduce__(self) -> tuple[type[SaveFailedError], tuple[int, dict[int, str]]]:
        return (type(self), (self.step, self.causes))


class MemorySnapshotError(CheckpointError):
    """A memory-only snapshot of this rank failed (e.g. its tmpfs is full).

    Raised on the training thread at the manager's next call. The newest complete snapshot is
    intact and the tier goes on with the next save, so a caller may log it and train on: a
    step this rank lacks is simply never agreed on for a memory restore.
    """


class StaleMemoryRestoreError(CheckpointError):
    """The step restored from memory is older than a step the root holds committed.

    A memory restore reads nothing from storage, so it knows only the commits the ranks'
    memory tiers recorded ([Note: the root opens after a memory restore] in `_root.py`); after
    an elastic change that every rank that saw a newer commit left, it can restore a step
    older than that commit. Found once the root opens (soon after the restore), before any
    durable save: the ranks' memory snapshots of this timeline are dropped and the commit
    recorded as the tier's floor, so a restart restores that commit from the durable tier.
    """

    def __init__(self, restored: int, committed: int) -> None:
        self.restored = restored
        """The step restored from memory."""
        self.committed = committed
        """The newest committed step under the root."""
        super().__init__(
            f"the memory restore went back to step {restored}, but step {committed} is "
            "committed under the root (an elastic change the memory tiers did not see): "
            "its memory snapshots are dropped; restart to restore step "
            f"{committed} from the durable tier"
        )

    def __reduce__(self) -> tuple[type[StaleMemoryRestoreError], tuple[int, int]]:
        return (type(self), (self.restored, self.committed))


class CommitConflictError(CheckpointError):
    """The step's manifest already exists with other content: another attempt committed it.

    Found when the exclusive manifest write meets an existing manifest that is not the one
    this attempt wrote (e.g. a second launch of the same job on the same root). The step's
    folder is kept as it is: it belongs to that other commit. Every rank's `save()` then
    raises `SaveFailedError` with this error as its `__cause__` and its message in the cause.
    """

    def __init__(self, step: int, other_run_id: str | None) -> None:
        self.step = step
        """The step committed by the other attempt."""
        self.other_run_id = other_run_id
        """The run id named in the existing manifest (None when it names none)."""
        by = f"run {other_run_id!r}" if other_run_id is not None else "another attempt"
        super().__init__(
            f"step {step} was already committed by {by} with a different manifest; "
            "its folder is kept as that commit left it (is a second launch of this job "
            "writing to the same root?)"
        )

    def __reduce__(self) -> tuple[type[CommitConflictError], tuple[int, str | None]]:
        return (type(self), (self.step, self.other_run_id))


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A bounded wait (writer, collective, storage) ran out of time."""
