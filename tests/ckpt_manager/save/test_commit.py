"""Committing a step: never written twice, stale attempts removed, a found manifest kept."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

from ckpt_manager import (
    AsyncMode,
    CheckpointConfig,
    CheckpointManager,
    CommitConflictError,
    SaveFailedError,
    StepNotFoundError,
)
from ckpt_manager._format.layout import MANIFEST_NAME, index_file_name, shard_file_name, step_dir
from ckpt_manager._save import finalize
from ckpt_manager._store.storage import Storage

CKPTCTL = str(pathlib.Path(sys.executable).with_name("ckptctl"))


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


_SECOND_LAUNCH = """
import shutil, sys, torch
from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager._format.layout import step_dir
root, other, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
with CheckpointManager(other, cfg, run_id="job") as mgr:
    mgr.save(step, {"t": torch.full((4,), 7.0)}, metrics={"by": "second"})
shutil.copytree(f"{other}/{step_dir(step)}", f"{root}/{step_dir(step)}", dirs_exist_ok=True)
"""


def test_a_commit_that_finds_another_launchs_manifest_keeps_its_step(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another attempt's commit of step 2 lands in the folder while the first launch's commit
    # of step 2 is about to write its manifest. (The lease refuses a second launch on a live
    # root, see store/test_lease.py; this is the exclusive write's own defence: the other
    # attempt commits on a root of its own and its step folder is copied in from outside.)
    root, other = str(tmp_path / "root"), str(tmp_path / "other")
    real = finalize.commit_step

    def second_launch_first(storage: Storage, **kw: Any) -> Any:
        subprocess.run(
            [sys.executable, "-c", _SECOND_LAUNCH, root, other, str(kw["step"])],
            check=True,
            timeout=120,
        )
        return real(storage, **kw)

    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(root, cfg, run_id="job") as mgr:
        mgr.save(1, {"t": torch.zeros(4)})
        monkeypatch.setattr(finalize, "commit_step", second_launch_first)
        with pytest.raises(SaveFailedError) as info:
            mgr.save(2, {"t": torch.ones(4)})
        monkeypatch.undo()
    folder = tmp_path / "root" / step_dir(2)
    assert sorted(p.name for p in folder.iterdir()) == [
        MANIFEST_NAME,
        shard_file_name(0),
        index_file_name(0),
    ]
    manifest = json.loads((folder / MANIFEST_NAME).read_bytes())
    assert manifest["metrics"] == {"by": "second"}
    assert isinstance(info.value.__cause__, CommitConflictError)
    assert "CommitConflictError" in str(info.value)
    assert "step 2" in str(info.value)
    verify = subprocess.run(
        [CKPTCTL, "verify", root, "2"], check=False, capture_output=True, text=True, timeout=120
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    with CheckpointManager(root, cfg, run_id="job") as mgr:
        restored = mgr.restore(2)
        assert restored is not None
        assert torch.equal(restored.state["t"], torch.full((4,), 7.0))


def _manifest_put_lands_but_its_reply_is_lost(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The first exclusive manifest PUT reaches storage; the caller then retries it."""
    written: list[bytes] = []
    real = Storage.write

    def write(self: Storage, name: str, data: Any, **kw: Any) -> None:
        if name.endswith(MANIFEST_NAME) and kw.get("exclusive"):
            written.append(bytes(data))
            real(self, name, data)  # landed (a plain write from outside: no condition)
        real(self, name, data, **kw)  # the retry, answered "already exists" / 412

    monkeypatch.setattr(Storage, "write", write)
    return written


def commit_with_lost_reply(root: str, options: dict[str, Any], mp: pytest.MonkeyPatch) -> None:
    """Shared with the S3 test: a retried identical manifest PUT counts as committed."""
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, storage_options=options)
    with CheckpointManager(root, cfg, run_id="lost-reply") as mgr:
        written = _manifest_put_lands_but_its_reply_is_lost(mp)
        mgr.save(3, {"t": torch.arange(4.0)}, metrics={"loss": 0.5})
        mp.undo()
        assert len(written) == 1
        assert mgr.all_steps() == [3]
        assert mgr.stats().last_committed_step == 3
        assert Storage(root, options).read(f"{step_dir(3)}/{MANIFEST_NAME}") == written[0]
        restored = mgr.restore(3)
        assert restored is not None
        assert torch.equal(restored.state["t"], torch.arange(4.0))


def test_b_retried_identical_manifest_write_is_a_commit_on_local_disk(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit_with_lost_reply(str(tmp_path / "root"), {}, monkeypatch)


def test_the_commit_runs_off_the_training_thread(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The manifest PUT is held until released: maybe_finalize keeps returning meanwhile,
    # and the PUT ran on the finalizer's thread, not on the calling thread.
    entered, release = threading.Event(), threading.Event()
    threads: list[str] = []
    real = Storage.write

    def write(self: Storage, name: str, data: Any, **kw: Any) -> None:
        if name.endswith(MANIFEST_NAME):
            threads.append(threading.current_thread().name)
            entered.set()
            release.wait(60)
        real(self, name, data, **kw)

    monkeypatch.setattr(Storage, "write", write)
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT)
    with CheckpointManager(str(tmp_path), cfg, run_id="off-thread") as mgr:
        mgr.save(4, {"t": torch.arange(8.0)})
        while not entered.is_set():
            mgr.maybe_finalize()
            entered.wait(0.01)
        for _ in range(3):  # the commit is held: each call is one poll, and returns
            mgr.maybe_finalize()
        assert mgr.stats().inflight == 1
        assert mgr.all_steps() == []
        release.set()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [4]
        stats = mgr.stats()
    assert threads == ["ckpt-finalize"]
    assert stats.last_committed_step == 4
    assert len(stats.recent_finalize_call_s) >= 4
