"""Committed steps from the root catalog, reconciled with one listing and repaired.

[Note: listing with the catalog] `list_steps` answers "which steps are committed, with what
size, world size, metrics" in a constant number of requests however many steps there are:

1. one GET of the catalog (`_store/root_catalog.py`);
2. one listing of the step folders (paginated on object stores: 10k steps are ~10 pages);
3. one listing of `_pins/` (pins are the truth for `pinned`);
4. a size check (one HEAD each) of the newest `check_newest` catalogued manifests: a manifest
   that is gone or whose size differs from what the catalog recorded is read;
5. the manifests of the folders the catalog does not know (steps committed by a writer that
   died before updating it, in-flight saves, leftovers), read in bounded batches so 10k
   manifests are never held at once;
6. one listing of `_quarantine/` when the root's listing shows one (steps a restore moved
   aside, `_store/quarantine.py`): the records of folders the catalog does not index are read.

A step counts as committed exactly as before: its manifest exists (seen at commit time by
the catalog's writer, or read here). The catalog is never trusted over a manifest that was
read: a read manifest replaces the entry, a corrupt one makes the step corrupt. Entries whose
folder is gone are dropped. When anything differed (catalog missing or damaged, steps
missing, entries stale), the catalog is rewritten from the reconciled view with one
conditional write against the version read, so a concurrent commit is never lost: on a
conflict the repair is skipped and left to the next reader.

What the size check cannot see: an older catalogued manifest deleted or damaged in place by
hand (not by retention, which updates the catalog first). `ckptctl list --verify` reads every
manifest and every file.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import structlog

from ckpt_manager._format.layout import MANIFEST_NAME, parse_step_dir, step_dir
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._store.pins import pinned_steps
from ckpt_manager._store.quarantine import (
    QUARANTINE_DIR,
    is_recorded,
    list_quarantined,
    read_record,
)
from ckpt_manager._store.root_catalog import (
    CatalogEntry,
    CatalogSnapshot,
    QuarantineEntry,
    entry_from_manifest,
    read_catalog,
    write_catalog_if,
)
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import (
    CheckpointError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    VersionMismatchError,
)

__all__ = ["DEFAULT_CHECK_NEWEST", "StepListing", "list_steps"]

DEFAULT_CHECK_NEWEST = 4
"""Newest catalogued manifests whose size `list_steps` checks (one HEAD each)."""
_READ_BATCH = 64

_log = structlog.get_logger("ckpt_manager.listing")


class StepListing(NamedTuple):
    """Every step folder under a root, classified."""

    committed: list[CatalogEntry]
    """Committed steps, ascending; `pinned` from `_pins/`."""
    uncommitted: list[int]
    """Folders without a manifest, ascending."""
    corrupt: dict[int, str]
    """Folders whose manifest could not be read or validated, and why."""
    pinned: set[int]
    """Pinned steps (committed or not)."""
    repair: str | None
    """Why the catalog was out of date (it was rewritten unless `repair_error` says why not);
    None when it was current."""
    repair_error: str | None
    """Why the rewrite failed or was skipped, else None."""
    quarantined: tuple[QuarantineEntry, ...] = ()
    """Steps moved aside under `_quarantine/` (never committed), by folder name."""


def _read_entries(
    storage: Storage, steps: list[int], pinned: set[int]
) -> Iterator[tuple[int, CatalogEntry | CheckpointError | None]]:
    """Each step's entry from its manifest (None: no manifest), `_READ_BATCH` at a time."""
    for start in range(0, len(steps), _READ_BATCH):
        batch = steps[start : start + _READ_BATCH]
        blobs = storage.read_many([f"{step_dir(s)}/{MANIFEST_NAME}" for s in batch])
        for step, blob in zip(batch, blobs, strict=True):
            if isinstance(blob, ObjectNotFoundError):
                yield step, None
            elif isinstance(blob, CheckpointError):
                yield step, blob
            else:
                try:
                    manifest = Manifest.from_json(blob, expected_step=step)
                except CorruptCheckpointError as err:
                    yield step, err
                    continue
                yield (
                    step,
                    entry_from_manifest(manifest, manifest_bytes=len(blob), pinned=step in pinned),
                )


def _changed_manifests(
    storage: Storage, entries: dict[int, CatalogEntry], newest: list[int]
) -> list[int]:
    """The steps among `newest` whose manifest is gone or not the size the catalog says."""
    changed = []
    for s in newest:
        try:
            size = storage.size(f"{step_dir(s)}/{MANIFEST_NAME}")
        except ObjectNotFoundError:
            size = -1
        if size != entries[s].manifest_bytes:
            changed.append(s)
    return changed


