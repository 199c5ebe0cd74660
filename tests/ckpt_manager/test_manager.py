"""CheckpointManager in one process: modes, commit, verification, fallback, lease, faults."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckpt_manager import (
    AsyncMode,
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    LeaseHeldError,
    RankLocal,
    SaveFailedError,
    SaveResult,
    StepNotFoundError,
)
from ckpt_manager._save.writer import FAULT_ENV
from ckpt_manager._store.lease import LEASE_NAME
from ckpt_manager._store.manifest import MANIFEST_NAME, shard_file_name, step_dir
from tests.ckpt_manager.conftest import Reports, Shard


def _wait_for(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)},
        "shard": Shard(torch.randn(6, generator=g), (6,), (0,), (0, 6)),
        "opt": {"state": {0: {"step": 1, "exp_avg": torch.randn(5, generator=g)}}},
        "rng": RankLocal({"torch": torch.get_rng_state(), "pos": 3}),
        "meta": ("x", 1.5, None, True),
    }


def _snapshot(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        "w": state["model"]["w"].clone(),
        "b": state["model"]["b"].clone(),
        "shard": state["shard"].local.clone(),
        "exp_avg": state["opt"]["state"][0]["exp_avg"].clone(),
    }


def _mutate(state: dict[str, Any]) -> None:
    state["model"]["w"].mul_(1.5).add_(0.25)
    state["model"]["b"].neg_()
    state["shard"].local.add_(1)
    state["opt"]["state"][0]["exp_avg"].sub_(0.125)


def _assert_restored(state: Any, want: dict[str, torch.Tensor]) -> None:
    assert torch.equal(state["model"]["w"], want["w"])
    assert torch.equal(state["model"]["b"], want["b"])
    assert torch.equal(state["shard"], want["shard"])
    assert torch.equal(state["opt"]["state"][0]["exp_avg"], want["exp_avg"])
    assert state["meta"] == ("x", 1.5, None, True)
    assert state["rng"]["pos"] == 3


@pytest.mark.parametrize("mode", list(AsyncMode))
def test_save_mutate_restore_bitwise(tmp_path: pathlib.Path, mode: AsyncMode) -> None:
    reports = Reports()
    state = _state(0)
    saved = {}
    cfg = CheckpointConfig(async_mode=mode)
    with CheckpointManager(str(tmp_path), cfg, run_id="run", observer=reports) as mgr:
        for step in (10, 20, 30):
            saved[step] = _snapshot(state)
            mgr.save(step, state, metrics={"loss": 1.0 / step})
            mgr.before_optimizer_step()
            _mutate(state)  # the optimizer step, right after the fence
            mgr.maybe_finalize()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [10, 20, 30]
        assert mgr.stats().last_committed_step == 30
        for step, want in saved.items():
            result = mgr.restore(step)
            assert result is not None
            _assert_restored(result.state, want)
    assert [r.step for r in reports.reports] == [10, 20, 30]
    for r in reports.reports:
        assert r.result is SaveResult.COMMITTED
        assert r.error is None
        assert r.num_bytes > 0
        assert 0 <= r.staging_s <= r.latency_s
        assert r.stall_s <= r.latency_s + 1e-6
    manifest = json.loads((tmp_path / step_dir(30) / MANIFEST_NAME).read_text())
    assert manifest["metrics"] == {"loss": 1.0 / 30}
    assert manifest["world_size"] == 1
    assert set(manifest["versions"]) >= {"torch", "trainingd"}
    assert manifest["files"][shard_file_name(0)]["size"] > 0


def test_restore_into_template_fills_in_place(tmp_path: pathlib.Path) -> None:
    state = _state(1)
    want = _snapshot(state)
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="run") as mgr:
        mgr.save(1, state)
        template = _state(2)
        w = template["model"]["w"]
        result = mgr.restore(into=template)
        assert result is not None
        assert result.step == 1
        assert result.state["model"]["w"] is w
        assert torch.equal(w, want["w"])
        assert torch.equal(template["shard"].local, want["shard"])
        assert result.state["rng"]["pos"] == 3
        with pytest.raises(CheckpointError, match="not in the checkpoint"):
            mgr.restore(1, into={"model": {"missing": torch.zeros(1)}})


def test_empty_template_piece_past_the_end_restores(tmp_path: pathlib.Path) -> None:
    whole = torch.arange(16, dtype=torch.float32)
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="run") as mgr:
        mgr.save(1, {"p": Shard(whole, (16,), (0,), (0, 16))})
        # A rank that owns none of the parameter, placed at the engine's flat cursor.
        empty = Shard(torch.zeros(0), (16,), (0,), (1648, 1648))
        result = mgr.restore(1, into={"p": empty})
        assert result is not None
        assert result.state["p"] is empty
        tail = Shard(torch.zeros(4), (16,), (0,), (12, 16))
        mgr.restore(1, into={"p": tail})
        assert torch.equal(tail.local, whole[12:])
        with pytest.raises(CheckpointError, match="lies outside the 16 elements"):
            mgr.restore(1, into={"p": Shard(torch.zeros(4), (16,), (0,), (14, 18))})


def test_memory_root_needs_sync_mode() -> None:
    with pytest.raises(ValueError, match=r"AsyncMode\.SYNC"):
        CheckpointManager("memory://needs-sync", CheckpointConfig())
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager("memory://sync-ok", cfg, run_id="r") as mgr:
        mgr.save(1, {"t": torch.arange(3)})
        result = mgr.restore()
        assert result is not None
        assert torch.equal(result.state["t"], torch.arange(3))


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


def _flip_byte(path: pathlib.Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _two_steps(root: pathlib.Path) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(root), cfg, run_id="r") as mgr:
        mgr.save(1, {"t": torch.full((64,), 1.0)})
        mgr.save(2, {"t": torch.full((64,), 2.0)})


def _restore_latest(root: pathlib.Path, events: list[dict[str, Any]]) -> tuple[int, str]:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(root), cfg, run_id="r") as mgr:
        result = mgr.restore()
        assert result is not None
        assert torch.equal(result.state["t"], torch.full((64,), float(result.step)))
    skipped = [e for e in events if e["event"] == "ckpt_restore_skipped_step"]
    return result.step, skipped[0]["reason"] if skipped else ""


def test_flipped_byte_falls_back_with_reason(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    _two_steps(tmp_path)
    _flip_byte(tmp_path / step_dir(2) / shard_file_name(0), -3)
    step, reason = _restore_latest(tmp_path, log_events)
    assert step == 1
    assert "checksum" in reason
    assert "rank-00000.bin" in reason
    with (
        pytest.raises(CorruptCheckpointError, match="checksum"),
        CheckpointManager(
            str(tmp_path), CheckpointConfig(async_mode=AsyncMode.SYNC), run_id="r"
        ) as mgr,
    ):
        mgr.restore(2)


def test_truncated_manifest_falls_back(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    _two_steps(tmp_path)
    manifest = tmp_path / step_dir(2) / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes()[:100])
    step, reason = _restore_latest(tmp_path, log_events)
    assert step == 1
    assert "invalid manifest" in reason


def test_manifest_naming_parent_path_is_rejected(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    _two_steps(tmp_path)
    (tmp_path / "x").write_bytes(b"outside")
    manifest = tmp_path / step_dir(2) / MANIFEST_NAME
    doc = json.loads(manifest.read_text())
    entry = doc["files"].pop(shard_file_name(0))
    doc["files"]["../x"] = entry
    for rec in doc["tensors"].values():
        for piece in rec["pieces"]:
            piece["file"] = "../x"
    manifest.write_text(json.dumps(doc))
    step, reason = _restore_latest(tmp_path, log_events)
    assert step == 1
    assert "'../x'" in reason


def test_lease_refuses_live_foreign_run_and_allows_takeover(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="first"):
        with pytest.raises(LeaseHeldError, match=r"run 'first' \(host .*pid"):
            CheckpointManager(str(tmp_path), cfg, run_id="second")
        # The same run restarting takes the lease over.
        CheckpointManager(str(tmp_path), cfg, run_id="first").close()
    assert not (tmp_path / LEASE_NAME).exists()
    # A dead holder on this host, and an expired holder elsewhere, are taken over.
    dead = subprocess.Popen(["true"])
    dead.wait()
    for holder in (
        {"host": socket.gethostname(), "pid": dead.pid, "refreshed_unix_s": time.time()},
        {"host": "elsewhere", "pid": 1, "refreshed_unix_s": time.time() - 1000},
    ):
        doc = {"run_id": "old", "acquired_unix_s": 0, "ttl_s": 60, **holder}
        (tmp_path / LEASE_NAME).write_text(json.dumps(doc))
        CheckpointManager(str(tmp_path), cfg, run_id="new").close()
    takeovers = [e for e in log_events if e["event"] == "ckpt_lease_taken_over"]
    assert len(takeovers) == 3


def test_writer_exception_fails_save_and_next_save_works(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "raise@2")
    reports = Reports()
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT, write_timeout_s=30)
    with CheckpointManager(str(tmp_path), cfg, run_id="r", observer=reports) as mgr:
        pid = mgr.writer_pid
        mgr.save(1, {"t": torch.ones(4)})
        mgr.wait_until_finished()
        mgr.save(2, {"t": torch.ones(4) * 2})
        with pytest.raises(
            SaveFailedError, match="rank 0: writer failed: RuntimeError: injected"
        ) as info:
            mgr.wait_until_finished()
        assert info.value.step == 2
        assert not (tmp_path / step_dir(2)).exists()
        mgr.save(3, {"t": torch.ones(4) * 3})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 3]
        assert mgr.writer_pid == pid
    assert [r.result for r in reports.reports] == [
        SaveResult.COMMITTED,
        SaveResult.FAILED,
        SaveResult.COMMITTED,
    ]
    assert "injected writer fault" in (reports.reports[1].error or "")


@pytest.mark.parametrize("mode", [AsyncMode.PERSISTENT, AsyncMode.TEMPORAL])
def test_copy_failing_mid_stream_fails_the_save_and_the_writer_keeps_serving(
    tmp_path: pathlib.Path, mode: AsyncMode
) -> None:
    # Local disk streams: the writer already holds the request and has written the first
    # parts when the copy fails; it must drop the file and stay usable.
    big = torch.arange(12 << 20, dtype=torch.float32)  # 48 MiB: progress is reported first
    cfg = CheckpointConfig(async_mode=mode, write_timeout_s=60)
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        pid = mgr.writer_pid
        mgr.save(1, {"a": big, "b": torch.empty(4, device="meta")})
        with pytest.raises(SaveFailedError, match="snapshot copy failed") as info:
            mgr.wait_until_finished()
        assert info.value.step == 1
        assert not (tmp_path / step_dir(1)).exists()
        mgr.save(2, {"a": big, "b": torch.ones(4)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2]
        assert mgr.writer_pid == pid
        restored = mgr.restore(2).state
    assert torch.equal(restored["a"], big)
    assert torch.equal(restored["b"], torch.ones(4))


def test_writer_sigkilled_mid_write(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "stall=30@2")
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT)
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        mgr.save(1, {"t": torch.full((1000,), 1.0)})
        mgr.wait_until_finished()
        pid = mgr.writer_pid
        assert pid is not None
        mgr.save(2, {"t": torch.full((1000,), 2.0)})
        partial = tmp_path / step_dir(2) / f"{shard_file_name(0)}.partial"
        _wait_for(partial.exists)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(SaveFailedError, match=f"writer process {pid} exited with code -9"):
            mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
        assert not (tmp_path / step_dir(2)).exists()
        result = mgr.restore()
        assert result is not None
        assert result.step == 1
        mgr.save(3, {"t": torch.full((1000,), 3.0)})
        mgr.wait_until_finished()
        assert mgr.writer_pid not in (None, pid)
        assert mgr.all_steps() == [1, 3]


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


@pytest.fixture
def tiny_tmpfs(tmp_path: pathlib.Path) -> Any:
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs here (needs root/CAP_SYS_ADMIN): {done.stderr}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_keeps_previous_step(tiny_tmpfs: pathlib.Path) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT)
    one = torch.full((300_000,), 1.0)  # 1.2 MB: the second step cannot fit in 2 MiB
    with CheckpointManager(str(tiny_tmpfs), cfg, run_id="r") as mgr:
        mgr.save(1, {"t": one})
        mgr.wait_until_finished()
        mgr.save(2, {"t": one * 2})
        with pytest.raises(SaveFailedError, match="No space left"):
            mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
        assert sorted(p.name for p in tiny_tmpfs.iterdir()) == [LEASE_NAME, step_dir(1)]
        result = mgr.restore()
        assert result is not None
        assert torch.equal(result.state["t"], one)


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

        _wait_for(failed)
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


def test_lease_is_refreshed_while_the_run_lives(tmp_path: pathlib.Path) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, lease_ttl_s=1.0)
    with CheckpointManager(str(tmp_path), cfg, run_id="alive"):
        first = json.loads((tmp_path / LEASE_NAME).read_text())
        assert first["run_id"] == "alive"
        assert first["pid"] == os.getpid()

        def refreshed() -> bool:
            try:
                doc = json.loads((tmp_path / LEASE_NAME).read_text())
            except (OSError, ValueError):
                return False
            return bool(doc["refreshed_unix_s"] > first["refreshed_unix_s"])

        _wait_for(refreshed, timeout_s=10)
        time.sleep(1.2)  # past one ttl: still live, because it keeps being refreshed
        with pytest.raises(LeaseHeldError, match="alive"):
            CheckpointManager(str(tmp_path), cfg, run_id="intruder")


@pytest.mark.gpu
def test_cuda_tensors_roundtrip(tmp_path: pathlib.Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    state = {
        "w": torch.randn(64, 32, device=dev),
        "s": Shard(torch.randn(100, device=dev), (200,), (0,), (50, 150)),
    }
    want_w, want_s = state["w"].cpu(), state["s"].local.cpu()
    with CheckpointManager(str(tmp_path), CheckpointConfig(), run_id="gpu") as mgr:
        mgr.save(1, state)
        mgr.before_optimizer_step()
        state["w"].add_(1)
        state["s"].local.add_(1)
        mgr.wait_until_finished()
        template = {
            "w": torch.zeros(64, 32, device=dev),
            "s": Shard(torch.zeros(100, device=dev), (200,), (0,), (50, 150)),
        }
        result = mgr.restore(into=template)
    assert result is not None
    assert torch.equal(template["w"].cpu(), want_w)
    assert torch.equal(template["s"].local.cpu(), want_s)


def test_template_aliases_missing_from_an_older_checkpoint_are_kept(
    tmp_path: pathlib.Path,
) -> None:
    # Tie metadata (CONTRACTS.md) comes from the module; a checkpoint without it still loads.
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        mgr.save(1, {"model": {"w": torch.ones(3)}})
        mgr.wait_until_finished()
        template = {"model": {"w": torch.zeros(3), "__aliases__": {"head.w": "w"}}}
        result = mgr.restore(into=template)
        assert result is not None
        assert result.state["model"]["__aliases__"] == {"head.w": "w"}
        assert torch.equal(result.state["model"]["w"], torch.ones(3))
        with pytest.raises(CheckpointError, match=r"keys \['b'\] under"):
            mgr.restore(into={"model": {"w": torch.zeros(3), "b": torch.zeros(1)}})
