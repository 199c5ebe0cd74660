"""One rank's save pipeline: modes, in-flight bound, early error reports, a writer that persists."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, SaveFailedError
from ckpt_manager._save.writer import FAULT_ENV
from tests.ckpt_manager._states import wait_until
from tests.ckpt_manager.conftest import Reports


def test_memory_root_needs_sync_mode() -> None:
    with pytest.raises(ValueError, match=r"AsyncMode\.SYNC"):
        CheckpointManager("memory://needs-sync", CheckpointConfig())
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager("memory://sync-ok", cfg, run_id="r") as mgr:
        mgr.save(1, {"t": torch.arange(3)})
        result = mgr.restore()
        assert result is not None
        assert torch.equal(result.state["t"], torch.arange(3))


def test_check_for_errors_reports_local_failure_early(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "raise@1")
    with CheckpointManager(str(tmp_path), CheckpointConfig(), run_id="r") as mgr:
        mgr.save(1, {"t": torch.ones(2)})

        def failed() -> bool:
            try:
                mgr.check_for_errors()
            except SaveFailedError:
                return True
            return False

        wait_until(failed)
        assert mgr.stats().inflight == 1
        with pytest.raises(SaveFailedError, match="injected"):
            mgr.maybe_finalize()
        assert mgr.stats().inflight == 0


def test_save_beyond_max_inflight_waits_and_reports_it_as_stall(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "stall=1@1")
    reports = Reports()
    with CheckpointManager(str(tmp_path), CheckpointConfig(), run_id="r", observer=reports) as mgr:
        mgr.save(1, {"t": torch.ones(2)})
        t0 = time.monotonic()
        mgr.save(2, {"t": torch.ones(2)})  # max_inflight=1: waits for step 1 to commit
        blocked = time.monotonic() - t0
        assert mgr.stats().last_committed_step == 1
        mgr.wait_until_finished()
    first, second = reports.reports
    assert blocked > 0.5
    assert second.stall_s >= blocked * 0.9
    assert first.stall_s < 0.5


def _rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_persistent_writer_persists_and_memory_is_flat(tmp_path: pathlib.Path) -> None:
    state = {"big": torch.randn(2 << 20), "small": {"x": torch.arange(10)}}  # 8 MiB
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT)
    pids, trainer, writer = set(), [], []
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        for step in range(1, 21):
            mgr.save(step, state)
            mgr.before_optimizer_step()
            mgr.wait_until_finished()
            pid = mgr.writer_pid
            assert pid is not None
            pids.add(pid)
            trainer.append(_rss_bytes(os.getpid()))
            writer.append(_rss_bytes(pid))
    assert len(pids) == 1
    assert trainer[-1] < trainer[1] * 1.05, trainer
    assert writer[-1] < writer[1] * 1.05, writer


def test_an_older_failed_save_does_not_cost_the_save_that_found_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # max_inflight=1: save(4) must first finalize step 2, whose writer failed. The failure is
    # reported by save(4), and step 4 is still saved: the daemon's loop counts the failure and
    # goes on, and a checkpoint skipped for an older save's sake would be lost for nothing.
    monkeypatch.setenv(FAULT_ENV, "raise@2")
    with CheckpointManager(str(tmp_path), CheckpointConfig(), run_id="r") as mgr:
        mgr.save(2, {"t": torch.ones(2)})
        with pytest.raises(SaveFailedError, match="injected") as failed:
            mgr.save(4, {"t": torch.full((2,), 4.0)})
        assert failed.value.step == 2
        mgr.wait_until_finished()
        assert mgr.stats().last_committed_step == 4
        result = mgr.restore()
        assert result is not None
        assert result.step == 4
        assert torch.equal(result.state["t"], torch.full((2,), 4.0))


def test_the_index_is_built_on_the_staging_thread_and_its_failure_fails_the_save(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from ckpt_manager import _manager

    real = _manager.prepare_rank
    threads: list[str] = []

    def recording(**kwargs: object) -> object:
        threads.append(threading.current_thread().name)
        if kwargs["step"] == 2:
            raise ValueError("broken index")
        return real(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_manager, "prepare_rank", recording)
    with CheckpointManager(str(tmp_path), CheckpointConfig(), run_id="r") as mgr:
        mgr.save(1, {"t": torch.ones(2)})
        mgr.wait_until_finished()
        mgr.save(2, {"t": torch.ones(2)})  # returns: the index is built behind it
        with pytest.raises(SaveFailedError, match=r"building the rank's index failed.*broken"):
            mgr.wait_until_finished()
        assert mgr.latest_step() == 1
    assert threads == ["ckpt-stager-0", "ckpt-stager-0"]
