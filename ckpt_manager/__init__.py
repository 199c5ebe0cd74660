"""trainingd's checkpoint manager: asynchronous, coordinated, atomic checkpoints.

Saves and restores nested state dicts of tensors and plain values to local disk, S3 or any
fsspec filesystem. It never imports `sharding` or `daemon`: the daemon hands it state dicts.
Public names are imported lazily, so the writer process and `ckptctl` start without torch.

Package layout (one line per sub-package; each sub-package's docstring lists its modules):

    ckpt_manager/
      __init__.py errors.py _config.py _types.py _manager.py   public API + composition root
      _coord.py     Coordinator: a dedicated gloo group for cross-rank agreement (one for
                    start-up and restore, one for the finalizer's async polls)
      _root.py      opening the durable root (lease, retention record, dead attempts), at
                    start or, when it is unreachable with the memory tier on, in the background
      dcp.py        Reader: a torch.distributed.checkpoint StorageReader over our committed
                    steps (public module, imported explicitly: it needs torch DCP)
      retention.py  retention as configuration keys, one `keep_*` key per policy parameter
                    (public module, imported explicitly: trainingd's `[checkpoint]` keys)
      _save/        save path: request state machine, staging, writer process, finalize, commit,
                    the memory snapshots of saves
      _memory/      the memory tier: slot files on a tmpfs (the staging copy of every save is
                    a snapshot there), their metas, the restore agreement and the local load
                    (imports `_format`, `_coord`, `_config`)
      _load/        load path: restore one step, collective recover with fallback, reshard
      _format/      what the bytes mean: layout names, manifest (format 1 read only), rank
                    index, state tree, shard file, dtypes, checksums, DTensor pieces, names
                    (imports none of its siblings)
      _store/       where bytes go: the storage front over its backends (local disk, S3, any
                    fsspec filesystem), S3 options, step folders, root catalog, listing,
                    pins, lease, index I/O, the one manifest publication (imports only
                    `_format`)
      _retention/   which steps to keep: the policy registry, one module per policy, the
                    root's retention record, the deleter
      ctl/          the `ckptctl` CLI and its UsageError (the engine never imports it)

Why `_coord.py` sits at the root rather than in `_save/`: both the save path (finalize's
agreement) and the load path (recover's choice of step) agree through it, and `_load` should
not depend on `_save`. Layering is enforced by `tests/ckpt_manager/test_layering.py`.

A save's life (states named as in the code):
    per rank   `SaveState` (`_save/request.py`): STAGING -> WRITING -> OK, or FAILED
    together   `finalize.Phase` (`_save/finalize.py`): AGREE (MAX of every rank's state until
               all are OK or one FAILED) -> REPORTS (gather to the coordinator) -> COMMIT
               (the coordinator publishes the manifest through
               `_store/publish.publish_manifest`, the one commit path, which `ckptctl
               reshard` takes too; `CommitResult` COMMITTED, FAILED, CONFLICT or FENCED
               reaches every rank)
    FAILED on any rank or a commit that is not COMMITTED -> STOPPED (every rank's writer
    stopped) -> CAUSES (every rank's cause, or the coordinator's outcome, to every rank) ->
    SaveFailedError on every rank; the attempt's folder is removed unless it holds a manifest
    (never a committed step)

With the memory tier (`CheckpointConfig(memory=MemoryTierConfig(directory))`) every save's
staging buffer is a memory slot; `save(..., durable=False)` is the snapshot alone (no
`SaveState` beyond STAGING, nothing agreed). Restore order: the newest step every rank holds
complete and verified in memory, then the newest committed step that verifies ([Note: the
memory tier] in `_memory/__init__.py`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_manager._config import AsyncMode, CheckpointConfig, MemoryTierConfig
    from ckpt_manager._manager import CheckpointManager
    from ckpt_manager._retention.base import AnyOf, RetentionPolicy, StepInfo
    from ckpt_manager._retention.policies import (
        KeepBest,
        KeepEvery,
        KeepInterval,
        KeepLast,
        MetricMode,
    )
    from ckpt_manager._store.lease import check_root_lease
    from ckpt_manager._store.options import S3Options
    from ckpt_manager._store.probe import check_root_writable
    from ckpt_manager._store.steps import (
        CommittedCheckpoint,
        committed_checkpoints,
        latest_committed_step,
        verify_committed_step,
    )
    from ckpt_manager._types import (
        ManagerStats,
        RankLocal,
        RestoreProgress,
        RestoreResult,
        SaveObserver,
        SaveReport,
        SaveResult,
        ShardedTensorLike,
    )
    from ckpt_manager.errors import (
        CheckpointError,
        CheckpointTimeoutError,
        CommitConflictError,
        CorruptCheckpointError,
        LeaseHeldError,
        LeaseLostError,
        MemorySnapshotError,
        SaveFailedError,
        StaleMemoryRestoreError,
        StepNotFoundError,
        StorageError,
    )

__all__ = [
    "AnyOf",
    "AsyncMode",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointTimeoutError",
    "CommitConflictError",
    "CommittedCheckpoint",
    "CorruptCheckpointError",
    "KeepBest",
    "KeepEvery",
    "KeepInterval",
    "KeepLast",
    "LeaseHeldError",
    "LeaseLostError",
    "ManagerStats",
    "MemorySnapshotError",
    "MemoryTierConfig",
    "MetricMode",
    "RankLocal",
    "RestoreProgress",
    "RestoreResult",
    "RetentionPolicy",
    "S3Options",
    "SaveFailedError",
    "SaveObserver",
    "SaveReport",
    "SaveResult",
    "ShardedTensorLike",
    "StaleMemoryRestoreError",
    "StepInfo",
    "StepNotFoundError",
    "StorageError",
    "check_root_lease",
    "check_root_writable",
    "committed_checkpoints",
    "latest_committed_step",
    "verify_committed_step",
]

_HOME = {
    "AsyncMode": "_config",
    "CheckpointConfig": "_config",
    "MemoryTierConfig": "_config",
    "CheckpointManager": "_manager",
    "S3Options": "_store.options",
    "check_root_lease": "_store.lease",
    "check_root_writable": "_store.probe",
    "CommittedCheckpoint": "_store.steps",
    "committed_checkpoints": "_store.steps",
    "latest_committed_step": "_store.steps",
    "verify_committed_step": "_store.steps",
    **dict.fromkeys(["AnyOf", "RetentionPolicy", "StepInfo"], "_retention.base"),
    **dict.fromkeys(
        ["KeepBest", "KeepEvery", "KeepInterval", "KeepLast", "MetricMode"], "_retention.policies"
    ),
    **dict.fromkeys(
        [
            "ManagerStats",
            "RankLocal",
            "RestoreProgress",
            "RestoreResult",
            "SaveObserver",
            "SaveReport",
            "SaveResult",
            "ShardedTensorLike",
        ],
        "_types",
    ),
    **dict.fromkeys(
        [
            "CheckpointError",
            "CheckpointTimeoutError",
            "CommitConflictError",
            "CorruptCheckpointError",
            "LeaseHeldError",
            "LeaseLostError",
            "MemorySnapshotError",
            "SaveFailedError",
            "StaleMemoryRestoreError",
            "StepNotFoundError",
            "StorageError",
        ],
        "errors",
    ),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'ckpt_manager' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ckpt_manager.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
