"""Publishing a manifest: the one way a step becomes committed, whoever built it.

`publish_manifest` is called by the save path's coordinator (`_save/commit.commit_step`) and
by `ckptctl reshard` (`ctl/reshard.py`); nothing else writes `manifest.json`. In order:

1. the fence: the caller's lease check (`Lease.confirm`), right before the write; a holder
   that lost the root's lease writes nothing ([Note: fencing] in `_store/lease.py`);
2. the exclusive write of the manifest (local `os.link`, S3 `If-None-Match: *`): a step is
   never committed twice, and a manifest already there is read back
   ([Note: an existing manifest is read back]);
3. the root catalog's record of the step (`root_catalog.record_commit`, best effort: the step
   is committed from step 2 on).

It never raises for storage problems: the outcome is a value the coordinator broadcasts to
every rank (`CommitOutcome`) and the CLI turns into its one-line error.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import Any, NamedTuple

from ckpt_manager._format.layout import MANIFEST_NAME, step_dir
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._store.root_catalog import record_commit
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import (
    CheckpointError,
    CommitConflictError,
    LeaseLostError,
    ObjectExistsError,
)

__all__ = ["CommitOutcome", "CommitResult", "failed_outcome", "publish_manifest"]


class CommitResult(enum.Enum):
    """How a commit attempt ended."""

    COMMITTED = "committed"
    """The manifest this attempt built is the step's manifest."""
    FAILED = "failed"
    """Nothing was committed by this attempt; its folder may be removed."""
    CONFLICT = "conflict"
    """Another attempt's manifest holds the step: the folder is that commit's, kept."""
    FENCED = "fenced"
    """This holder lost the root's lease: nothing written, nothing removed (the root is not
    ours any more)."""


class CommitOutcome(NamedTuple):
    """The outcome of a commit attempt (the coordinator broadcasts it to every rank)."""

    result: CommitResult
    committed_unix_s: float = 0.0
    """Commit time written in the manifest (COMMITTED only)."""
    cause: str = ""
    """Why the step is not committed by this attempt (FAILED, CONFLICT and FENCED)."""
    conflict: CheckpointError | None = None
    """The error every rank chains its `SaveFailedError` to: `CommitConflictError`
    (CONFLICT) or `LeaseLostError` (FENCED)."""


def failed_outcome(err: Exception) -> CommitOutcome:
    """The outcome of a commit attempt that raised `err` before or while publishing."""
    if isinstance(err, LeaseLostError):
        return CommitOutcome(CommitResult.FENCED, cause=f"LeaseLostError: {err}", conflict=err)
    return CommitOutcome(CommitResult.FAILED, cause=f"{type(err).__name__}: {err}")


def publish_manifest(
    storage: Storage, manifest: Manifest, *, fence: Callable[[], None] | None = None
) -> CommitOutcome:
    """Commit `manifest`: fence, write it exclusively, record it in the root catalog.

    Args:
        storage: the checkpoint root.
        manifest: the step's manifest (format 2); its `committed_unix_s` is the commit time.
        fence: the holder's lease check (`Lease.confirm`, raising `LeaseLostError`), run
            right before the write; None for a caller that holds no lease (tests).

    Returns:
        The outcome; never raises for storage problems or a lost lease.
    """
    try:
        data = manifest.to_json()
        if fence is not None:
            fence()
        try:
            storage.write(f"{step_dir(manifest.step)}/{MANIFEST_NAME}", data, exclusive=True)
        except ObjectExistsError:
            return _resolve_existing(storage, manifest, bytes(data))
        # [Note: the manifest was just PUT] The step is committed from here on: the one
        # place a step becomes durable (what follows it, e.g. an index of the root, may fail
        # without un-committing the step).
        record_commit(storage, manifest, manifest_bytes=len(data))  # the root catalog
        return CommitOutcome(CommitResult.COMMITTED, committed_unix_s=manifest.committed_unix_s)
    except (CheckpointError, ValueError) as err:
        return failed_outcome(err)


def _resolve_existing(storage: Storage, manifest: Manifest, ours: bytes) -> CommitOutcome:
    """The exclusive write found a manifest: ours (a retried write) or another commit's.

    [Note: an existing manifest is read back] The exclusive write can find the manifest
    already there (`ObjectExistsError`: local `os.link`, or S3 answering 412 to the
    conditional PUT). Either our own write landed before (S3 retried a PUT whose reply was
    lost) or another attempt committed the step (a second launch of the job on this root).
    The existing manifest is read back and compared with the exact bytes this attempt wrote
    (not a freshly built manifest: `committed_unix_s` would differ): the same manifest is a
    commit; anything else is a CONFLICT, and the folder, being that other commit's, is kept.
    """
    step = manifest.step
    try:
        theirs = storage.read(f"{step_dir(step)}/{MANIFEST_NAME}")
    except CheckpointError as err:
        # It exists but cannot be read: we cannot tell whose it is. Not committed by us as
        # far as we know; the folder is kept anyway (it holds a manifest).
        return CommitOutcome(
            CommitResult.FAILED,
            cause=f"the manifest already exists and could not be read back: {err}",
        )
    doc = _json_or_none(theirs)
    if theirs == ours or (doc is not None and doc == _json_or_none(ours)):
        return CommitOutcome(CommitResult.COMMITTED, committed_unix_s=manifest.committed_unix_s)
    other = doc.get("run_id") if isinstance(doc, dict) else None
    conflict = CommitConflictError(step, other if isinstance(other, str) else None)
    return CommitOutcome(
        CommitResult.CONFLICT,
        cause=f"{type(conflict).__name__}: {conflict}",
        conflict=conflict,
    )


def _json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None
