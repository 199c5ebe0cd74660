"""Collective restore: every rank picks the same step, verified, then loads its part.

Candidates are the committed steps, newest first (listed by the coordinator and broadcast),
or the one step asked for. For each candidate every rank reads the manifest and verifies its
share of the files (sizes and crc32, files split round-robin over ranks), then all ranks
exchange their findings: one bad file anywhere skips the step everywhere (with a warning that
says why), so no two ranks ever restore different steps. The skipped steps that are corrupt
(a storage error that may pass is not) are then moved aside under the run's lease
(`quarantine.py`), so the run can save their step numbers again.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import structlog

from ckpt_manager._coord import Coordinator
from ckpt_manager._load.quarantine import Quarantine
from ckpt_manager._load.restore import load_state
from ckpt_manager._store.steps import committed_steps, read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager._types import RestoreProgress, RestoreResult
from ckpt_manager.errors import CheckpointError, CorruptCheckpointError, StepNotFoundError

__all__ = ["restore_agreed"]

_log = structlog.get_logger("ckpt_manager")


class _Progress:
    """Counts this rank's bytes read and reports each read to the caller's callback."""

    def __init__(self, callback: Callable[[RestoreProgress], None]) -> None:
        self._callback = callback
        self.step = -1
        self.num_bytes_read = 0

    def on_read(self, num_bytes: int) -> None:
        self.num_bytes_read += num_bytes
        self._callback(RestoreProgress(self.step, self.num_bytes_read))


def restore_agreed(
    storage: Storage,
    coord: Coordinator,
    step: int | None,
    into: Any,
    *,
    verify_checksums: bool,
    on_choose: Callable[[int], None] | None = None,
    on_progress: Callable[[RestoreProgress], None] | None = None,
    quarantine: Quarantine | None = None,
) -> RestoreResult | None:
    """Restore on every rank (collective); see `CheckpointManager.restore`.

    `on_choose(step)` runs before a candidate's files are first read, so the caller can
    protect it from retention from the moment it is chosen, not once it is loaded.
    `on_progress` receives a `RestoreProgress` after every read from storage (and while the
    coordinator moves corrupt steps aside). With `quarantine` and no explicit `step`, every
    corrupt step skipped is moved aside before this returns (`Quarantine.apply`; its outcome
    stays on the object).

    Raises:
        StepNotFoundError: the explicit step is not committed.
        CorruptCheckpointError: the explicit step fails verification.
        CheckpointError: the template does not match the checkpoint.
    """
    log = _log.bind(rank=coord.rank)
    if step is not None:
        candidates = [step]
    else:
        listed = committed_steps(storage) if coord.is_coordinator else []
        candidates = list(reversed(coord.broadcast(listed)))
    progress = _Progress(on_progress) if on_progress is not None else None
    on_read = progress.on_read if progress is not None else None
    corrupt: list[tuple[int, str]] = []
    result: RestoreResult | None = None
    for candidate in candidates:
        if on_choose is not None:
            on_choose(candidate)
        if progress is not None:
            progress.step = candidate
        manifest, reason = None, None
        try:
            manifest = read_manifest(storage, candidate)
            names = sorted(manifest.files)[coord.rank :: coord.world_size]
            verify_files(storage, manifest, names, check_crc=verify_checksums, on_read=on_read)
        except StepNotFoundError as err:
            reason = (_Kind.MISSING, str(err))
        except CorruptCheckpointError as err:
            reason = (_Kind.CORRUPT, str(err))
        except CheckpointError as err:
            reason = (_Kind.FAILED, str(err))
        except Exception as err:  # [Note: every rank reaches the exchange]
            reason = (_Kind.FAILED, f"{type(err).__name__}: {err}")
        reasons = [r for r in coord.all_gather(reason) if r]
        if reasons:
            if step is not None:
                if reasons[0][0] is _Kind.MISSING:
                    raise StepNotFoundError(reasons[0][1])
                raise CorruptCheckpointError(reasons[0][1])
            why = _worst(reasons)
            log.warning("ckpt_restore_skipped_step", ckpt_step=candidate, reason=why[1])
            if why[0] is _Kind.CORRUPT:
                corrupt.append((candidate, why[1]))
            continue
        assert manifest is not None
        state, error = None, None
        try:
            state = load_state(storage, manifest, coord.rank, into, on_read)
        except CorruptCheckpointError as err:
            error = ("corrupt", str(err))
        except CheckpointError as err:
            error = ("mismatch", str(err))
        except Exception as err:
            # [Note: every rank reaches the exchange] Whatever goes wrong on one rank (a
            # skeleton a bit flip broke, an allocation that fails), it must still join the
            # all_gather below, or every other rank waits there for the whole timeout.
            error = ("failed", f"{type(err).__name__}: {err}")
        errors = [e for e in coord.all_gather(error) if e]
        if errors:
            kind, message = errors[0]
            if kind == "mismatch":
                raise CheckpointError(message)
            if step is not None:
                raise CorruptCheckpointError(message)
            log.warning("ckpt_restore_skipped_step", ckpt_step=candidate, reason=message)
            if any(k == "corrupt" for k, _ in errors):
                corrupt.append((candidate, next(m for k, m in errors if k == "corrupt")))
            continue
        log.info("ckpt_restored", ckpt_step=candidate)
        result = RestoreResult(candidate, state)
        break
    if quarantine is not None and step is None and corrupt:
        beat = None
        if progress is not None:
            beat = lambda: progress.on_read(0)  # noqa: E731 (a heartbeat: no bytes read)
        quarantine.apply(corrupt, beat)
    return result


class _Kind(enum.Enum):
    """Why a rank could not verify a candidate, from the least to the most telling."""

    FAILED = 0
    """Something else failed (a storage error may go away): the step is skipped, kept."""
    MISSING = 1
    """Its manifest is gone (not committed any more)."""
    CORRUPT = 2
    """It fails verification: moved aside when restoring the newest step."""


def _worst(reasons: list[tuple[_Kind, str]]) -> tuple[_Kind, str]:
    """The reason a skipped step is reported by: corruption found by any rank first."""
    return max(reasons, key=lambda r: r[0].value)
