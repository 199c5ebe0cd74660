"""Committing a step: never written twice, stale attempts removed."""

from __future__ import annotations

import pathlib

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, StepNotFoundError
from ckpt_manager._store.manifest import shard_file_name, step_dir


def test_step_never_written_twice_and_stale_attempt_removed(tmp_path: pathlib.Path) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="a") as mgr:
        mgr.save(5, {"t": torch.ones(2)})
        with pytest.raises(ValueError, match="never written twice"):
            mgr.save(5, {"t": torch.ones(2)})
        with pytest.raises(StepNotFoundError):
            mgr.restore(6)
    # A dead attempt of step 7 (shards, no manifest) from a crashed run.
    stale = tmp_path / step_dir(7)
    stale.mkdir()
    (stale / shard_file_name(0)).write_bytes(b"half")
    with CheckpointManager(str(tmp_path), cfg, run_id="a") as mgr:
        assert not stale.exists()
        assert mgr.all_steps() == [5]
        mgr.save(7, {"t": torch.zeros(2)})
        assert mgr.all_steps() == [5, 7]
