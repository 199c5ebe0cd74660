"""The public surface of ckpt_manager, its config validation and its error tree."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

import ckpt_manager
from ckpt_manager import (
    AsyncMode,
    CheckpointConfig,
    CheckpointError,
    CheckpointTimeoutError,
    CommitConflictError,
    StepNotFoundError,
    StorageError,
)
from ckpt_manager.errors import ObjectExistsError, ObjectNotFoundError, SaveFailedError

EXPECTED = [
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


def test_public_surface_is_pinned_and_documented() -> None:
    assert sorted(ckpt_manager.__all__) == EXPECTED
    for name in ckpt_manager.__all__:
        assert getattr(ckpt_manager, name).__doc__, name
    with pytest.raises(AttributeError):
        _ = ckpt_manager.NotAThing  # type: ignore[attr-defined]


def test_writer_side_imports_do_not_load_torch_or_structlog() -> None:
    # [Note: the writer starts without structlog] in ckpt_manager/_save/writer.py.
    code = (
        "import sys, ckpt_manager._save.writer; "
        "print(sorted(m for m in ('torch', 'structlog', 'rich') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_error_tree_subclasses_builtins() -> None:
    assert issubclass(StepNotFoundError, CheckpointError)
    assert issubclass(StepNotFoundError, FileNotFoundError)
    assert issubclass(StorageError, OSError)
    assert issubclass(ObjectExistsError, FileExistsError)
    assert issubclass(ObjectNotFoundError, FileNotFoundError)
    assert issubclass(CheckpointTimeoutError, TimeoutError)
    err = SaveFailedError(3, {1: "disk full", 0: "peer failed"})
    assert str(err) == "checkpoint save of step 3 failed: rank 0: peer failed; rank 1: disk full"
    conflict = CommitConflictError(7, "other-run")
    assert "step 7 was already committed by run 'other-run'" in str(conflict)
    again = pickle.loads(pickle.dumps(conflict))  # crosses ranks in a broadcast
    assert (type(again), str(again), again.other_run_id) == (
        type(conflict),
        str(conflict),
        "other-run",
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"async_mode": "threads"}, "use one of: persistent, temporal, sync"),
        ({"max_inflight": 0}, "use 1 or more"),
        ({"finalize_timeout_s": 0}, "positive number of seconds"),
        ({"upload_chunk_bytes": 1024}, "at least 5 MiB"),
        ({"upload_concurrency": 0}, "use 1 or more"),
        ({"retention": 3}, "RetentionPolicy"),
    ],
)
def test_config_validation_says_how_to_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**kwargs)  # type: ignore[arg-type]


def test_config_accepts_mode_strings() -> None:
    assert CheckpointConfig(async_mode="sync").async_mode is AsyncMode.SYNC  # type: ignore[arg-type]


def test_committed_checkpoints_is_torch_free(tmp_path: object) -> None:
    code = (
        "import sys, ckpt_manager as c; "
        f"print(c.committed_checkpoints({str(tmp_path)!r}), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "False"], out.stderr
