"""The root catalog: one small object at the root that indexes the committed steps.

[Note: the catalog is an index, the manifest the truth] `_CATALOG.json` holds one entry per
committed step (step, commit time, bytes, files, world size, strategy, run id, metrics,
pinned, the manifest's size) so `ckptctl list` answers from a handful of requests instead
of one manifest GET per step. It is never trusted over a manifest: a step counts as
committed only because its manifest exists; the catalog only saves reading it. Readers
reconcile it with one listing of the step folders (`_store/listing.py`): a folder the
catalog does not know has its manifest read, an entry whose folder is gone is dropped, and
the newest entries' manifests are checked by size. A missing, damaged or stale catalog is
rebuilt from the manifests and rewritten.

Every update is a compare-and-swap (`Storage.read_with_version` / `write_if`): an S3
conditional PUT, a `flock` on local disk. Two writers (the coordinator committing, retention
deleting, `ckptctl pin`, a `ckptctl list` repairing) never lose each other's entries: the
loser re-reads and re-applies its change. Writers that keep the catalog current:

* the coordinator, right after the manifest PUT (`record_commit`, best effort: a commit never
  fails because of its index; a step left out is found by the next reader's listing);
* retention, before it deletes a manifest (`remove_steps`, must succeed: the deletion waits
  for the next pass otherwise, so the catalog never names a step whose manifest is gone);
* `ckptctl pin` / `unpin` (`set_pinned`, best effort: pins under `_pins/` stay the truth);
* the run's coordinator quarantining a corrupt step (`record_quarantine`, best effort: the
  record under `_quarantine/` is the truth, `_store/quarantine.py`) and `ckptctl prune
  --corrupt` removing one (`forget_quarantined`).

Document (format version 1), entries ascending by step::

    {"format": "trainingd-catalog", "format_version": 1, "updated_unix_s": float,
     "entries": [{"step": N, "committed_unix_s": float, "bytes": int, "num_files": int,
                  "world_size": int, "strategy": str, "run_id": str, "metrics": {...},
                  "pinned": bool, "manifest_bytes": int}, ...],
     "quarantined": [{"step": N, "name": str, "reason": str, "object": str | null,
                      "quarantined_unix_s": float, "run_id": str}, ...]}

`quarantined` (optional, ascending by name) indexes the steps moved aside under
`_quarantine/<name>/` because a restore found them corrupt (`_store/quarantine.py`): they are
not committed steps, so they never appear in `entries`. The key is additive within format 1:
an older reader ignores it, and a catalog rewritten by an older writer loses only the index
(the next reader finds the quarantined folders by listing `_quarantine/` and reads their
records).

Torch-free (read by `ckptctl list`).
"""

from __future__ import annotations

import errno
import json
import random
import time
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import structlog

from ckpt_manager._format.manifest import Manifest
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import (
    CheckpointError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    VersionMismatchError,
)

__all__ = [
    "CATALOG_FORMAT",
    "CATALOG_NAME",
    "CatalogEntry",
    "CatalogSnapshot",
    "QuarantineEntry",
    "entry_from_manifest",
    "forget_quarantined",
    "manifest_strategy",
    "parse_catalog",
    "read_catalog",
    "record_commit",
    "record_quarantine",
    "remove_steps",
    "serialize_catalog",
    "set_pinned",
    "update_catalog",
    "write_catalog_if",
]

CATALOG_NAME = "_CATALOG.json"
"""The catalog object, at the checkpoint root."""
CATALOG_FORMAT = "trainingd-catalog"
_FORMAT_VERSION = 1
_UPDATE_ATTEMPTS = 16
_BACKOFF_S = 0.01

_log = structlog.get_logger("ckpt_manager.root_catalog")


