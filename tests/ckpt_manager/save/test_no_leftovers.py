"""Kills at each point of a save leave nothing behind once a clean run has finished (issue 33).

Each run is a process (`_killed_saver.py`) SIGKILLed with its writer (its whole process group,
as a killed rank's group goes) at one point of a save: staging, writing (a partial object in
the folder), commit (every file written, no manifest). The next run, holding the lease, must
collect the folder whatever its step (below or above the step it resumes from); after a clean
finish `ckptctl list --all` lists committed steps only. On local disk and on S3 (moto).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest

from ckpt_manager._format.layout import MANIFEST_NAME, step_dir
from ckpt_manager._save.writer import FAULT_ENV
from ckpt_manager._store.steps import list_step_dirs
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.cli import main as ckptctl
from tests.support.s3 import S3Target

pytestmark = pytest.mark.timeout(300)

_READY_TIMEOUT_S = 120.0
_KILLS = (
    # (point, step committed first, step killed mid-save)
    ("staging", 2, 3),
    ("writing", 4, 9),  # left above the next run's resume point
    ("commit", 6, 7),  # left below the step the last run commits
)


def _run(root: str, options: dict[str, Any], commit: int, kill: int, point: str, tmp: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if point == "writing":
        env[FAULT_ENV] = f"stall=3600@{kill}"
    ready, log = tmp / f"ready-{commit}", tmp / f"run-{commit}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ckpt_manager.save._killed_saver", root,
             json.dumps(options), str(commit), str(kill), point, str(ready)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while kill and not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run never reached {point}:\n{log.read_text()[-4000:]}")
            time.sleep(0.05)
        if not kill:
            assert proc.wait(timeout=_READY_TIMEOUT_S) == 0, log.read_text()[-4000:]
    finally:
        # The run and its writer, as a killed rank's process group goes.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _uncommitted(storage: Storage) -> list[int]:
    return [
        s for s in list_step_dirs(storage) if not storage.exists(f"{step_dir(s)}/{MANIFEST_NAME}")
    ]


def _kill_at_every_point_then_finish(root: str, options: dict[str, Any], tmp: Path) -> None:
    storage = Storage(root, options)
    leftover: list[int] = []
    for point, commit, kill in _KILLS:
        _run(root, options, commit, kill, point, tmp)
        # The run that left `kill` behind collected the leftovers of the one before it.
        assert set(_uncommitted(storage)) <= {kill}, (point, _uncommitted(storage))
        leftover = _uncommitted(storage)
    assert leftover, "the last kill left no folder: the test did not exercise a leftover"
    _run(root, options, 8, 0, "", tmp)  # a clean finish
    assert _uncommitted(storage) == []
    fs, path = fsspec.core.url_to_fs(root, **options)
    fs.invalidate_cache()
    assert not [n for n in fs.find(path) if n.endswith(".partial")]  # spread prefixes too


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_kills_mid_save_leave_only_committed_steps(
    backend: str, tmp_path: Path, s3: S3Target, capsys: pytest.CaptureFixture[str]
) -> None:
    if backend == "local":
        root, options, cli = str(tmp_path / "ckpt"), {}, []
    else:
        root, options = f"{s3.uri}/run", s3.storage_options
        cli = ["--endpoint-url", s3.endpoint_url]
    _kill_at_every_point_then_finish(root, options, tmp_path)
    capsys.readouterr()
    assert ckptctl(["list", root, "--all", "--json", *cli]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["state"]) for r in listed] == [(s, "committed") for s in (2, 4, 6, 8)]
