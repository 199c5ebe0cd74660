"""Retention waits for the run's restore: the fallback step survives a corrupt newest step.

A run restarts under a tightened policy (keep 1) on a root whose newest step is corrupt (one
byte of its shard flipped on disk, as bit rot would). Retention must not delete the older
steps before the restore has chosen one; afterwards the restored step stays protected.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, KeepLast
from ckpt_manager._coord import Coordinator
from ckpt_manager._format.layout import shard_file_name, step_dir
from ckpt_manager._load.recover import restore_agreed
from ckpt_manager._retention.deleter import Deleter
from ckpt_manager._store.quarantine import QUARANTINE_DIR
from ckpt_manager._store.steps import committed_steps
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CheckpointError


def _eventually(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _root_with_corrupt_newest(root: pathlib.Path) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, retention=KeepLast(n=10))
    with CheckpointManager(str(root), cfg, run_id="first") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((64,), float(step))})
    shard = root / step_dir(3) / shard_file_name(0)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_no_retention_before_the_restore_and_the_fallback_survives(
    tmp_path: pathlib.Path,
) -> None:
    _root_with_corrupt_newest(tmp_path)
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, retention=KeepLast(n=1), deletion_retry_s=0.1)
    with CheckpointManager(str(tmp_path), cfg, run_id="second") as mgr:
        time.sleep(1.0)  # ten timer periods: a pass now would delete steps 1 and 2
        assert mgr.all_steps() == [1, 2, 3]
        result = mgr.restore(step=None, into={"w": torch.zeros(64)})
        assert result is not None
        assert result.step == 2  # step 3 fails verification
        assert torch.equal(result.state["w"], torch.full((64,), 2.0))
        # Step 3 was moved aside (quarantined, not a committed step any more, never deleted by
        # retention); retention runs now: step 1 goes, 2 (restored, newest) stays.
        assert len(Storage(str(tmp_path)).list_names(QUARANTINE_DIR)) == 1
        _eventually(lambda: mgr.all_steps() == [2])
        mgr.save(4, {"w": torch.full((64,), 4.0)})
        mgr.wait_until_finished()
        _eventually(lambda: mgr.all_steps() == [2, 4])


@pytest.mark.parametrize("protect", [True, False], ids=["protected", "control"])
def test_the_candidate_being_read_is_protected_from_the_moment_it_is_chosen(
    tmp_path: pathlib.Path, protect: bool
) -> None:
    _root_with_corrupt_newest(tmp_path)
    chosen: list[int] = []
    passes: list[str] = []
    deleter_storage = Storage(str(tmp_path))
    deleter = Deleter(
        deleter_storage,
        KeepLast(n=1),
        saving=lambda: False,
        protected=lambda: set(chosen[-1:]) if protect else set(),
        grace_s=3600,
        retry_s=3600,
    )
    deleter.arm()  # an armed deleter, as after a first commit

    class _PassOnShardRead(Storage):
        """Runs a full retention pass when the restore first reads a shard of step 2."""

        def _pass_first(self, name: str) -> None:
            if name == f"{step_dir(2)}/{shard_file_name(0)}" and not passes:
                passes.append(name)
                deleter.trigger()
                assert deleter.flush(10)

        def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
            self._pass_first(name)
            return super().read(name, start, end)

        def read_into(self, name: str, start: int, out: memoryview) -> int:
            self._pass_first(name)
            return super().read_into(name, start, out)

    coord = Coordinator(30.0)
    result = None
    try:
        result = restore_agreed(
            _PassOnShardRead(str(tmp_path)),
            coord,
            None,
            None,
            verify_checksums=True,
            on_choose=chosen.append,
        )
    except CheckpointError:
        assert not protect  # the control: step 2's files vanish while it is read
    finally:
        deleter.close(5)
        coord.destroy()
    assert passes, "the retention pass never ran during the restore"
    assert chosen[:2] == [3, 2]
    if protect:
        assert result is not None
        assert result.step == 2
        assert committed_steps(deleter_storage) == [2, 3]
    else:  # without the protection the fallback is deleted under the restore
        assert result is None or result.step != 2
        assert 2 not in committed_steps(deleter_storage)
