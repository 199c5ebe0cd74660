"""Quarantine: a committed step that fails verification, moved aside with a record of why.

[Note: a corrupt step is moved aside, never silently deleted] A restore that skips a committed
step because it fails verification (a flipped byte, a missing or truncated index, shard or
manifest) must not leave it where it is: its manifest would keep it the newest committed step,
and a step is never written twice, so the run could never save that step number again. Nor
may the run delete it: the bytes are evidence (which object, which bytes) until an operator
decides. So the run's coordinator, holding the root's lease, moves the whole step folder to

    _quarantine/step-<N:012d>-<UTC yyyymmddThhmmssfffZ>-<run>/   the step's objects, as found
    _quarantine/<name>/QUARANTINE.json                          the record (written last)

and records it in `_CATALOG.json` (`root_catalog.record_quarantine`). Why this layout, and not
a retired manifest inside the step folder:

* The step number is free at once. Nothing named `step-<N>` is left, so the re-save of that
  step writes a fresh folder and its shard files never land on the quarantined bytes (a
  retired manifest would leave `rank-*.bin` in the folder the re-save overwrites, and an
  uncommitted folder that start-up and retention GC remove: the evidence would be lost).
* Readers need no change to skip it: only `step-<N:012d>` names are step folders
  (`layout.parse_step_dir`), so restore, retention, `ckptctl prune` and the daemon's status
  never see a quarantined step as committed, and never delete one on their own.
* The same step can be quarantined twice (re-saved, damaged again): the time (to the
  millisecond) and the run make each name unique; names sort by step, then by time.
* One atomic rename on local disk. On object stores there is no rename: every object is copied
  on the server, then the source removed (`Storage.move_tree`); a move cut short leaves the
  source (still corrupt, so the next restart quarantines it again) and a partial copy whose
  folder has no record yet (listed as quarantined, `record missing`).

The record (`QUARANTINE.json`) is `root_catalog.QuarantineEntry` as JSON: step, name, reason
(what failed, as the restore found it), object (which object, when the reason names one),
quarantined_unix_s, run_id. The catalog is its index, the record the truth
([Note: the catalog is an index, the manifest the truth] in `root_catalog.py`).

Only a lease holder moves a step aside (`quarantine_step` takes the holder's fence and runs it
first): `ckptctl list` and `verify` only report; `ckptctl prune --corrupt` removes quarantined
folders on request (`remove_quarantined`).

Torch-free (read by `ckptctl list`).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import structlog

from ckpt_manager._format.layout import MANIFEST_NAME, step_dir
from ckpt_manager._store.root_catalog import (
    QuarantineEntry,
    forget_quarantined,
    record_quarantine,
)
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CheckpointError, ObjectNotFoundError

__all__ = [
    "QUARANTINE_DIR",
    "RECORD_NAME",
    "failed_object",
    "is_recorded",
    "list_quarantined",
    "parse_quarantine_name",
    "quarantine_name",
    "quarantine_step",
    "read_record",
    "remove_quarantined",
]

QUARANTINE_DIR = "_quarantine"
"""Folder at the root that holds quarantined steps."""
RECORD_NAME = "QUARANTINE.json"
"""The record in each quarantined folder, written after its objects."""

_NAME_RE = re.compile(r"^step-(\d{12})-\d{8}T\d{9}Z(?:-[A-Za-z0-9_.]{1,16})?$")
_FILE_RE = re.compile(r"\bfile (\S+)")
_RUN_CHARS_RE = re.compile(r"[^A-Za-z0-9_.]")

_log = structlog.get_logger("ckpt_manager.quarantine")


def quarantine_name(step: int, when_unix_s: float, run_id: str) -> str:
    """Folder name of a step quarantined at `when_unix_s` by `run_id`, under `_quarantine/`."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(when_unix_s))
    millis = int(when_unix_s * 1000) % 1000
    run = _RUN_CHARS_RE.sub("", run_id)[:16]
    return f"{step_dir(step)}-{stamp}{millis:03d}Z" + (f"-{run}" if run else "")


