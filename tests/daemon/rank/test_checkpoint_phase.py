"""A save held by storage is published as `checkpointing`, not `training` (the real loop).

One rank (world size 1, gloo) runs the real training loop with synchronous saves
(`async_mode = "sync"`: the rank's own `save()` writes) to `heldmem://`, an in-memory fsspec
filesystem whose writes into a checkpoint step wait while a hold file exists. The save of step
2 blocks there; a watcher thread in the rank reads the rank's snapshot file as the daemon
does, sees `checkpointing` ([Note: a blocked checkpoint call says checkpointing] in
`daemon/rank/phase_watch.py`), notes whether a step was committed meanwhile and removes the
hold file. No timing is judged: the watcher waits for each state with a generous timeout.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow

_PROTOCOL = "heldmem"
_HOLD_TIMEOUT_S = 120.0


def _held_filesystem(hold_file: str) -> None:
    """Register `heldmem://`: writes under a `step-*` folder wait while `hold_file` exists."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    def wait(path: object) -> None:
        if "/step-" not in str(path):
            return
        deadline = time.monotonic() + _HOLD_TIMEOUT_S
        while os.path.exists(hold_file) and time.monotonic() < deadline:
            time.sleep(0.02)

    class HeldMemoryFileSystem(MemoryFileSystem):
        protocol = (_PROTOCOL,)
        store: dict[str, Any] = {}  # noqa: RUF012 (fsspec's own class-level store)
        pseudo_dirs = [""]  # noqa: RUF012

        def pipe_file(self, path: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
            wait(path)
            return super().pipe_file(path, value, *args, **kwargs)

        def put_file(self, lpath: Any, rpath: Any, *args: Any, **kwargs: Any) -> Any:
            wait(rpath)
            return super().put_file(lpath, rpath, *args, **kwargs)

    fsspec.register_implementation(_PROTOCOL, HeldMemoryFileSystem, clobber=True)


def _run_with_a_held_save(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    from daemon._config_load import load_config
    from daemon.jobs.default_job import build
    from daemon.jobs.job import JobContext
    from daemon.rank.loop import run_training
    from daemon.rank.telemetry import RankTelemetry
    from daemon.rundir.control import RankControl
    from daemon.rundir.snapshot import RankPhase, read_snapshot, snapshot_path

    hold_file = os.path.join(run_dir, "hold")
    Path(hold_file).touch()
    _held_filesystem(hold_file)
    cfg = load_config(
        {
            "ckpt_uri": f"{_PROTOCOL}://ckpt",
            "max_steps": "3",
            "batch_size": "2",
            "ckpt_every": "2",
            "async_mode": "sync",
            "memory_every": "0",
            "device": "cpu",
        },
        env={},
    )
    path = snapshot_path(Path(run_dir), 0)
    telemetry = RankTelemetry(path, rank=rank, world_size=world_size, publish_interval_s=0.1)
    seen: dict[str, Any] = {}

    def watch() -> None:
        deadline = time.monotonic() + _HOLD_TIMEOUT_S
        while time.monotonic() < deadline:
            data = read_snapshot(path)
            if data is not None and data["phase"] is RankPhase.CHECKPOINTING:
                seen["checkpointing_at_step"] = data["gauges"]["trainingd_train_step"][""]
                seen["committed_meanwhile"] = data["gauges"].get(
                    "trainingd_ckpt_last_committed_step"
                )
                break
            time.sleep(0.02)
        os.unlink(hold_file)

    watcher = threading.Thread(target=watch)
    watcher.start()
    spec = build(JobContext(rank=rank, world_size=world_size, seed=0))
    job = dataclasses.replace(spec, sample=None)
    try:
        result = run_training(
            cfg, job, telemetry=telemetry, control=RankControl(None, graceful_signals=False)
        )
    finally:
        watcher.join()
        telemetry.close()
    seen["final_step"] = result.final_step
    seen["phase_after"] = telemetry.phase.value
    return seen


def test_a_save_held_by_storage_is_published_as_checkpointing(tmp_path: Path) -> None:
    [seen] = run_on_ranks(_run_with_a_held_save, 1, str(tmp_path), timeout_s=300)
    assert seen.get("checkpointing_at_step") == 2, seen  # step 2 done, its save held
    assert seen["committed_meanwhile"] is None, seen
    assert seen["final_step"] == 3, seen
    assert seen["phase_after"] == "finished", seen
