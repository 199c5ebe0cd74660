"""The writer process under faults: exceptions, a failing copy, SIGKILL, a full disk."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import zlib
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, SaveFailedError, SaveResult
from ckpt_manager._format.layout import index_file_name, shard_file_name, step_dir
from ckpt_manager._format.pieces import FileEntry
from ckpt_manager._format.rank_index import IndexedFile, RankIndex
from ckpt_manager._save.writer import FAULT_ENV, write_shard_retrying
from ckpt_manager._store.lease import LEASE_NAME
from ckpt_manager._store.root_catalog import CATALOG_NAME
from ckpt_manager._store.storage import Storage
from tests.ckpt_manager._states import wait_until
from tests.ckpt_manager.conftest import Reports
from tests.support.s3 import S3Target


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
        wait_until(partial.exists)
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
        names = sorted(p.name for p in tiny_tmpfs.iterdir())
        assert names == [CATALOG_NAME, LEASE_NAME, step_dir(1)]
        result = mgr.restore()
        assert result is not None
        assert torch.equal(result.state["t"], one)


@pytest.mark.s3
def test_a_transient_failure_of_the_index_write_is_waited_out(
    s3: S3Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The shard landed; the index PUT meets a dropped connection once: it is retried
    # (without re-uploading the shard) instead of failing the save.
    storage = Storage(f"{s3.uri}/run-index-retry", dict(s3.storage_options))
    index = RankIndex.build(
        step=1,
        rank=0,
        file=IndexedFile(name=shard_file_name(0), size=0, crc32=0),
        records=[],
        rank_local_trees=[],
    )
    real = Storage.write
    writes: list[str] = []

    def write(self: Storage, name: str, data: Any, **kw: Any) -> None:
        writes.append(name.rsplit("/", 1)[-1])
        if name.endswith(index_file_name(0)) and writes.count(index_file_name(0)) == 1:
            raise ConnectionError("connection reset by peer")
        real(self, name, data, **kw)

    monkeypatch.setattr(Storage, "write", write)
    retried: list[str] = []
    staged_crc = 0x1234ABCD  # the staging copy's checksum, recorded as given
    size, entry = write_shard_retrying(
        storage,
        f"{step_dir(1)}/{shard_file_name(0)}",
        memoryview(b"x" * 100),
        chunk_bytes=1 << 20,
        concurrency=1,
        retry_for_s=30.0,
        on_retry=lambda err, _delay: retried.append(str(err)),
        index_json=index.to_json().decode(),
        checksum=staged_crc,
    )
    assert writes == [shard_file_name(0), index_file_name(0), index_file_name(0)]
    assert retried == ["connection reset by peer"]
    stored = storage.read(f"{step_dir(1)}/{index_file_name(0)}")
    assert entry == FileEntry(len(stored), zlib.crc32(stored))
    assert json.loads(stored)["file"] == {
        "name": shard_file_name(0),
        "size": size,
        "crc32": staged_crc,
        "checksum_algorithm": "crc32",
    }


def _registered_buffers(pid: int) -> list[int] | None:
    """The lengths of the buffers registered with process `pid`'s io_uring (read from
    /proc), or None if it has no ring."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "io_uring" not in os.readlink(f"/proc/{pid}/fd/{fd}"):
                continue
            info = pathlib.Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        lines = info.split("UserBufs:", 1)[1].splitlines()[1:]
        return [int(line.split("/")[1]) for line in lines if line.strip()[:1].isdigit()]
    return None


def test_the_writer_writes_local_shards_from_registered_slabs(tmp_path: pathlib.Path) -> None:
    # [Note: direct writes from registered buffers]: seen from outside, in the writer's
    # /proc fdinfo: its slabs are registered once written from, a slab replaced by a larger
    # one is not registered any more (its pages would stay pinned), and the bytes written
    # from them restore exactly.
    from ckpt_manager._store.backends import uring

    if uring.DirectRing.open() is None:
        pytest.skip("io_uring is unavailable here")
    small = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB: written direct
    large = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB: new slabs
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT, write_timeout_s=60)
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        pid = mgr.writer_pid
        for step in (1, 2):
            mgr.save(step, {"w": small + step})
            mgr.wait_until_finished()
        first = _registered_buffers(pid)
        assert first, "no registered slab in the writer"
        assert all(n >= small.nbytes for n in first)
        for step in (3, 4, 5):
            mgr.save(step, {"w": large + step})
            mgr.wait_until_finished()
        later = _registered_buffers(pid)
        assert later
        assert all(n >= large.nbytes for n in later), later  # the small slabs were released
        assert torch.equal(mgr.restore(5).state["w"], large + 5)
        assert torch.equal(mgr.restore(2).state["w"], small + 2)
