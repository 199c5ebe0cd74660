"""trainingd's checkpoint manager: asynchronous, coordinated, atomic checkpoints.

Saves and restores nested state dicts of tensors and plain values to local disk, S3 or any
fsspec filesystem. It never imports `sharding` or `daemon`: the daemon hands it state dicts.
Public names are imported lazily, so the writer process and `ckptctl` start without torch.

Package layout (one line per sub-package; each sub-package's docstring lists its modules):

    ckpt_manager/
      __init__.py errors.py _config.py _types.py _manager.py   public API + composition root
      _coord.py     Coordinator: a dedicated gloo group for cross-rank agreement (one for
                    start-up and restore, one for the finalizer's async polls)
      dcp.py        Reader: a torch.distributed.checkpoint StorageReader over our committed
                    steps (public module, imported explicitly: it needs torch DCP)
      _save/        save path: request state machine, staging, writer process, finalize, commit
      _load/        load path: restore one step, collective recover with fallback, reshard
      _store/       storage layer: fsspec I/O, S3 options, manifest, shard format, catalog,
                    pins, lease (imports none of its siblings)
      _retention/   which steps to keep: policies, the root's retention record, the deleter
      ctl/          the `ckptctl` CLI and its UsageError (the engine never imports it)

Why `_coord.py` sits at the root rather than in `_save/`: both the save path (finalize's
agreement) and the load path (recover's choice of step) agree through it, and `_load` should
not depend on `_save`. Layering is enforced by `tests/ckpt_manager/test_layering.py`.

Save state machine (global, agreed in maybe_finalize):
    REQUESTED -> STAGED -> WRITTEN(all ranks) -> COMMITTED (manifest written)
                    \\-> FAILED on any rank -> SaveFailedError on every rank, folder removed
                                                (never a folder that holds a manifest)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_manager._config import AsyncMode, CheckpointConfig
    from ckpt_manager._manager import CheckpointManager
    from ckpt_manager._retention.policies import (
        AnyOf,
        KeepBest,
        KeepEvery,
        KeepInterval,
        KeepLast,
        MetricMode,
        RetentionPolicy,
        StepInfo,
    )
    from ckpt_manager._store.catalog import (
        CommittedCheckpoint,
        committed_checkpoints,
        latest_committed_step,
    )
    from ckpt_manager._store.lease import check_root_lease
    from ckpt_manager._store.options import S3Options
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
        SaveFailedError,
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
    "StepInfo",
    "StepNotFoundError",
    "StorageError",
    "check_root_lease",
    "committed_checkpoints",
    "latest_committed_step",
]

_HOME = {
    "AsyncMode": "_config",
    "CheckpointConfig": "_config",
    "CheckpointManager": "_manager",
    "S3Options": "_store.options",
    "check_root_lease": "_store.lease",
    "CommittedCheckpoint": "_store.catalog",
    "committed_checkpoints": "_store.catalog",
    "latest_committed_step": "_store.catalog",
    **dict.fromkeys(
        [
            "AnyOf",
            "KeepBest",
            "KeepEvery",
            "KeepInterval",
            "KeepLast",
            "MetricMode",
            "RetentionPolicy",
            "StepInfo",
        ],
        "_retention.policies",
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
            "SaveFailedError",
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
