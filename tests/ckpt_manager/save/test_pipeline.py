"""One rank's save pipeline: modes, in-flight bound, early error reports, a writer that persists."""

from __future__ import annotations

import os
import pathlib
import threading
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

    from ckpt_manager._save.report import ReportCache

    real = ReportCache.prepare
    threads: list[str] = []

    def recording(self: ReportCache, **kwargs: object) -> object:
        threads.append(threading.current_thread().name)
        if kwargs["step"] == 2:
            raise ValueError("broken index")
        return real(self, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ReportCache, "prepare", recording)
    with CheckpointManager(str(tmp_path), CheckpointConfig(), run_id="r") as mgr:
        mgr.save(1, {"t": torch.ones(2)})
        mgr.wait_until_finished()
        mgr.save(2, {"t": torch.ones(2)})  # returns: the index is built behind it
        with pytest.raises(SaveFailedError, match=r"building the rank's index failed.*broken"):
            mgr.wait_until_finished()
        assert mgr.latest_step() == 1
    assert threads == ["ckpt-stager-0", "ckpt-stager-0"]


def test_a_single_process_commits_on_the_first_poll_after_its_files_are_durable(
    tmp_path: pathlib.Path,
) -> None:
    """[Note: the report is encoded before the files are durable]: the poll that first sees
    the writer's answer queues the commit, and the next poll after the commit job finished
    retires the save. Before, the first poll only started pickling the report and said
    WRITING, and the pre-issued round made the next poll act on that stale state: four polls
    (a training step each) from durable to committed instead of two."""
    with CheckpointManager(str(tmp_path), CheckpointConfig(), run_id="r") as mgr:
        mgr.save(1, {"t": torch.ones(2)})
        mgr.wait_until_finished()  # the writer is up
        mgr.save(2, {"t": torch.full((2,), 2.0)})
        mgr.before_optimizer_step()
        request = mgr._pending[0]
        writer = request.writer
        assert writer is not None

        def answered() -> bool:
            writer.poll(0.0)
            return request.request_id in writer._responses

        wait_until(answered)  # the files are durable; nothing was polled yet
        mgr.maybe_finalize()  # sees OK: the commit job is queued
        job = mgr._final._job
        assert job is not None, "the first poll after the write did not queue the commit"
        assert job.done.wait(20)
        mgr.maybe_finalize()
        assert mgr.stats().inflight == 0
        assert mgr.stats().last_committed_step == 2


def test_a_report_that_cannot_be_encoded_fails_the_save_on_the_staging_thread(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_manager._save import pipeline

    def broken(contribution: object) -> bytes:
        raise TypeError("cannot pickle this")

    with CheckpointManager(str(tmp_path), CheckpointConfig(), run_id="r") as mgr:
        mgr.save(1, {"t": torch.ones(2)})
        mgr.wait_until_finished()
        monkeypatch.setattr(pipeline, "encode_report_body", broken)
        mgr.save(2, {"t": torch.ones(2)})
        with pytest.raises(SaveFailedError, match=r"report encoding failed.*cannot pickle"):
            mgr.wait_until_finished()
        monkeypatch.undo()
        assert mgr.latest_step() == 1
        mgr.save(3, {"t": torch.full((2,), 3.0)})  # the writer and the slab are still usable
        mgr.wait_until_finished()
        assert mgr.latest_step() == 3


def test_write_in_flight_says_whether_a_save_now_would_wait_on_storage(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "stall=1@1,raise@2,stall=1@3")
    state = {"t": torch.ones(2)}
    with CheckpointManager(str(tmp_path / "a"), CheckpointConfig(), run_id="r") as mgr:
        assert not mgr.write_in_flight()
        assert mgr.stats().oldest_inflight_step is None
        mgr.save(1, state)
        # The writer starts, then stalls a second: a save now would wait for it.
        assert mgr.write_in_flight()
        stats = mgr.stats()
        assert stats.oldest_inflight_step == 1
        assert stats.oldest_inflight_unix_s is not None
        assert time.time() - stats.oldest_inflight_unix_s < 30
        wait_until(lambda: not mgr.write_in_flight())
        # Written but not committed yet: only the agreement and the commit are left.
        assert mgr.stats().inflight == 1
        mgr.save(2, state)
        assert mgr.stats().last_committed_step == 1
        # A failed write is not waited for either (its failure is finalized, not written).
        wait_until(lambda: not mgr.write_in_flight())
        assert mgr.stats().inflight == 1
        with pytest.raises(SaveFailedError, match="injected"):
            mgr.wait_until_finished()
    # With a free slot (max_inflight 2) a save never waits, whatever is being written.
    cfg = CheckpointConfig(max_inflight=2)
    with CheckpointManager(str(tmp_path / "b"), cfg, run_id="r") as mgr:
        mgr.save(3, state)
        assert not mgr.write_in_flight()
        mgr.save(4, state)
        assert mgr.write_in_flight()  # two in flight, step 3 stalled: the next save waits
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]


def _stager_nice(rank: int = 0) -> int:
    (thread,) = [t for t in threading.enumerate() if t.name == f"ckpt-stager-{rank}"]
    assert thread.native_id is not None
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


@pytest.mark.parametrize("staging_nice", [0, 10])
def test_the_staging_thread_copies_at_the_configured_nice_below_training(
    tmp_path: pathlib.Path, staging_nice: int
) -> None:
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    state = {"w": torch.randn(1 << 16)}
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT, staging_nice=staging_nice)
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        mgr.save(1, state)  # the first job sets the thread's priority before it copies
        mgr.before_optimizer_step()
        mgr.wait_until_finished()
        assert _stager_nice() == min(19, base + staging_nice)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    with pytest.raises(ValueError, match="staging_nice=20: use 0"):
        CheckpointConfig(staging_nice=20)
