"""Committed steps on storage: listing folders, reading manifests, checking files.

Torch-free on purpose: `ckptctl list`, `show` and `verify` and the background deleter read
manifests without paying for importing torch (see `_format/dtypes.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import structlog

from ckpt_manager._format.checksum import checksum
from ckpt_manager._format.layout import MANIFEST_NAME, parse_step_dir, step_dir
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._store.pins import is_pinned
from ckpt_manager._store.root_catalog import record_commit, remove_steps
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import (
    CheckpointError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    StepNotFoundError,
)

__all__ = [
    "CommittedCheckpoint",
    "abort_orphaned_uploads",
    "committed_checkpoints",
    "committed_steps",
    "delete_step",
    "drop_dead_attempts",
    "latest_committed_step",
    "list_step_dirs",
    "read_manifest",
    "read_manifests",
    "remove_uncommitted_step",
    "verify_files",
]

_READ_CHUNK = 64 << 20
_log = structlog.get_logger("ckpt_manager.catalog")


def list_step_dirs(storage: Storage) -> list[int]:
    """Steps that have a folder under the root (committed or not), ascending."""
    steps = (parse_step_dir(n) for n in storage.list_names())
    return sorted(s for s in steps if s is not None)


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose manifest exists, ascending (contents not verified)."""
    return [s for s in list_step_dirs(storage) if storage.exists(f"{step_dir(s)}/{MANIFEST_NAME}")]


def latest_committed_step(
    root_uri: str, storage_options: dict[str, Any] | None = None
) -> int | None:
    """Newest step under a checkpoint root whose manifest exists, or None (reads no shards).

    Args:
        root_uri: the checkpoint root (path or `s3://bucket/prefix`).
        storage_options: fsspec options for the root's filesystem (S3 endpoint, credentials).

    Raises:
        StorageError: the root cannot be listed.
    """
    steps = committed_steps(Storage(root_uri, storage_options))
    return steps[-1] if steps else None


def verify_committed_step(
    root_uri: str, step: int, storage_options: dict[str, Any] | None = None
) -> str | None:
    """Why committed `step` fails verification, or None when every file it lists is there
    with its size and checksum (as `ckptctl verify` and a restore check it; reads the step).

    Args:
        root_uri: the checkpoint root (path or `s3://bucket/prefix`).
        step: the step.
        storage_options: fsspec options for the root's filesystem (S3 endpoint, credentials).

    Raises:
        StorageError: the root cannot be read (no verdict).
    """
    storage = Storage(root_uri, storage_options)
    try:
        manifest = read_manifest(storage, step)
        verify_files(storage, manifest, sorted(manifest.files), check_crc=True)
    except StepNotFoundError:
        return f"step {step} is not committed"
    except CorruptCheckpointError as err:
        return str(err)
    return None


class CommittedCheckpoint(NamedTuple):
    """One committed step as its manifest records it (`committed_checkpoints`)."""

    step: int
    """Optimizer step."""
    size_bytes: int
    """Bytes of the step's data files (the manifest's file sizes summed)."""
    committed_unix_s: float
    """When the manifest was written."""


def committed_checkpoints(
    root_uri: str,
    storage_options: dict[str, Any] | None = None,
    *,
    limit: int = 50,
    known: Iterable[CommittedCheckpoint] = (),
) -> list[CommittedCheckpoint]:
    """The newest `limit` committed steps under a root with their sizes and commit times.

    Torch-free; reads manifests only (never shards). A manifest that cannot be read or
    validated leaves its step out.

    Args:
        root_uri: the checkpoint root (path or `s3://bucket/prefix`).
        storage_options: fsspec options for the root's filesystem (S3 endpoint, credentials).
        limit: at most this many steps, the newest ones.
        known: steps read by an earlier call. A committed manifest never changes, so their
            manifests are not read again (a poller then reads only the new steps' manifests).

    Returns:
        Ascending by step.

    Raises:
        StorageError: the root cannot be listed.
    """
    storage = Storage(root_uri, storage_options)
    steps = committed_steps(storage)[-limit:] if limit > 0 else []
    listed = set(steps)
    found = {c.step: c for c in known if c.step in listed}
    new = [s for s in steps if s not in found]
    for step, manifest in zip(new, read_manifests(storage, new), strict=True):
        if isinstance(manifest, CheckpointError):
            continue
        size = sum(f.size for f in manifest.files.values())
        found[step] = CommittedCheckpoint(step, size, manifest.committed_unix_s)
    return [found[s] for s in steps if s in found]


