"""`ckptctl restore --world-size N` (reshard) commits like a save: it holds the destination's
lease while it writes, publishes through the one commit path (format 2, the root catalog),
and is refused while a live run holds the destination.

The source is the committed format-1 fixture (2 ranks: replicated, flat- and box-sharded,
rank-local tensors and plain values); the live holder is a real `CheckpointManager` in
another process, refreshing its lease.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, RankLocal
from ckpt_manager._format.layout import MANIFEST_NAME, index_file_name, shard_file_name, step_dir
from ckpt_manager._format.manifest import FORMAT_VERSION
from ckpt_manager._load.restore import load_state
from ckpt_manager._store.lease import LEASE_NAME, read_lease
from ckpt_manager._store.root_catalog import CATALOG_NAME, read_catalog
from ckpt_manager._store.steps import read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.cli import main
from tests.ckpt_manager._states import wait_until
from tests.ckpt_manager.conftest import Shard
from tests.ckpt_manager.fixtures.fixture_state import HERE, STEP, rank_state

# A run holding the destination: commits its step 1, says "ready", refreshes its lease every
# ttl / 3 until the file "done" appears, then closes (which releases the lease).
_HOLDER = """
import pathlib, sys, time, torch
from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
root, flags = sys.argv[1], pathlib.Path(sys.argv[2])
cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, lease_ttl_s=1.0)
with CheckpointManager(root, cfg, run_id="live-run") as mgr:
    mgr.save(1, {"t": torch.zeros(2)})
    (flags / "ready").write_text("ready")
    deadline = time.monotonic() + 300
    while not (flags / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


@pytest.fixture
def source(tmp_path: pathlib.Path) -> str:
    """A private copy of the committed format-1 fixture (2 ranks, step 7)."""
    copy = tmp_path / "source"
    shutil.copytree(HERE, copy)
    return str(copy)


@pytest.fixture
def live_holder(tmp_path: pathlib.Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A destination root held by a live run in another process."""
    root, flags = str(tmp_path / "dest"), tmp_path / "flags"
    flags.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, root, str(flags)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_until(lambda: (flags / "ready").exists() or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.communicate()[0]
        yield root, proc
        (flags / "done").write_text("done")
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, out
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            proc.communicate(timeout=60)


def _reshard(source: str, dest: str, world_size: int, capsys: pytest.CaptureFixture[str]) -> Any:
    capsys.readouterr()
    rc = main(["restore", source, str(STEP), "--world-size", str(world_size), "--to", dest])
    return rc, capsys.readouterr()


def _resharded(source: str, dest: str, world_size: int, capsys: Any) -> Storage:
    rc, captured = _reshard(source, dest, world_size, capsys)
    assert rc == 0, captured
    return Storage(dest)


def test_a_reshard_into_a_root_held_by_a_live_run_is_refused_naming_the_holder(
    source: str,
    live_holder: tuple[str, subprocess.Popen[str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    dest, holder = live_holder
    rc, captured = _reshard(source, dest, 3, capsys)
    assert rc == 1, captured
    # One error line (a note before it says whose lease is being watched).
    errors = [ln for ln in captured.err.splitlines() if ln.startswith("ckptctl restore: error:")]
    assert len(errors) == 1, captured.err
    (error,) = errors
    # The holder as its lease records it: run id, host, pid.
    assert f"run 'live-run' (host {socket.gethostname()}, pid {holder.pid}," in error
    # Nothing of the step was written, and the run still holds its root.
    assert not (pathlib.Path(dest) / step_dir(STEP)).exists()
    doc = read_lease(Storage(dest))
    assert doc is not None
    assert (doc["run_id"], doc["pid"]) == ("live-run", holder.pid)


def test_a_reshard_commits_format_2_into_the_catalog_and_releases_its_lease(
    source: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    storage = _resharded(source, str(tmp_path / "dest"), 3, capsys)
    # The one commit path: the step is in the root catalog, as a save's would be.
    assert storage.exists(CATALOG_NAME)
    entry = read_catalog(storage).entries[STEP]
    assert entry.world_size == 3
    # Format 2: a small top manifest over every new rank's index.
    doc = json.loads(storage.read(f"{step_dir(STEP)}/{MANIFEST_NAME}"))
    assert doc["format_version"] == FORMAT_VERSION == 2
    assert "pieces" not in doc["tensors"]["flat"]
    assert doc["tensors"]["flat"]["ranks"] == [[0, 3]]
    for rank in range(3):
        assert index_file_name(rank) in doc["files"]
    # The reshard held the root's lease as its own holder and let go of it.
    lease = json.loads(storage.read(LEASE_NAME))
    assert lease["released"] is True
    assert lease["pid"] == os.getpid()
    assert read_lease(storage) is None
    # Every new rank restores its part bitwise; a rank past the saved world keeps its
    # template's rank-local values.
    manifest = read_manifest(storage, STEP)
    verify_files(storage, manifest, sorted(manifest.files), check_crc=True)
    for rank in range(3):
        want = rank_state(min(rank, 1))
        lo, hi = (0, 4) if rank == 0 else (4, 8) if rank == 1 else (8, 10)
        template = {
            "model": {"w": torch.zeros(2, 3)},
            "flat": Shard(torch.zeros(hi - lo), (10,), (lo,), (lo, hi)),
            "box": Shard(torch.zeros(4, 3, dtype=torch.int64), (4, 3), (0, 0)),
            "rng": RankLocal({"seed": torch.full((3,), -1, dtype=torch.int32), "pos": -1}),
            "meta": None,
        }
        got = load_state(storage, manifest, rank, template)
        assert torch.equal(got["model"]["w"], want["model"]["w"])
        assert torch.equal(got["flat"].local, torch.arange(lo, hi, dtype=torch.float32) * 0.5)
        assert torch.equal(got["box"].local, torch.arange(12, dtype=torch.int64).reshape(4, 3))
        if rank < 2:
            assert torch.equal(got["rng"]["seed"], want["rng"].value["seed"])
            assert got["rng"]["pos"] == rank
        else:
            assert torch.equal(got["rng"]["seed"], torch.full((3,), -1, dtype=torch.int32))
            assert got["rng"]["pos"] == -1
        assert got["meta"] == want["meta"]


def test_a_run_takes_the_root_after_a_reshard_and_reads_the_resharded_step(
    source: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = str(tmp_path / "dest")
    _resharded(source, dest, 1, capsys)
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, lease_ttl_s=1.0)
    with CheckpointManager(dest, cfg, run_id="next") as mgr:
        assert mgr.all_steps() == [STEP]
        result = mgr.restore()
        assert result is not None
        assert torch.equal(result.state["flat"], torch.arange(10, dtype=torch.float32) * 0.5)
        mgr.save(STEP + 1, {"t": torch.ones(2)})
    entries = read_catalog(Storage(dest)).entries
    assert sorted(entries) == [STEP, STEP + 1]


def test_a_reshard_whose_lease_is_taken_over_while_it_writes_commits_nothing(
    source: str,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dest = str(tmp_path / "dest")
    real = Storage.put_file

    def put_file(self: Storage, local_path: str, name: str, **kw: Any) -> Any:
        done = real(self, local_path, name, **kw)
        if name.endswith(shard_file_name(2)):
            # The last rank's file is up: another process writes the lease (takes the root).
            intruder = {"run_id": "intruder", "owner": "other", "host": "elsewhere", "pid": 1}
            Storage(dest).write(LEASE_NAME, json.dumps(intruder).encode())
        return done

    monkeypatch.setattr(Storage, "put_file", put_file)
    rc, captured = _reshard(source, dest, 3, capsys)
    assert rc == 1, captured
    assert "was taken over" in captured.err
    assert "run 'intruder' (host elsewhere, pid 1," in captured.err
    storage = Storage(dest)
    assert not storage.exists(f"{step_dir(STEP)}/{MANIFEST_NAME}")
    assert STEP not in read_catalog(storage).entries
    assert json.loads(storage.read(LEASE_NAME))["run_id"] == "intruder"  # left as it is
