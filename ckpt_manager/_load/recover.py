"""Collective restore: every rank picks the same step, verified, then loads its part.

Candidates are the committed steps, newest first (listed by the coordinator and broadcast),
or the one step asked for. For each candidate every rank reads the manifest and verifies its
share of the files (sizes and crc32, files split round-robin over ranks), then all ranks
exchange their findings: one bad file anywhere skips the step everywhere (with a warning that
says why), so no two ranks ever restore different steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from ckpt_manager._coord import Coordinator
from ckpt_manager._load.restore import load_state
from ckpt_manager._store.steps import committed_steps, read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager._types import RestoreProgress, RestoreResult
from ckpt_manager.errors import CheckpointError, CorruptCheckpointError, StepNotFoundError

__all__ = ["restore_agreed"]

_log = structlog.get_logger("ckpt_manager")
_MISSING = "missing: "


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
) -> RestoreResult | None:
    """Restore on every rank (collective); see `CheckpointManager.restore`.

    `on_choose(step)` runs before a candidate's files are first read, so the caller can
    protect it from retention from the moment it is chosen, not once it is loaded.
    `on_progress` receives a `RestoreProgress` after every read from storage.

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
            reason = f"{_MISSING}{err}"
        except CheckpointError as err:
            reason = str(err)
        except Exception as err:  # [Note: every rank reaches the exchange]
            reason = f"{type(err).__name__}: {err}"
        reasons = [r for r in coord.all_gather(reason) if r]
        if reasons:
            if step is not None:
                if reasons[0].startswith(_MISSING):
                    raise StepNotFoundError(reasons[0].removeprefix(_MISSING))
                raise CorruptCheckpointError(reasons[0])
            log.warning("ckpt_restore_skipped_step", ckpt_step=candidate, reason=reasons[0])
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
            error = ("corrupt", f"{type(err).__name__}: {err}")
        errors = [e for e in coord.all_gather(error) if e]
        if errors:
            kind, message = errors[0]
            if kind == "mismatch":
                raise CheckpointError(message)
            if step is not None:
                raise CorruptCheckpointError(message)
            log.warning("ckpt_restore_skipped_step", ckpt_step=candidate, reason=message)
            continue
        log.info("ckpt_restored", ckpt_step=candidate)
        return RestoreResult(candidate, state)
    return None
