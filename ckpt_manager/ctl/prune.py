"""`ckptctl prune` (retention applied offline, or `--corrupt`) and `ckptctl pin` / `unpin`.

Prune plans with the manager's `plan_deletions` (the newest committed step and pinned steps
are never candidates; uncommitted and corrupt steps are not touched) and deletes like the
manager's deleter: manifest first, so a step interrupted halfway reads as uncommitted,
never as corrupt. Pins are `_store/pins.py`'s objects, which the manager's deleter honours.

`prune --corrupt` is the one way quarantined and corrupt steps go (retention never counts or
deletes them: they are evidence, [Note: a corrupt step is moved aside, never silently deleted]
in `_store/quarantine.py`): every folder under `_quarantine/`, and every committed step whose
manifest or files fail verification (every step is read back, sizes and CRC-32; a step that
cannot be read now, e.g. a storage error, is left alone, and so is a pinned one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ckpt_manager._format.manifest import Manifest
from ckpt_manager._retention.base import StepInfo, plan_deletions
from ckpt_manager._retention.options import switch_flags
from ckpt_manager._store.lease import describe_holder, holder_is_provably_dead, read_lease
from ckpt_manager._store.pins import pin_committed_step, pinned_steps, unpin_step
from ckpt_manager._store.quarantine import (
    QUARANTINE_DIR,
    list_quarantined,
    read_record,
    remove_quarantined,
)
from ckpt_manager._store.root_catalog import QuarantineEntry
from ckpt_manager._store.steps import delete_step, list_step_dirs, read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.common import parallel_map
from ckpt_manager.ctl.errors import UsageError
from ckpt_manager.ctl.render import format_bytes
from ckpt_manager.ctl.retention import RetentionFlags, retained_by
from ckpt_manager.errors import (
    CheckpointError,
    CorruptCheckpointError,
    LeaseHeldError,
    StepNotFoundError,
)

__all__ = [
    "CorruptPlan",
    "PrunePlan",
    "apply_corrupt",
    "apply_prune",
    "corrupt_json",
    "pin",
    "plan_corrupt",
    "plan_prune",
    "render_corrupt",
    "unpin",
]


class PrunePlan(NamedTuple):
    """What `prune` keeps and deletes."""

    delete: list[Manifest]
    """Committed steps to delete, oldest first."""
    keep: list[tuple[int, list[str]]]
    """Committed steps kept, with why."""
    skipped: list[tuple[int, str]]
    """Steps not considered: uncommitted or corrupt, with why."""


def check_lease(storage: Storage, *, force: bool) -> None:
    """Refuse to change a root a run holds, unless `force`.

    Held: a lease that is neither released nor left by a process provably gone (same host,
    boot and PID namespace; see `_store/lease.py`). Whether a holder elsewhere still
    refreshes is not judged from its wall-clock time (hosts' clocks differ): `--force` is
    the way past a lease left by a crash elsewhere.

    Raises:
        LeaseHeldError: a held lease exists and `force` is False.
    """
    doc = read_lease(storage)
    if doc is None or force or holder_is_provably_dead(doc):
        return
    raise LeaseHeldError(
        f"{storage.root_uri} is held by live run {doc.get('run_id')} on host {doc.get('host')} "
        f"(pid {doc.get('pid')}; {describe_holder(doc)}): its own retention runs there; stop "
        "it first, or pass --force if that run is gone for good"
    )


def plan_prune(storage: Storage, flags: RetentionFlags) -> PrunePlan:
    """Read every manifest and plan the deletions.

    Raises:
        UsageError: no retention flag was given.
    """
    policy = flags.policy()
    if policy is None:
        raise UsageError(f"nothing to apply: give at least one of {', '.join(switch_flags())}")
    steps = list_step_dirs(storage)
    found = parallel_map(lambda s: read_manifest(storage, s), steps, storage)
    manifests: dict[int, Manifest] = {}
    skipped: list[tuple[int, str]] = []
    for step, result in zip(steps, found, strict=True):
        if isinstance(result, Manifest):
            manifests[step] = result
        elif isinstance(result, StepNotFoundError):
            skipped.append((step, "uncommitted"))
        elif isinstance(result, CheckpointError):
            skipped.append((step, f"corrupt: {result}"))
        else:
            raise result
    pinned = pinned_steps(storage)
    fallback = _newest_verified(storage, manifests)
    if fallback is None and manifests:
        raise CorruptCheckpointError(
            f"{storage.root_uri}: no committed step verifies (sizes and CRC-32): nothing is "
            "pruned, since every step may be needed to rescue the run; see `ckptctl verify --all`"
        )
    for step in sorted(manifests, reverse=True):
        if step == fallback:
            break
        skipped.append((step, "corrupt: fails verification (kept, untouched)"))
        del manifests[step]  # newer than every step that verifies: never deleted by prune
    infos = [StepInfo(s, m.committed_unix_s, dict(m.metrics)) for s, m in manifests.items()]
    doomed = plan_deletions(policy, infos, protected=pinned)
    reasons = retained_by(infos, pinned, flags.labelled())
    keep = [(s, reasons[s]) for s in sorted(manifests) if s not in doomed]
    return PrunePlan([manifests[s] for s in doomed], keep, skipped)


def _newest_verified(storage: Storage, manifests: dict[int, Manifest]) -> int | None:
    """The newest committed step whose files verify (sizes and CRC-32), or None.

    [Note: prune keeps the newest step that verifies] Retention always keeps the newest
    committed step; if that step is corrupt, a policy like `--keep-last 1` would delete the
    only step a restore could use. So prune reads the newest steps back, newest first, until
    one verifies; that one is the newest prune considers (steps newer than it are reported
    and left alone). Usually the newest verifies at once: the cost is reading one step.
    """
    for step in sorted(manifests, reverse=True):
        m = manifests[step]
        try:
            verify_files(storage, m, sorted(m.files), check_crc=True)
        except CheckpointError:
            continue
        return step
    return None


def apply_prune(storage: Storage, plan: PrunePlan) -> list[tuple[int, str | None]]:
    """Delete the planned steps; returns `(step, error or None)` per step (never stops early)."""
    out: list[tuple[int, str | None]] = []
    for m in plan.delete:
        try:
            deleted = delete_step(storage, m.step)
            out.append((m.step, None if deleted else "pinned while the prune ran: kept"))
        except CheckpointError as err:
            out.append((m.step, str(err)))
    return out


def render_plan(plan: PrunePlan, *, dry_run: bool) -> str:
    """Human summary of a plan."""
    verb = "would delete" if dry_run else "deleting"
    lines = [f"{verb} step {m.step} ({format_bytes(m.num_bytes)})" for m in plan.delete]
    lines += [f"keep step {s} ({', '.join(why)})" for s, why in plan.keep]
    lines += [f"skip step {s}: {why}" for s, why in plan.skipped]
    freed = sum(m.num_bytes for m in plan.delete)
    lines.append(
        f"{len(plan.delete)} to delete ({format_bytes(freed)}), {len(plan.keep)} kept, "
        f"{len(plan.skipped)} not committed or corrupt (untouched)"
    )
    return "\n".join(lines)


def pin(storage: Storage, steps: Sequence[int]) -> list[str]:
    """Pin committed steps.

    Raises:
        StepNotFoundError: a step is not committed (nothing is pinned then).
    """
    for step in steps:
        read_manifest(storage, step)
    for step in steps:
        pin_committed_step(storage, step)
    return [f"pinned step {s}" for s in steps]


def unpin(storage: Storage, steps: Sequence[int]) -> list[str]:
    """Remove pins (a step that is not pinned is reported, not an error)."""
    pinned = pinned_steps(storage)
    lines = []
    for step in steps:
        if step in pinned:
            unpin_step(storage, step)
            lines.append(f"unpinned step {step}")
        else:
            lines.append(f"step {step} was not pinned")
    return lines


class CorruptPlan(NamedTuple):
    """What `prune --corrupt` deletes."""

    quarantined: list[QuarantineEntry]
    """Folders under `_quarantine/`, by name."""
    corrupt: list[tuple[int, str]]
    """Committed steps that fail verification, and why, ascending."""
    skipped: list[tuple[int, str]]
    """Corrupt steps left alone (pinned), or steps that could not be checked, and why."""


def _verdict(storage: Storage, step: int) -> str | None:
    """Why a step folder fails verification, or None (it verifies, or is not committed)."""
    try:
        m = read_manifest(storage, step)
        verify_files(storage, m, sorted(m.files), check_crc=True)
    except StepNotFoundError:
        return None
    except CorruptCheckpointError as err:
        return str(err)
    return None


def plan_corrupt(storage: Storage) -> CorruptPlan:
    """List the quarantined folders and read every committed step back.

    Raises:
        StorageError: the root or `_quarantine/` cannot be listed.
    """
    quarantined = [read_record(storage, n) for n in list_quarantined(storage)]
    steps = list_step_dirs(storage)
    verdicts = parallel_map(lambda s: _verdict(storage, s), steps, storage)
    pinned = pinned_steps(storage)
    corrupt: list[tuple[int, str]] = []
    skipped: list[tuple[int, str]] = []
    for step, verdict in zip(steps, verdicts, strict=True):
        if isinstance(verdict, Exception):
            skipped.append((step, f"not checked (left alone): {verdict}"))
        elif verdict is not None and step in pinned:
            skipped.append((step, f"pinned (left alone; unpin to delete): {verdict}"))
        elif verdict is not None:
            corrupt.append((step, verdict))
    return CorruptPlan(quarantined, corrupt, skipped)


def apply_corrupt(storage: Storage, plan: CorruptPlan) -> list[tuple[str, str | None]]:
    """Delete what the plan names; `(what, error or None)` each (never stops early)."""
    out: list[tuple[str, str | None]] = []
    if plan.quarantined:
        try:
            removed = remove_quarantined(storage, {q.name for q in plan.quarantined})
        except CheckpointError as err:
            removed = [(q.name, str(err)) for q in plan.quarantined]
        out += [(f"{QUARANTINE_DIR}/{name}", error) for name, error in removed]
    for step, _ in plan.corrupt:
        try:
            deleted = delete_step(storage, step)
            out.append((f"step {step}", None if deleted else "pinned while the prune ran: kept"))
        except CheckpointError as err:
            out.append((f"step {step}", str(err)))
    return out


def render_corrupt(plan: CorruptPlan, *, dry_run: bool) -> str:
    """Human summary of a `--corrupt` plan."""
    verb = "would delete" if dry_run else "deleting"
    lines = [
        f"{verb} quarantined step {q.step} ({QUARANTINE_DIR}/{q.name}): {q.reason}"
        for q in plan.quarantined
    ]
    lines += [f"{verb} corrupt step {s}: {why}" for s, why in plan.corrupt]
    lines += [f"skip step {s}: {why}" for s, why in plan.skipped]
    lines.append(
        f"{len(plan.quarantined)} quarantined and {len(plan.corrupt)} corrupt to delete, "
        f"{len(plan.skipped)} left alone"
    )
    return "\n".join(lines)


def corrupt_json(
    plan: CorruptPlan, failed: Sequence[tuple[str, str | None]], *, dry_run: bool
) -> dict[str, object]:
    """`prune --corrupt --json`."""
    return {
        "dry_run": dry_run,
        "delete_quarantined": [
            {"step": q.step, "location": f"{QUARANTINE_DIR}/{q.name}", "reason": q.reason}
            for q in plan.quarantined
        ],
        "delete_corrupt": [{"step": s, "reason": why} for s, why in plan.corrupt],
        "skipped": [{"step": s, "reason": why} for s, why in plan.skipped],
        "failed": [{"what": w, "error": e} for w, e in failed if e],
    }