class CatalogEntry(NamedTuple):
    """One committed step as the catalog records it (what `ckptctl list` prints)."""

    step: int
    """Optimizer step."""
    committed_unix_s: float
    """When the manifest was written."""
    num_bytes: int
    """Bytes of the step's data files."""
    num_files: int
    """Data files of the step."""
    world_size: int
    """Ranks that saved it."""
    strategy: str
    """How the state was laid out (`manifest_strategy`)."""
    run_id: str
    """Run that saved it."""
    metrics: Mapping[str, Any]
    """User metrics saved with the step."""
    pinned: bool
    """Whether a pin protected it when the entry was last written (`_pins/` is the truth)."""
    manifest_bytes: int
    """Size of the step's `manifest.json` (readers compare it to spot a replaced manifest)."""

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (see the module docstring)."""
        return {
            "step": self.step,
            "committed_unix_s": self.committed_unix_s,
            "bytes": self.num_bytes,
            "num_files": self.num_files,
            "world_size": self.world_size,
            "strategy": self.strategy,
            "run_id": self.run_id,
            "metrics": dict(self.metrics),
            "pinned": self.pinned,
            "manifest_bytes": self.manifest_bytes,
        }


class QuarantineEntry(NamedTuple):
    """One step moved aside under `_quarantine/<name>/` because it failed verification."""

    step: int
    """The step it was."""
    name: str
    """Its folder under `_quarantine/` (`step-<N:012d>-<UTC time>-<run>`)."""
    reason: str
    """What failed, as the restore found it (`step 50: file rank-00000.bin checksum ...`)."""
    object: str | None
    """The object that failed (`rank-00000.bin`, `manifest.json`), when the reason names one."""
    quarantined_unix_s: float
    """When it was moved aside."""
    run_id: str
    """The run (lease holder) that moved it aside."""

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (see the module docstring)."""
        return {
            "step": self.step,
            "name": self.name,
            "reason": self.reason,
            "object": self.object,
            "quarantined_unix_s": self.quarantined_unix_s,
            "run_id": self.run_id,
        }

    @classmethod
    def from_json(cls, doc: Any) -> QuarantineEntry:
        """Parse and validate one entry (a catalog's or a quarantine record's).

        Raises:
            ValueError: not an object, or a field is missing or of the wrong type.
        """
        if not isinstance(doc, dict):
            raise ValueError(f"quarantine entry must be an object, got {type(doc).__name__}")
        step = _count(doc["step"], "quarantined step")
        name, obj = doc["name"], doc.get("object")
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"quarantined step {step}: bad name {name!r}")
        if obj is not None and not isinstance(obj, str):
            raise ValueError(f"quarantined step {step}: object must be a string or null")
        return cls(
            step=step,
            name=name,
            reason=str(doc["reason"]),
            object=obj,
            quarantined_unix_s=float(doc["quarantined_unix_s"]),
            run_id=str(doc["run_id"]),
        )


class CatalogSnapshot(NamedTuple):
    """The catalog as read, with the version a conditional rewrite compares against."""

    entries: dict[int, CatalogEntry]
    """Entries by step (empty when missing or damaged)."""
    version: str | None
    """Version token of the object; None when there is no catalog."""
    damage: str | None
    """Why the object could not be used (it exists but failed validation), else None."""
    quarantined: Mapping[str, QuarantineEntry] = types.MappingProxyType({})
    """Quarantined steps by folder name (empty when missing or damaged)."""


def manifest_strategy(manifest: Manifest) -> str:
    """How the state was laid out: the `strategy` metric if the run saved one, else inferred.

    `sharded-flat` (flat ranges, as the sharding engine writes), `sharded-box`, `replicated`
    (every tensor written once by rank 0) or `mixed`.
    """
    named = manifest.metrics.get("strategy")
    if isinstance(named, str) and named:
        return named
    kinds = set()
    for key, rec in manifest.tensors.items():
        if rec["kind"] == "replicated":
            continue
        kinds.add("sharded-flat" if manifest.form_of(key) == "flat" else "sharded-box")
    if not kinds:
        return "replicated"
    return kinds.pop() if len(kinds) == 1 else "mixed"


def entry_from_manifest(
    manifest: Manifest, *, manifest_bytes: int, pinned: bool = False
) -> CatalogEntry:
    """The catalog entry of a committed step, from its (validated) manifest."""
    return CatalogEntry(
        step=manifest.step,
        committed_unix_s=manifest.committed_unix_s,
        num_bytes=manifest.num_bytes,
        num_files=len(manifest.files),
        world_size=manifest.world_size,
        strategy=manifest_strategy(manifest),
        run_id=manifest.run_id,
        metrics=dict(manifest.metrics),
        pinned=pinned,
        manifest_bytes=manifest_bytes,
    )


