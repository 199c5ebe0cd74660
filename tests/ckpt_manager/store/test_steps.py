"""Committed steps on storage: listing, manifests and deletion (the torch-free catalog)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, StepNotFoundError
from ckpt_manager._format.layout import MANIFEST_NAME, shard_file_name, step_dir
from ckpt_manager._store.steps import (
    committed_steps,
    delete_step,
    drop_dead_attempts,
    list_step_dirs,
    read_manifest,
)
from ckpt_manager._store.storage import Storage


def _root_with_steps(root: pathlib.Path, steps: list[int]) -> Storage:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(root), cfg, run_id="catalog") as mgr:
        for step in steps:
            mgr.save(step, {"w": torch.full((3,), float(step))}, metrics={"loss": 1.0 / step})
    return Storage(str(root))


def test_delete_step_removes_manifest_then_folder(tmp_path: pathlib.Path) -> None:
    storage = _root_with_steps(tmp_path, [1, 2, 3])
    assert read_manifest(storage, 2).metrics == {"loss": 0.5}
    delete_step(storage, 2)
    assert committed_steps(storage) == [1, 3]
    assert list_step_dirs(storage) == [1, 3]
    with pytest.raises(StepNotFoundError, match="step 2 is not committed"):
        read_manifest(storage, 2)
    delete_step(storage, 2)  # already gone: fine


def test_delete_step_finishes_a_half_done_deletion(tmp_path: pathlib.Path) -> None:
    storage = _root_with_steps(tmp_path, [1, 2])
    storage.remove(f"{step_dir(1)}/{MANIFEST_NAME}")  # stopped after the manifest went
    assert committed_steps(storage) == [2]
    assert storage.exists(f"{step_dir(1)}/{shard_file_name(0)}")
    delete_step(storage, 1)
    assert list_step_dirs(storage) == [2]


def test_dead_attempt_cleanup_keeps_a_folder_committed_after_the_listing(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = Storage(str(tmp_path))
    folder = step_dir(7)
    st.write(f"{folder}/{shard_file_name(0)}", b"shard")
    real = Storage.exists

    def commits_right_after_the_look(self: Storage, name: str) -> bool:
        found = real(self, name)
        if name == f"{folder}/{MANIFEST_NAME}" and not found:
            # Another launch commits step 7 just after this process looked.
            real_write(self, name, b'{"another": "commit"}', exclusive=True)
        return found

    real_write = Storage.write
    monkeypatch.setattr(Storage, "exists", commits_right_after_the_look)
    drop_dead_attempts(st)
    monkeypatch.undo()
    assert st.read(f"{folder}/{MANIFEST_NAME}") == b'{"another": "commit"}'
    assert st.read(f"{folder}/{shard_file_name(0)}") == b"shard"


def test_committed_checkpoints_reads_only_the_manifests_it_does_not_know(
    tmp_path: pathlib.Path,
) -> None:
    from ckpt_manager import CommittedCheckpoint, committed_checkpoints

    storage = _root_with_steps(tmp_path, [1, 2, 3])
    first = committed_checkpoints(str(tmp_path))
    assert [c.step for c in first] == [1, 2, 3]
    assert all(c.size_bytes > 0 for c in first)
    # A known step is taken as given (a committed manifest never changes): a marker value
    # comes back unread. A known step that is gone now is dropped; a new one is read.
    marker = CommittedCheckpoint(2, -1, 0.0)
    delete_step(storage, 1)
    _root_with_steps(tmp_path, [4])
    again = committed_checkpoints(str(tmp_path), known=[first[0], marker, first[2]])
    assert [c.step for c in again] == [2, 3, 4]
    assert again[0] is marker
    assert again[1] is first[2]
    assert again[2].size_bytes > 0
