"""`ckptctl list`: one row per step from the root catalog, plus the root's lease holder.

[Note: list reads the catalog, not every manifest] The rows come from the root catalog
reconciled with one listing of the step folders (`_store/listing.py`, [Note: listing with
the catalog]): a constant number of requests however many steps the root holds (10k steps on
S3: the catalog GET, ~10 LIST pages, the pins LIST, a few HEADs). Manifests are read only for
steps the catalog lacks (then the catalog is repaired) and for the newest steps whose
manifest size differs from the catalog's record. `--verify` reads every manifest and every
file (in parallel on object stores) and reports what they say. A folder without a manifest
is an uncommitted step (shown with `--all`); a manifest that fails validation is `corrupt`. A
step a run's restore moved aside under `_quarantine/` (`_store/quarantine.py`) is a
`quarantined` row with the reason (never a committed step, never `latest`, never kept by
retention); its step number may also have a committed row, the step saved again.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from typing import Any

from ckpt_manager._format.layout import step_dir
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._retention.base import StepInfo
from ckpt_manager._retention.record import read_retention
from ckpt_manager._store.lease import holder_is_provably_dead, read_lease
from ckpt_manager._store.listing import list_steps
from ckpt_manager._store.pins import pinned_steps
from ckpt_manager._store.quarantine import QUARANTINE_DIR, list_quarantined, read_record
from ckpt_manager._store.root_catalog import (
    CatalogEntry,
    QuarantineEntry,
    entry_from_manifest,
    manifest_strategy,
)
from ckpt_manager._store.steps import list_step_dirs, read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.common import metrics_text, parallel_map
from ckpt_manager.ctl.render import format_age, format_bytes, format_local_time, iso_local, table
from ckpt_manager.ctl.retention import RetentionFlags, retained_by
from ckpt_manager.errors import CheckpointError, StepNotFoundError

__all__ = ["JSON_KEYS", "StepRow", "StepState", "collect_rows", "lease_header", "render_rows"]


class StepState(enum.StrEnum):
    """What a step folder is."""

    COMMITTED = "committed"
    """Manifest present and valid (and, with `--verify`, files intact)."""
    UNCOMMITTED = "uncommitted"
    """No manifest: an interrupted or in-flight save."""
    CORRUPT = "corrupt"
    """Manifest invalid, or (with `--verify`) a file missing, short or with a bad checksum."""
    QUARANTINED = "quarantined"
    """Moved aside under `_quarantine/` by a run's restore because it failed verification."""