def _count(value: Any, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _entry(doc: Any) -> CatalogEntry:
    if not isinstance(doc, dict):
        raise ValueError(f"entry must be an object, got {type(doc).__name__}")
    step = _count(doc["step"], "step")
    metrics = doc["metrics"]
    if not isinstance(metrics, dict):
        raise ValueError(f"step {step}: metrics must be an object")
    return CatalogEntry(
        step=step,
        committed_unix_s=float(doc["committed_unix_s"]),
        num_bytes=_count(doc["bytes"], f"step {step}: bytes"),
        num_files=_count(doc["num_files"], f"step {step}: num_files"),
        world_size=_count(doc["world_size"], f"step {step}: world_size", 1),
        strategy=str(doc["strategy"]),
        run_id=str(doc["run_id"]),
        metrics=metrics,
        pinned=bool(doc["pinned"]),
        manifest_bytes=_count(doc["manifest_bytes"], f"step {step}: manifest_bytes", 1),
    )


def parse_catalog(data: bytes) -> dict[int, CatalogEntry]:
    """Parse and validate a catalog document's committed entries.

    Raises:
        CorruptCheckpointError: not a catalog, a newer format, or an invalid entry.
    """
    return _parse(data)[0]


def _parse(data: bytes) -> tuple[dict[int, CatalogEntry], dict[str, QuarantineEntry]]:
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != CATALOG_FORMAT:
            raise ValueError(f"not a {CATALOG_FORMAT} document")
        version = _count(doc["format_version"], "format_version", 1)
        if version > _FORMAT_VERSION:
            raise ValueError(f"format_version {version} is newer than supported {_FORMAT_VERSION}")
        entries: dict[int, CatalogEntry] = {}
        for raw in doc["entries"]:
            entry = _entry(raw)
            if entry.step in entries:
                raise ValueError(f"step {entry.step} is listed twice")
            entries[entry.step] = entry
        quarantined: dict[str, QuarantineEntry] = {}
        for raw in doc.get("quarantined", []):
            q = QuarantineEntry.from_json(raw)
            quarantined[q.name] = q
        return entries, quarantined
    except (ValueError, TypeError, KeyError) as err:
        raise CorruptCheckpointError(f"invalid root catalog {CATALOG_NAME}: {err}") from err


def serialize_catalog(
    entries: Mapping[int, CatalogEntry], quarantined: Mapping[str, QuarantineEntry] | None = None
) -> bytes:
    """The catalog document for these entries (compact JSON, ascending by step) and
    quarantined steps (ascending by name; the key is left out when there are none)."""
    doc: dict[str, Any] = {
        "format": CATALOG_FORMAT,
        "format_version": _FORMAT_VERSION,
        "updated_unix_s": time.time(),
        "entries": [entries[s].to_json() for s in sorted(entries)],
    }
    if quarantined:
        doc["quarantined"] = [quarantined[n].to_json() for n in sorted(quarantined)]
    return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()


def read_catalog(storage: Storage) -> CatalogSnapshot:
    """Read the catalog (one GET). A damaged catalog reads as empty, with `damage` set.

    Raises:
        StorageError: the read failed (other than the object being absent).
    """
    try:
        data, version = storage.read_with_version(CATALOG_NAME)
    except ObjectNotFoundError:
        return CatalogSnapshot({}, None, None)
    try:
        entries, quarantined = _parse(data)
        return CatalogSnapshot(entries, version, None, quarantined)
    except CorruptCheckpointError as err:
        return CatalogSnapshot({}, version, str(err))


def write_catalog_if(
    storage: Storage,
    entries: Mapping[int, CatalogEntry],
    *,
    expected_version: str | None,
    quarantined: Mapping[str, QuarantineEntry] | None = None,
) -> str:
    """Replace the catalog only if it is still at `expected_version` (None: only if absent).

    Raises:
        VersionMismatchError: another writer changed it since it was read; nothing written.
        StorageError: the write failed.
    """
    return storage.write_if(
        CATALOG_NAME, serialize_catalog(entries, quarantined), expected_version=expected_version
    )


def update_catalog(
    storage: Storage,
    change: Callable[[dict[int, CatalogEntry]], bool],
    *,
    attempts: int = _UPDATE_ATTEMPTS,
) -> bool:
    """Read-modify-write the catalog as a compare-and-swap, retried on a concurrent change.

    `change` edits the entries in place and says whether it changed anything (nothing is
    written otherwise). It may run several times, each time on a fresh read. A missing or
    damaged catalog starts empty: readers find the steps it lacks by listing. Quarantined
    entries are kept as read.

    Returns:
        Whether a new catalog was written.

    Raises:
        VersionMismatchError: `attempts` writers in a row got there first.
        StorageError: a read or write failed.
    """
    return _update(storage, lambda entries, _quarantined: change(entries), attempts)


def _update(
    storage: Storage,
    change: Callable[[dict[int, CatalogEntry], dict[str, QuarantineEntry]], bool],
    attempts: int = _UPDATE_ATTEMPTS,
) -> bool:
    """`update_catalog` over both parts of the document."""
    for attempt in range(attempts):
        snapshot = read_catalog(storage)
        entries = dict(snapshot.entries)
        quarantined = dict(snapshot.quarantined)
        if not change(entries, quarantined):
            return False
        try:
            write_catalog_if(
                storage, entries, expected_version=snapshot.version, quarantined=quarantined
            )
            return True
        except VersionMismatchError:
            # Another writer won the race: back off a little (jittered so two writers do not
            # collide again in lock step) and re-apply the change to what it wrote.
            time.sleep(_BACKOFF_S * (attempt + 1) * random.random())
    raise VersionMismatchError(
        errno.EAGAIN,
        f"root catalog {storage.path(CATALOG_NAME)}: still changing after {attempts} attempts",
    )


def record_quarantine(storage: Storage, entry: QuarantineEntry) -> bool:
    """The quarantining coordinator: drop the step's committed entry, add its quarantine
    entry, in one compare-and-swap. Never raises (best effort: the record under
    `_quarantine/` is the truth, and the next reader's listing finds what is missing).

    Returns:
        Whether the catalog now says so.
    """

    def move(entries: dict[int, CatalogEntry], quarantined: dict[str, QuarantineEntry]) -> bool:
        entries.pop(entry.step, None)
        quarantined[entry.name] = entry
        return True

    try:
        _update(storage, move)
    except CheckpointError as err:
        _log.warning("ckpt_catalog_update_failed", ckpt_step=entry.step, error=str(err))
        return False
    return True


def forget_quarantined(storage: Storage, names: set[str]) -> bool:
    """Drop quarantine entries (`ckptctl prune --corrupt`, before it removes their folders).

    Returns:
        Whether the catalog changed.

    Raises:
        VersionMismatchError: the catalog kept changing under us.
        StorageError: a read or write failed.
    """

    def drop(_entries: dict[int, CatalogEntry], quarantined: dict[str, QuarantineEntry]) -> bool:
        found = names & quarantined.keys()
        for name in found:
            del quarantined[name]
        return bool(found)

    return _update(storage, drop)


def record_commit(storage: Storage, manifest: Manifest, *, manifest_bytes: int) -> bool:
    """Coordinator, right after the manifest PUT: add the step. Never raises.

    Best effort on purpose ([Note: the catalog is an index, the manifest the truth]): the step
    is committed whatever happens here, and a step missing from the catalog is found by the
    next reader's listing and its manifest read.

    Returns:
        Whether the catalog now holds the step.
    """
    entry = entry_from_manifest(manifest, manifest_bytes=manifest_bytes)

    def add(entries: dict[int, CatalogEntry]) -> bool:
        old = entries.get(entry.step)
        entries[entry.step] = entry._replace(pinned=old.pinned) if old is not None else entry
        return entries[entry.step] != old

    try:
        update_catalog(storage, add)
    except CheckpointError as err:
        _log.warning(
            "ckpt_catalog_update_failed",
            ckpt_step=manifest.step,
            error=str(err),
            effect="ckptctl list reads this step's manifest until the catalog is repaired",
        )
        return False
    return True


def remove_steps(storage: Storage, steps: set[int]) -> bool:
    """Drop steps from the catalog (retention, before deleting their manifests).

    Returns:
        Whether the catalog changed.

    Raises:
        VersionMismatchError: the catalog kept changing under us.
        StorageError: a read or write failed.
    """

    def drop(entries: dict[int, CatalogEntry]) -> bool:
        found = steps & entries.keys()
        for s in found:
            del entries[s]
        return bool(found)

    return update_catalog(storage, drop)


def set_pinned(storage: Storage, step: int, pinned: bool) -> bool:
    """Record a pin or unpin in the step's entry (if it has one). Never raises.

    The pin objects under `_pins/` stay the truth (retention and `ckptctl list` read them);
    a failure here is logged only.

    Returns:
        Whether the catalog now records the step's pin state (True as well when it has no
        entry for the step).
    """

    def mark(entries: dict[int, CatalogEntry]) -> bool:
        old = entries.get(step)
        if old is None or old.pinned == pinned:
            return False
        entries[step] = old._replace(pinned=pinned)
        return True

    try:
        update_catalog(storage, mark)
    except CheckpointError as err:
        _log.warning("ckpt_catalog_update_failed", ckpt_step=step, error=str(err))
        return False
    return True
