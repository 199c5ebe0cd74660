"""Kills at each point of a save leave nothing behind once a clean run has finished (issue 33).

Each run is a process (`_killed_saver.py`) SIGKILLed at one point of a save: staging, commit
(every file written, no manifest), both with its writer (its whole process group, as a killed
rank's group goes), and writing (a partial object under the root), where the writer outlives
its run: held by a fault until the next run has opened the root, it then writes its step's
files (a rank's writer finishes the chunk it is writing before it sees its parent gone). The
next run, holding the lease, must collect every such folder whatever its step (below or above
the step it resumes from); after a clean finish `ckptctl list --all` lists committed steps
only. On local disk and on S3 (moto).
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


class _Run:
    """One `_killed_saver` process in its own session, its output in a log file."""

    def __init__(
        self, root: str, options: dict[str, Any], tmp: Path, commit: int, kill: int, point: str
    ) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.release = tmp / f"release-{commit}"
        if point == "writing":
            env[FAULT_ENV] = f"hold={self.release}@{kill}"
        self.ready, self.go, self.log = (tmp / f"{n}-{commit}" for n in ("ready", "go", "log"))
        self.point = point
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.ckpt_manager.save._killed_saver", root,
                 json.dumps(options), str(commit), str(kill), point, str(self.ready),
                 str(self.go)],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip

    def wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run never reached {self.point}:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.05)

    def finish(self) -> None:
        self.go.write_text("go")
        code = self.proc.wait(timeout=_READY_TIMEOUT_S)
        assert code == 0, self.log.read_text()[-4000:]

    def kill(self, *, writer_too: bool = True) -> None:
        with contextlib.suppress(ProcessLookupError):
            if writer_too:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _uncommitted(storage: Storage) -> list[int]:
    return [
        s for s in list_step_dirs(storage) if not storage.exists(f"{step_dir(s)}/{MANIFEST_NAME}")
    ]


def _names(root: str, options: dict[str, Any]) -> list[str]:
    fs, path = fsspec.core.url_to_fs(root, **options)
    fs.invalidate_cache()
    return [str(n) for n in fs.find(path)]


def _kill_at_every_point_then_finish(root: str, options: dict[str, Any], tmp: Path) -> None:
    storage = Storage(root, options)
    runs: list[_Run] = []
    try:
        for point, commit, kill in (("staging", 2, 3), ("commit", 4, 5)):
            run = _Run(root, options, tmp, commit, kill, point)
            runs.append(run)
            run.wait_ready()
            run.kill()
            # The run that left `kill` behind collected the leftover of the one before it.
            assert set(_uncommitted(storage)) <= {kill}, (point, _uncommitted(storage))
        assert _uncommitted(storage) == [5], "the commit point left no folder"
        zombie = _Run(root, options, tmp, 6, 9, "writing")
        runs.append(zombie)
        zombie.wait_ready()
        zombie.kill(writer_too=False)  # its writer holds mid-write
        last = _Run(root, options, tmp, 8, 0, "")
        runs.append(last)
        last.wait_ready()  # it opened the root (removing every leftover) and committed 8
        assert _uncommitted(storage) == []
        zombie.release.write_text("write")  # now the orphaned writer writes step 9's files
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not any(
            step_dir(9) in n and n.endswith(".index.json") for n in _names(root, options)
        ):
            assert time.monotonic() < deadline, "the orphaned writer never wrote step 9"
            time.sleep(0.05)
        assert _uncommitted(storage) == [9]  # below the step the last run saves next
        last.finish()
        assert _uncommitted(storage) == []
        assert not [n for n in _names(root, options) if n.endswith(".partial")]
    finally:
        for run in runs:
            run.kill()


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
    assert [(r["step"], r["state"]) for r in listed] == [(s, "committed") for s in (2, 4, 6, 8, 10)]
