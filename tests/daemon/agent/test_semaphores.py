"""The named semaphores the daemon holds are recorded and a successor unlinks them ([Note: a
group SIGKILL leaves multiprocessing's semaphores] in `daemon/agent/semaphores.py`)."""

from __future__ import annotations

import _multiprocessing
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.agent.memory_dir import OWNER_FILE, NodeMemoryDir, this_process_owner
from daemon.agent.semaphores import (
    LEDGER_FILE,
    held_semaphores,
    record_semaphores,
    unlink_recorded,
)

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and Path("/dev/shm").is_dir()), reason="/dev/shm"
)


@pytest.fixture
def semaphore() -> Iterator[str]:
    """A named semaphore as multiprocessing makes them (`sem.mp-*`), held by this process."""
    name = f"/mp-test{secrets.token_hex(4)}"
    lock = _multiprocessing.SemLock(1, 1, 1, name, False)  # kind 1: a semaphore
    yield f"sem.{name[1:]}"
    del lock
    if Path(f"/dev/shm/sem.{name[1:]}").exists():
        os.unlink(f"/dev/shm/sem.{name[1:]}")


def test_a_held_semaphore_is_recorded_and_unlinked_only_with_its_inode(
    tmp_path: Path, semaphore: str
) -> None:
    path = Path("/dev/shm") / semaphore
    held = held_semaphores()
    assert held[semaphore] == path.stat().st_ino
    assert record_semaphores(tmp_path, None) == held
    assert record_semaphores(tmp_path, held) == held  # unchanged: not written again
    ledger = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert ledger["semaphores"][semaphore] == path.stat().st_ino

    # A name whose file is another one now (another inode) is not ours: left alone.
    ledger["semaphores"] = {semaphore: path.stat().st_ino + 1, "../etc/passwd": 1}
    (tmp_path / LEDGER_FILE).write_text(json.dumps(ledger))
    assert unlink_recorded(tmp_path) == 0
    assert path.exists()
    ledger["semaphores"] = {semaphore: path.stat().st_ino}
    (tmp_path / LEDGER_FILE).write_text(json.dumps(ledger))
    assert unlink_recorded(tmp_path) == 1
    assert not path.exists()


def test_no_record_or_a_broken_one_unlinks_nothing(tmp_path: Path) -> None:
    assert unlink_recorded(tmp_path) == 0
    (tmp_path / LEDGER_FILE).write_text("{not json")
    assert unlink_recorded(tmp_path) == 0


def test_with_the_tier_off_a_successor_still_unlinks_a_killed_daemons_semaphores(
    tmp_path: Path, semaphore: str
) -> None:
    # [Note: the semaphore ledger outlives the tier] in daemon/agent/memory_dir.py: the
    # directory claimed for the ledger alone.
    path = Path("/dev/shm") / semaphore
    killed = NodeMemoryDir(tmp_path / "shm" / "trainingd-r-0", "r", 0)
    killed.claim(tier=False)
    killed.record_semaphores()
    assert json.loads((killed.path / LEDGER_FILE).read_text())["semaphores"][semaphore] == (
        path.stat().st_ino
    )
    # Its daemon dies without cleaning up: the owner record names a pid that has exited.
    gone = subprocess.Popen(["true"])
    gone.wait()
    owner = this_process_owner("r", 0)._replace(pid=gone.pid, start_ticks=None)
    (killed.path / OWNER_FILE).write_text(json.dumps(owner._asdict()))
    successor = NodeMemoryDir(killed.path, "r", 0)
    successor.reclaim_stale()
    assert not path.exists()
    assert not killed.path.exists()