def parse_quarantine_name(name: str) -> int | None:
    """The step a quarantine folder name holds, or None when it is not one."""
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


def failed_object(reason: str) -> str | None:
    """The object a verification failure names (`rank-00000.bin`, `manifest.json`), if any."""
    m = _FILE_RE.search(reason)
    if m is not None:
        return m.group(1)
    if "manifest" in reason:
        return MANIFEST_NAME
    return None


def quarantine_step(
    storage: Storage,
    step: int,
    reason: str,
    *,
    run_id: str,
    fence: Callable[[], None] | None,
) -> QuarantineEntry:
    """Move a committed step that failed verification aside, record why, and index it.

    See [Note: a corrupt step is moved aside, never silently deleted].

    Args:
        storage: the root.
        step: the step (its folder `step-<N>` must exist).
        reason: what failed, as the restore found it.
        run_id: the lease holder's run.
        fence: the holder's lease check (`Lease.confirm`, raising `LeaseLostError`), run
            before anything moves; None only for a caller that holds no lease (tests).

    Returns:
        The quarantine's entry (as recorded).

    Raises:
        LeaseLostError: the lease was taken over: nothing moved.
        StorageError: the move or the record failed (a move cut short is described above).
    """
    if fence is not None:
        fence()
    now = time.time()
    entry = QuarantineEntry(
        step=step,
        name=quarantine_name(step, now, run_id),
        reason=reason,
        object=failed_object(reason),
        quarantined_unix_s=now,
        run_id=run_id,
    )
    folder = f"{QUARANTINE_DIR}/{entry.name}"
    storage.move_tree(step_dir(step), folder)
    storage.write(f"{folder}/{RECORD_NAME}", json.dumps(entry.to_json(), indent=1).encode())
    record_quarantine(storage, entry)
    _log.warning(
        "ckpt_step_quarantined",
        ckpt_step=step,
        location=folder,
        reason=reason,
        object=entry.object,
    )
    return entry


def read_record(storage: Storage, name: str) -> QuarantineEntry:
    """A quarantine folder's record; a folder without a readable one (a move cut short, a
    record damaged) reads as an entry whose reason says so.

    Raises:
        StorageError: the read failed (other than the record being absent).
    """
    step = parse_quarantine_name(name)
    try:
        data = storage.read(f"{QUARANTINE_DIR}/{name}/{RECORD_NAME}")
    except ObjectNotFoundError:
        return _unrecorded(name, step, "record missing (the quarantine was cut short)")
    try:
        entry = QuarantineEntry.from_json(json.loads(data))
    except (ValueError, TypeError, KeyError) as err:
        return _unrecorded(name, step, f"record unreadable: {err}")
    return entry._replace(name=name)


def _unrecorded(name: str, step: int | None, why: str) -> QuarantineEntry:
    return QuarantineEntry(step if step is not None else -1, name, why, None, 0.0, "")


def is_recorded(entry: QuarantineEntry) -> bool:
    """Whether the entry comes from a record (not a stand-in for a folder without one): only
    those are indexed in the catalog, so a record written later is not hidden by a stale
    stand-in."""
    return bool(entry.run_id) or entry.quarantined_unix_s > 0.0


def list_quarantined(storage: Storage) -> list[str]:
    """Names of the folders under `_quarantine/`, sorted (by step, then time).

    Raises:
        StorageError: the listing failed.
    """
    return storage.list_names(QUARANTINE_DIR)


def remove_quarantined(storage: Storage, names: set[str]) -> list[tuple[str, str | None]]:
    """Delete quarantined folders (`ckptctl prune --corrupt`): catalog entries first, then
    each folder; `(name, error or None)` per name, never stopping early.

    Raises:
        StorageError: the catalog could not be updated (nothing was deleted).
    """
    forget_quarantined(storage, names)
    out: list[tuple[str, str | None]] = []
    for name in sorted(names):
        try:
            storage.remove_tree(f"{QUARANTINE_DIR}/{name}")
            out.append((name, None))
        except CheckpointError as err:
            out.append((name, str(err)))
    return out
