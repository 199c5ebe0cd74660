"""`ckptctl list`: one row per step from its manifest alone, plus the root's lease holder.

[Note: list reads only manifests] One listing of the root, then one GET of `manifest.json`
per step, issued concurrently in one batch on object stores (latency and per-request client
CPU, not bandwidth, dominate: 300 steps on S3 are 300 small requests; one asyncio batch costs
less CPU than a pool of threads each driving its own request). Shard files are not touched
unless `--verify` asks for it. A missing manifest is an uncommitted step (shown with
`--all`); one that fails validation is `corrupt`.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from typing import Any

from ckpt_manager._retention.policies import StepInfo
from ckpt_manager._retention.record import read_retention
from ckpt_manager._store.catalog import list_step_dirs, read_manifest, read_manifests, verify_files
from ckpt_manager._store.lease import holder_is_provably_dead, read_lease
from ckpt_manager._store.manifest import Manifest
from ckpt_manager._store.pins import pinned_steps
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
)
"""Keys of every `list --json` object, in order (documented in the README, section ckptctl)."""


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One step as `list` reports it."""

    step: int
    """Training step."""
    state: StepState
    """Committed, uncommitted or corrupt."""
    manifest: Manifest | None
    """The manifest when it parsed."""
    pinned: bool
    """Whether a pin protects it."""
    retained_by: tuple[str, ...]
    """Why retention keeps it (committed steps only)."""
    error: str | None
    """Why it is corrupt."""

    def to_json(self, now: float) -> dict[str, Any]:
        """The stable JSON object (keys `JSON_KEYS`)."""
        m = self.manifest
        doc = {
            "step": self.step,
            "state": self.state.value,
            "committed_at": iso_local(m.committed_unix_s) if m else None,
            "committed_unix_s": m.committed_unix_s if m else None,
            "age_s": round(now - m.committed_unix_s, 3) if m else None,
            "bytes": m.num_bytes if m else None,
            "num_files": len(m.files) if m else None,
            "world_size": m.world_size if m else None,
            "strategy": strategy_of(m) if m else None,
            "run_id": m.run_id if m else None,
            "metrics": dict(m.metrics) if m else {},
            "pinned": self.pinned,
            "retained_by": list(self.retained_by),
            "error": self.error,
        }
        assert tuple(doc) == JSON_KEYS
        return doc


def strategy_of(m: Manifest) -> str:
    """How the state was laid out: the `strategy` metric if the run saved one, else inferred.

    `sharded-flat` (flat ranges, as the sharding engine writes), `sharded-box`, `replicated`
    (every tensor written once by rank 0) or `mixed`.
    """
    named = m.metrics.get("strategy")
    if isinstance(named, str) and named:
        return named
    kinds = set()
    for key, rec in m.tensors.items():
        if rec["kind"] == "replicated":
            continue
        kinds.add("sharded-flat" if m.form_of(key) == "flat" else "sharded-box")
    if not kinds:
        return "replicated"
    return kinds.pop() if len(kinds) == 1 else "mixed"


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


def collect_rows(
    storage: Storage,
    *,
    include_uncommitted: bool,
    verify: bool,
    flags: RetentionFlags,
) -> list[StepRow]:
    """Read every step's manifest (in parallel on object stores) and build the rows.

    `retained_by` comes from the retention `flags` when any is given, else from the policy the
    run recorded in the root (none recorded: only `latest` and `pinned`).

    Raises:
        StorageError: the root cannot be listed.
    """
    steps = list_step_dirs(storage)
    results: list[Manifest | CheckpointError | None]
    if verify:
        results = parallel_map(lambda s: _read(storage, s, verify), steps, storage)
    else:
        results = [
            None if isinstance(r, StepNotFoundError) else r for r in read_manifests(storage, steps)
        ]
    pinned = pinned_steps(storage)
    infos = [
        StepInfo(s, r.committed_unix_s, dict(r.metrics))
        for s, r in zip(steps, results, strict=True)
        if isinstance(r, Manifest)
    ]
    # Flags override the policy the run recorded in the root.
    labelled = flags.labelled() if flags.given else (read_retention(storage) or [])
    reasons = retained_by(infos, pinned, labelled)
    rows = []
    for step, result in zip(steps, results, strict=True):
        if isinstance(result, Manifest):
            state, manifest, error = StepState.COMMITTED, result, None
        elif result is None:
            if not include_uncommitted:
                continue
            state, manifest, error = StepState.UNCOMMITTED, None, None
        else:
            if isinstance(result, Exception) and not isinstance(result, CheckpointError):
                raise result
            state, manifest, error = StepState.CORRUPT, None, str(result)
        rows.append(
            StepRow(step, state, manifest, step in pinned, tuple(reasons.get(step, ())), error)
        )
    return rows


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
        m = r.manifest
        if m is None:
            detail = r.error or ""
            body.append([str(r.step), r.state.value, "-", "-", "-", "-", "-", detail, ""])
            continue
        body.append(
            [
                str(r.step),
                r.state.value,
                format_local_time(m.committed_unix_s),
                format_age(now - m.committed_unix_s),
                format_bytes(m.num_bytes),
                str(m.world_size),
                strategy_of(m),
                metrics_text(m.metrics),
                ",".join(r.retained_by),
            ]
        )
    return table(headers, body, right={0, 3, 4, 5})