def drop_dead_attempts(storage: Storage) -> tuple[int, float] | None:
    """Coordinator at start, holding the lease: remove every uncommitted step folder.

    No live run writes under a leased root, so such a folder is a dead attempt, whatever its
    step: past the newest commit, removing it first guarantees a step folder is never written
    twice; below it, nothing would ever write there again, and leaving it to the deleter's
    grace period left it for an hour, or for good when the run ended sooner (a run restarted
    after kills mid-save listed uncommitted steps 5 and 220 once it had finished: issue 33).
    A writer of a dead attempt that is still winding down can bring a folder back; the
    deleter collects it ([Note: whose leftover] in `_retention/deleter.py`). For the same
    reason every incomplete multipart upload under the root is aborted: no writer of this run
    exists yet, so each one was left by a writer killed mid-upload (see [Note: orphaned
    multipart uploads] in `backends/multipart.py`).

    Returns:
        `(newest committed step, its commit time)`, or None when nothing is committed.
    """
    abort_orphaned_uploads(storage)
    steps = list_step_dirs(storage)
    committed = [s for s in steps if storage.exists(f"{step_dir(s)}/{MANIFEST_NAME}")]
    latest = committed[-1] if committed else None
    for s in steps:
        if s not in committed:
            _log.warning("ckpt_removing_stale_attempt", ckpt_step=s)
            remove_uncommitted_step(storage, s)
    if latest is None:
        return None
    try:
        return (latest, read_manifest(storage, latest).committed_unix_s)
    except CheckpointError:
        return (latest, 0.0)


def abort_orphaned_uploads(storage: Storage, folder: str = "", older_than_s: float = 0.0) -> int:
    """`Storage.abort_uploads`, best effort: a failure is logged, never raised.

    A store without the multipart listing API, or one that denies it, must not stop a start-up,
    a failed save's clean-up or a GC pass; the next sweep tries again.

    Returns:
        How many uploads were aborted (0 after a failure).
    """
    try:
        num_aborted = storage.abort_uploads(folder, older_than_s=older_than_s)
    except CheckpointError as err:
        _log.warning("ckpt_abort_uploads_failed", folder=folder or "/", error=str(err))
        return 0
    if num_aborted:
        _log.warning("ckpt_aborted_orphaned_uploads", folder=folder or "/", num_uploads=num_aborted)
    return num_aborted


def remove_uncommitted_step(storage: Storage, step: int) -> bool:
    """Remove a step folder unless it holds a manifest: the one way an attempt is removed.

    [Note: a folder with a manifest is never removed by a failure path] Every path that
    removes an *uncommitted* step folder (a failed save, start-up removal of dead attempts,
    the deleter's GC of leftovers, `ckptctl reshard` starting clean) comes through here, and
    looks for the manifest right before removing. A manifest found there was written by some
    commit (another launch of the job on this root, or this attempt's own retried write) and
    the folder is that commit's: it is kept, with a warning. Only retention deletes committed
    steps (`delete_step`, manifest first). On object stores the look and the removal are two
    requests, so a commit landing between them is not caught here; the lease is what keeps a
    second writer off the root.

    The incomplete multipart uploads under the folder are aborted first: the caller has made
    sure no writer still writes there (a writer killed mid-upload leaves its upload behind;
    see [Note: orphaned multipart uploads] in `backends/multipart.py`).

    Returns:
        True when the folder is gone (or never existed), False when it holds a manifest and
        was kept.

    Raises:
        StorageError: the look or the removal failed.
    """
    folder = step_dir(step)
    if storage.exists(f"{folder}/{MANIFEST_NAME}"):
        _log.warning(
            "ckpt_kept_folder_with_manifest",
            ckpt_step=step,
            reason="a folder that holds a manifest is committed; only retention deletes it",
        )
        return False
    abort_orphaned_uploads(storage, folder)
    storage.remove_tree(folder)
    return True


def read_manifest(storage: Storage, step: int) -> Manifest:
    """Read and validate a step's manifest.

    Raises:
        StepNotFoundError: no manifest (the step is not committed).
        CorruptCheckpointError: the manifest is invalid.
    """
    try:
        data = storage.read(f"{step_dir(step)}/{MANIFEST_NAME}")
    except ObjectNotFoundError as err:
        raise StepNotFoundError(
            f"step {step} is not committed under {storage.root_uri} (no manifest)"
        ) from err
    return Manifest.from_json(data, expected_step=step)


def read_manifests(storage: Storage, steps: list[int]) -> list[Manifest | CheckpointError]:
    """`read_manifest` for many steps, the reads issued concurrently on object stores.

    Each result is the validated manifest or the error (`StepNotFoundError`: not committed;
    `CorruptCheckpointError`; `StorageError`) in the step's place.
    """
    blobs = storage.read_many([f"{step_dir(s)}/{MANIFEST_NAME}" for s in steps])
    out: list[Manifest | CheckpointError] = []
    for step, blob in zip(steps, blobs, strict=True):
        if isinstance(blob, ObjectNotFoundError):
            out.append(
                StepNotFoundError(
                    f"step {step} is not committed under {storage.root_uri} (no manifest)"
                )
            )
        elif isinstance(blob, CheckpointError):
            out.append(blob)
        else:
            try:
                out.append(Manifest.from_json(blob, expected_step=step))
            except CorruptCheckpointError as err:
                out.append(err)
    return out