JSON_KEYS = (
    "step",
    "state",
    "committed_at",
    "committed_unix_s",
    "age_s",
    "bytes",
    "num_files",
    "world_size",
    "strategy",
    "run_id",
    "metrics",
    "pinned",
    "retained_by",
    "error",
    "location",
    "quarantined_unix_s",
)
"""Keys of every `list --json` object, in order (documented in the README, section ckptctl)."""


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One step as `list` reports it."""

    step: int
    """Training step."""
    state: StepState
    """Committed, uncommitted or corrupt."""
    entry: CatalogEntry | None
    """What the catalog (or the step's manifest, when read) records; None unless committed."""
    pinned: bool
    """Whether a pin protects it."""
    retained_by: tuple[str, ...]
    """Why retention keeps it (committed steps only)."""
    error: str | None
    """Why it is corrupt or quarantined."""
    location: str = ""
    """Its folder relative to the root: `step-<N>`, or `_quarantine/<name>` when quarantined."""
    quarantined_unix_s: float | None = None
    """When it was quarantined (None unless quarantined, or when its record is missing)."""

    def to_json(self, now: float) -> dict[str, Any]:
        """The stable JSON object (keys `JSON_KEYS`)."""
        e = self.entry
        doc = {
            "step": self.step,
            "state": self.state.value,
            "committed_at": iso_local(e.committed_unix_s) if e else None,
            "committed_unix_s": e.committed_unix_s if e else None,
            "age_s": round(now - e.committed_unix_s, 3) if e else None,
            "bytes": e.num_bytes if e else None,
            "num_files": e.num_files if e else None,
            "world_size": e.world_size if e else None,
            "strategy": e.strategy if e else None,
            "run_id": e.run_id if e else None,
            "metrics": dict(e.metrics) if e else {},
            "pinned": self.pinned,
            "retained_by": list(self.retained_by),
            "error": self.error,
            "location": self.location or step_dir(self.step),
            "quarantined_unix_s": self.quarantined_unix_s,
        }
        assert tuple(doc) == JSON_KEYS
        return doc


def strategy_of(m: Manifest) -> str:
    """How the state was laid out (`root_catalog.manifest_strategy`, which the catalog records).

    `sharded-flat` (flat ranges, as the sharding engine writes), `sharded-box`, `replicated`
    (every tensor written once by rank 0) or `mixed`.
    """
    return manifest_strategy(m)


def _read(storage: Storage, step: int, verify: bool) -> Manifest | CheckpointError | None:
    try:
        m = read_manifest(storage, step)
        if verify:
            verify_files(storage, m, sorted(m.files), check_crc=True)
        return m
    except StepNotFoundError:
        return None
    except CheckpointError as err:
        return err


def _verified(storage: Storage) -> tuple[dict[int, CatalogEntry], list[int], dict[int, str]]:
    """`--verify`: every manifest read and every file checked (the catalog is not used)."""
    steps = list_step_dirs(storage)
    results = parallel_map(lambda s: _read(storage, s, True), steps, storage)
    entries: dict[int, CatalogEntry] = {}
    uncommitted: list[int] = []
    corrupt: dict[int, str] = {}
    for step, result in zip(steps, results, strict=True):
        if isinstance(result, Manifest):
            # The size is not needed here: these entries are only printed.
            entries[step] = entry_from_manifest(result, manifest_bytes=1)
        elif result is None:
            uncommitted.append(step)
        elif isinstance(result, CheckpointError):
            corrupt[step] = str(result)
        else:
            raise result
    return entries, uncommitted, corrupt


def collect_rows(
    storage: Storage,
    *,
    include_uncommitted: bool,
    verify: bool,
    flags: RetentionFlags,
) -> list[StepRow]:
    """Build the rows from the root catalog (repaired if stale), or from every manifest and
    file with `verify`.

    `retained_by` comes from the retention `flags` when any is given, else from the policy the
    run recorded in the root (none recorded: only `latest` and `pinned`).

    Raises:
        StorageError: the root (or its catalog or pins) cannot be read.
    """
    quarantined: list[QuarantineEntry]
    if verify:
        entries, uncommitted, corrupt = _verified(storage)
        pinned = pinned_steps(storage)
        quarantined = [read_record(storage, n) for n in list_quarantined(storage)]
    else:
        listing = list_steps(storage)
        entries = {e.step: e for e in listing.committed}
        uncommitted, corrupt, pinned = listing.uncommitted, listing.corrupt, listing.pinned
        quarantined = list(listing.quarantined)
    infos = [StepInfo(s, e.committed_unix_s, dict(e.metrics)) for s, e in entries.items()]
    # Flags override the policy the run recorded in the root.
    labelled = flags.labelled() if flags.given else (read_retention(storage) or [])
    reasons = retained_by(infos, pinned, labelled)
    rows = [
        StepRow(s, StepState.COMMITTED, e, s in pinned, tuple(reasons.get(s, ())), None)
        for s, e in entries.items()
    ]
    for s, why in corrupt.items():
        rows.append(StepRow(s, StepState.CORRUPT, None, s in pinned, (), why))
    for s in uncommitted if include_uncommitted else ():
        rows.append(StepRow(s, StepState.UNCOMMITTED, None, s in pinned, (), None))
    for q in quarantined:
        rows.append(
            StepRow(
                q.step,
                StepState.QUARANTINED,
                None,
                False,
                (),
                q.reason if q.object is None or q.object in q.reason else f"{q.object}: {q.reason}",
                f"{QUARANTINE_DIR}/{q.name}",
                q.quarantined_unix_s or None,
            )
        )
    # A quarantined step sorts before the step saved again under its number.
    return sorted(rows, key=lambda r: (r.step, r.state is not StepState.QUARANTINED, r.location))


def lease_header(storage: Storage, now: float) -> str | None:
    """`lease: run R on host H (pid P) since T, refresh #N Xs ago`, or None when free.

    The age is by this host's clock (a hint for people: the holder's clock may differ; no
    decision is taken from it). A holder whose process is provably gone is marked.
    """
    doc = read_lease(storage)
    if doc is None:
        return None
    since = float(doc.get("acquired_unix_s") or 0.0)
    refreshed = float(doc.get("refreshed_unix_s") or 0.0)
    gone = " (holder gone: its pid is not running)" if holder_is_provably_dead(doc) else ""
    return (
        f"lease: run {doc.get('run_id')} on host {doc.get('host')} (pid {doc.get('pid')}) "
        f"since {format_local_time(since)}, refresh #{doc.get('refresh_count', '?')} "
        f"{format_age(now - refreshed)} ago{gone}"
    )


def render_rows(rows: Sequence[StepRow], now: float | None = None) -> str:
    """The human table."""
    now = time.time() if now is None else now
    headers = [
        "STEP",
        "STATE",
        "COMMITTED",
        "AGE",
        "SIZE",
        "WORLD",
        "STRATEGY",
        "METRICS",
        "KEPT BY",
    ]
    body = []
    for r in rows:
        e = r.entry
        if e is None:
            detail = r.error or ""
            if r.state is StepState.QUARANTINED:
                detail = f"{detail} (in {r.location})"
            body.append([str(r.step), r.state.value, "-", "-", "-", "-", "-", detail, ""])
            continue
        body.append(
            [
                str(r.step),
                r.state.value,
                format_local_time(e.committed_unix_s),
                format_age(now - e.committed_unix_s),
                format_bytes(e.num_bytes),
                str(e.world_size),
                e.strategy,
                metrics_text(e.metrics),
                ",".join(r.retained_by),
            ]
        )
    return table(headers, body, right={0, 3, 4, 5})
