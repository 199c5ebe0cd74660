"""`restore(on_progress=...)`: one report per read from storage, none while a read is stuck."""

from __future__ import annotations

import itertools
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckpt_manager import (
    AsyncMode,
    CheckpointConfig,
    CheckpointManager,
    RestoreProgress,
    RestoreResult,
)
from ckpt_manager._load import restore as restore_module
from tests.ckpt_manager._states import assert_restored, mutate, sample_state, snapshot, wait_until
from tests.support import slow_fs
from tests.support.slow_fs import SlowLocalFileSystem


@pytest.fixture
def slow_root(tmp_path: pathlib.Path) -> Iterator[str]:
    """A checkpoint root on `slowfile://`, its read counters reset, unpaused, no delay."""
    slow_fs.register()
    SlowLocalFileSystem.num_data_reads = SlowLocalFileSystem.num_data_bytes = 0
    SlowLocalFileSystem.read_delay_s = 0.0
    SlowLocalFileSystem.pause = threading.Event()
    yield f"{slow_fs.PROTOCOL}://{tmp_path / 'ckpt'}"
    SlowLocalFileSystem.pause = None
    SlowLocalFileSystem.read_delay_s = None


def _assert_filled(state: Any, want: dict[str, torch.Tensor]) -> None:
    got = snapshot(state)
    assert all(torch.equal(got[k], want[k]) for k in want)


def _counted_reads() -> tuple[int, int]:
    return SlowLocalFileSystem.num_data_reads, SlowLocalFileSystem.num_data_bytes


def test_progress_reports_every_byte_read_verify_and_load(slow_root: str) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    state = sample_state(0)
    want = snapshot(state)
    reports: list[RestoreProgress] = []
    with CheckpointManager(slow_root, cfg, run_id="run") as mgr:
        mgr.save(7, state)
        mgr.wait_until_finished()
        mutate(state)
        before = _counted_reads()
        result = mgr.restore(into=state, on_progress=reports.append)
        reads, num_bytes = (a - b for a, b in zip(_counted_reads(), before, strict=True))
    assert result is not None
    _assert_filled(result.state, want)
    # One report per data read (the checksum pass and every piece loaded), cumulative.
    assert len(reports) == reads > 1
    assert [r.num_bytes_read for r in reports] == sorted({r.num_bytes_read for r in reports})
    assert reports[-1] == RestoreProgress(step=7, num_bytes_read=num_bytes)


def test_restore_without_a_callback_is_unchanged(slow_root: str) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    state = sample_state(3)
    want = snapshot(state)
    with CheckpointManager(slow_root, cfg, run_id="run") as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        mutate(state)
        result = mgr.restore(1)  # the positional form of before, no template
    assert result is not None
    assert_restored(result.state, want)


def test_a_large_piece_arrives_in_parts_each_reported(
    slow_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 64 MiB parts in production; 16 bytes here, so the 48-byte model weight takes 3 reads.
    monkeypatch.setattr(restore_module, "_READ_CHUNK", 16)
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, verify_checksums=False)
    state = sample_state(1)
    want = snapshot(state)
    with CheckpointManager(slow_root, cfg, run_id="run") as mgr:
        mgr.save(2, state)
        mgr.wait_until_finished()
        mutate(state)
        reports: list[RestoreProgress] = []
        result = mgr.restore(into=state, on_progress=reports.append)
    assert result is not None
    _assert_filled(result.state, want)  # the parts join up bitwise
    steps = [b.num_bytes_read - a.num_bytes_read for a, b in itertools.pairwise(reports)]
    assert max([reports[0].num_bytes_read, *steps]) <= 16
    assert len(reports) >= 48 // 16


def test_no_progress_is_reported_while_a_read_is_stuck(slow_root: str) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    state = sample_state(2)
    want = snapshot(state)
    reports: list[RestoreProgress] = []
    outcome: list[RestoreResult | None] = []
    with CheckpointManager(slow_root, cfg, run_id="run") as mgr:
        mgr.save(5, state)
        mgr.wait_until_finished()
        mutate(state)
        assert SlowLocalFileSystem.pause is not None
        SlowLocalFileSystem.pause.set()
        thread = threading.Thread(
            target=lambda: outcome.append(mgr.restore(into=state, on_progress=reports.append))
        )
        thread.start()
        # Blocked in its first data read: the restore has begun and reported nothing.
        wait_until(lambda: SlowLocalFileSystem.num_waiting == 1)
        threading.Event().wait(0.5)  # give a (wrong) timer-driven report time to appear
        assert thread.is_alive()
        assert reports == []
        SlowLocalFileSystem.pause.clear()
        thread.join(timeout=30)
        assert not thread.is_alive()
    (result,) = outcome
    assert result is not None
    _assert_filled(result.state, want)
    assert reports
    assert reports[-1].step == 5