def verify_files(
    storage: Storage,
    manifest: Manifest,
    names: Iterable[str],
    *,
    check_crc: bool,
    on_read: Callable[[int], None] | None = None,
) -> None:
    """Check that files exist with the manifest's size (and checksum, by its algorithm).

    `on_read(num_bytes)` is called after each chunk read for the checksum (a restore reports
    its progress through it).

    Raises:
        CorruptCheckpointError: the first file that fails, and why.
    """
    folder = step_dir(manifest.step)
    # One buffer for every chunk of every file: reads into fresh bytes objects faulted in
    # new pages at each read ([Note: a durable restore reads into its tensors]).
    buffer = memoryview(bytearray(0))
    for name in names:
        entry = manifest.files[name]
        path = f"{folder}/{name}"
        try:
            size = storage.size(path)
        except ObjectNotFoundError as err:
            raise CorruptCheckpointError(f"step {manifest.step}: file {name} is missing") from err
        if size != entry.size:
            raise CorruptCheckpointError(
                f"step {manifest.step}: file {name} has {size} bytes, manifest says {entry.size}"
            )
        if not check_crc:
            continue
        if len(buffer) < min(size, _READ_CHUNK):
            buffer = memoryview(bytearray(min(size, _READ_CHUNK)))
        crc = 0
        for start in range(0, size, _READ_CHUNK):
            chunk = buffer[: min(size, start + _READ_CHUNK) - start]
            got = storage.read_into(path, start, chunk)
            if got != len(chunk):
                raise CorruptCheckpointError(
                    f"step {manifest.step}: file {name} ended at {start + got} bytes while "
                    f"read, manifest says {entry.size}"
                )
            crc = checksum(entry.algorithm, chunk, crc)
            if on_read is not None:
                on_read(got)
        if crc != entry.crc32:
            raise CorruptCheckpointError(
                f"step {manifest.step}: file {name} checksum {crc:#010x} != manifest "
                f"{entry.crc32:#010x} ({entry.algorithm.value}; corrupted bytes)"
            )


def delete_step(storage: Storage, step: int) -> bool:
    """Delete a step unless it is pinned: its manifest first, then its folder.

    [Note: manifest first] If the deletion stops halfway, what is left is an uncommitted
    folder (which readers ignore and the deleter's GC removes), never a committed step with
    missing files. Deleting a step that is already (partly) gone is fine, so an interrupted
    deletion is finished by calling this again.

    [Note: pins win races] `ckptctl pin` may write a pin at any moment; it reports success
    only if the step's manifest exists *after* its pin was written (`pins.pin_committed_step`).
    Here the pin is checked before the manifest is removed and again after; a pin that
    appeared in between puts the manifest back before anything else is touched. So whichever
    order the two processes interleave in, a pin that was confirmed keeps its step.

    The step leaves the root catalog before its manifest is removed (and comes back when a
    pin undoes the deletion).

    Returns:
        True if the step is gone; False if a pin kept it.

    Raises:
        StorageError: a delete (or the catalog update before it) failed.
    """
    folder = step_dir(step)
    manifest_name = f"{folder}/{MANIFEST_NAME}"
    try:
        manifest = storage.read(manifest_name)
    except ObjectNotFoundError:
        manifest = None  # a half-done deletion: the folder is uncommitted, pins do not apply
    if manifest is not None:
        if is_pinned(storage, step):
            return False
        # The catalog forgets the step before its manifest goes (and a failure here stops the
        # deletion): it never names a step whose manifest is gone ([Note: the catalog is an
        # index, the manifest the truth] in `root_catalog.py`).
        remove_steps(storage, {step})
        storage.remove(manifest_name)
        if is_pinned(storage, step):
            storage.write(manifest_name, manifest)
            _log.info("ckpt_delete_undone_for_pin", ckpt_step=step)
            _recatalog(storage, step, manifest)
            return False
    abort_orphaned_uploads(storage, folder)
    storage.remove_tree(folder)
    return True


def _recatalog(storage: Storage, step: int, manifest: bytes) -> None:
    """Put back the catalog entry of a step whose deletion a pin undid (best effort: a step
    missing from the catalog is found by the next listing)."""
    try:
        parsed = Manifest.from_json(manifest, expected_step=step)
    except CorruptCheckpointError:
        return
    record_commit(storage, parsed, manifest_bytes=len(manifest))