def list_steps(
    storage: Storage, *, check_newest: int = DEFAULT_CHECK_NEWEST, repair: bool = True
) -> StepListing:
    """Classify every step folder, from the catalog plus the manifests it lacks.

    See [Note: listing with the catalog].

    Args:
        storage: the root.
        check_newest: how many of the newest catalogued steps get their manifest's size
            checked (0: none).
        repair: rewrite an out-of-date catalog (conditionally; a failure is reported in
            `repair_error`, never raised).

    Raises:
        StorageError: the catalog, the root or `_pins/` cannot be read.
    """
    snapshot = read_catalog(storage)
    top = storage.list_names()
    folders = sorted(s for s in (parse_step_dir(n) for n in top) if s is not None)
    pinned = pinned_steps(storage)
    known = snapshot.entries
    listed = set(folders)
    catalogued = [s for s in folders if s in known]
    reasons: list[str] = []
    if snapshot.version is None:
        reasons.append("no catalog")
    elif snapshot.damage is not None:
        reasons.append(snapshot.damage)
    gone = sorted(known.keys() - listed)
    if gone:
        reasons.append(f"{len(gone)} catalogued steps have no folder")
    newest = catalogued[-check_newest:] if check_newest > 0 else []
    changed = set(_changed_manifests(storage, known, newest))
    if changed:
        reasons.append(f"{len(changed)} manifests differ from the catalog")
    to_read = [s for s in folders if s not in known or s in changed]
    entries = {s: known[s]._replace(pinned=s in pinned) for s in catalogued if s not in changed}
    stale_pins = sum(1 for s in entries if entries[s].pinned != known[s].pinned)
    if stale_pins:
        reasons.append(f"{stale_pins} pins differ from the catalog")
    uncommitted: list[int] = []
    corrupt: dict[int, str] = {}
    num_found = 0
    for step, result in _read_entries(storage, to_read, pinned):
        if result is None:
            uncommitted.append(step)
        elif isinstance(result, CheckpointError):
            corrupt[step] = str(result)
        else:
            entries[step] = result
            num_found += 1
    if num_found:
        reasons.append(f"{num_found} committed steps missing from the catalog")
    if any(s in known for s in (*uncommitted, *corrupt)):
        reasons.append("catalogued steps without a valid manifest")
    quarantined = _quarantined(storage, snapshot, reasons, QUARANTINE_DIR in top)
    why = "; ".join(reasons) if reasons else None
    repair_error = None
    if why is not None:
        indexed = {n: q for n, q in quarantined.items() if is_recorded(q)}
        repair_error = (
            _repair(storage, entries, indexed, snapshot.version, why) if repair else "not asked"
        )
    committed = [entries[s] for s in sorted(entries)]
    return StepListing(
        committed,
        sorted(uncommitted),
        corrupt,
        pinned,
        why,
        repair_error,
        tuple(quarantined[n] for n in sorted(quarantined)),
    )


def _quarantined(
    storage: Storage, snapshot: CatalogSnapshot, reasons: list[str], present: bool
) -> dict[str, QuarantineEntry]:
    """The quarantined folders, from the catalog plus the records it lacks (`reasons` gets
    why the catalog is out of date); `_quarantine/` is listed only when `present` at the
    root (the root's listing said so)."""
    names = list_quarantined(storage) if present else []
    known = snapshot.quarantined
    found = {n: known[n] if n in known else read_record(storage, n) for n in names}
    missing = sum(1 for n in names if n not in known and is_recorded(found[n]))
    if missing:
        reasons.append(f"{missing} quarantined steps missing from the catalog")
    gone = len(known.keys() - set(names))
    if gone:
        reasons.append(f"{gone} catalogued quarantined steps have no folder")
    return found


def _repair(
    storage: Storage,
    entries: dict[int, CatalogEntry],
    quarantined: dict[str, QuarantineEntry],
    version: str | None,
    why: str,
) -> str | None:
    try:
        write_catalog_if(storage, entries, expected_version=version, quarantined=quarantined)
    except VersionMismatchError:
        # A commit or a deletion changed it since we read it: ours would be older. The next
        # reader repairs whatever is still missing.
        return "the catalog changed while it was being repaired; left to the next reader"
    except CheckpointError as err:
        _log.warning("ckpt_catalog_repair_failed", reason=why, error=str(err))
        return f"could not rewrite the catalog: {err}"
    _log.info("ckpt_catalog_repaired", reason=why, num_steps=len(entries))
    return None
