"""The memory tier's directory: owner records, stale reclaim, refusal, removal at every exit.

The last test runs real daemons: one SIGKILLed with its whole session, one that reclaims what
it left, one refused while that one lives, and a SIGTERM that leaves nothing in memory_dir.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from daemon.agent.memory_dir import (
    OWNER_FILE,
    REPLICAS_DIR,
    NodeMemoryDir,
    OwnerRecord,
    OwnerState,
    owner_state,
    this_process_owner,
)
from daemon.agent.semaphores import LEDGER_FILE
from daemon.errors import StartupCheckError
from tests.daemon._daemon_proc import GATED_JOB, DaemonProc, Gate, wait_for


def _owned_by(directory: Path, owner: OwnerRecord, *, data_bytes: int = 0) -> Path:
    """A memory-tier directory as a daemon leaves it: owner record and one slot."""
    directory.mkdir(parents=True)
    (directory / OWNER_FILE).write_text(json.dumps(owner._asdict()))
    (directory / "rank-00000.slot-0").write_bytes(b"x" * data_bytes)
    return directory


def _dead_pid() -> int:
    """The pid of a process that ran and was reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_owner_states_tell_live_from_dead_recycled_zombie_and_foreign() -> None:
    me = this_process_owner("r", 0)
    assert me.pid == os.getpid()
    assert me.start_ticks is not None
    assert owner_state(me) is OwnerState.ALIVE
    assert owner_state(me._replace(pid=_dead_pid())) is OwnerState.DEAD
    # The same pid, started at another time: a recycled pid, not our process.
    assert owner_state(me._replace(start_ticks=me.start_ticks + 1)) is OwnerState.DEAD
    assert owner_state(me._replace(boot_id="another-boot")) is OwnerState.DEAD
    assert owner_state(me._replace(host=socket.gethostname() + "-x")) is OwnerState.UNKNOWN
    assert owner_state(me._replace(pid_namespace="pid:[1]")) is OwnerState.UNKNOWN
    # A killed child its parent has not reaped yet is dead too (as a SIGKILLed daemon is).
    child = subprocess.Popen(["sleep", "30"])
    try:
        zombie = me._replace(pid=child.pid, start_ticks=None)
        assert owner_state(zombie) is OwnerState.ALIVE
        child.kill()
        wait_for(lambda: owner_state(zombie) is OwnerState.DEAD, 10, "a zombie")
    finally:
        child.kill()
        child.wait()


def test_claim_measure_release(tmp_path: Path) -> None:
    memory = NodeMemoryDir(tmp_path / "shm" / "trainingd-r-0", "r", 0)
    assert memory.tier_bytes() == {"local": 0.0, "replica": 0.0}
    memory.claim()
    owner = json.loads((memory.path / OWNER_FILE).read_text())
    assert (owner["pid"], owner["run_id"], owner["node_rank"]) == (os.getpid(), "r", 0)
    assert memory.tier_bytes() == {"local": 0.0, "replica": 0.0}  # the record is not the tier
    (memory.path / "rank-00001.slot-0").write_bytes(b"x" * 40_000)
    (memory.path / REPLICAS_DIR).mkdir()
    (memory.path / REPLICAS_DIR / "rank-00003.slot-0").write_bytes(b"y" * 8192)
    held = memory.tier_bytes()
    assert held["local"] >= 40_000
    assert held["replica"] >= 8192
    assert held["local"] + held["replica"] < 40_000 + 8192 + 4 * 4096
    # A second daemon of the same run and node cannot take it.
    with pytest.raises(StartupCheckError, match=rf"held by a live trainingd, pid {os.getpid()}"):
        NodeMemoryDir(memory.path, "r", 0).reclaim_stale()
    with pytest.raises(StartupCheckError, match="cannot run twice"):
        NodeMemoryDir(memory.path, "r", 0).claim()
    memory.release()
    assert not memory.path.exists()
    memory.release()  # idempotent


def test_reclaim_takes_only_this_runs_dead_directories(tmp_path: Path) -> None:
    me = this_process_owner("r", 0)
    dead = me._replace(pid=_dead_pid(), start_ticks=None)
    root = tmp_path / "shm"
    stale = _owned_by(root / "trainingd-r-0", dead, data_bytes=1 << 20)
    recycled = _owned_by(root / "trainingd-r-2", me._replace(start_ticks=me.start_ticks + 7))
    live_peer = _owned_by(root / "trainingd-r-1", me._replace(node_rank=1))
    other_run = _owned_by(root / "trainingd-r-1x-0", dead)  # run `r-1x`, not `r`
    foreign = _owned_by(root / "trainingd-r-3", dead._replace(host="elsewhere"))
    starting = root / "trainingd-r-4"  # a claim in progress: no record yet
    starting.mkdir()
    abandoned = root / "trainingd-r-5"
    abandoned.mkdir()
    old = time.time() - 3600
    os.utime(abandoned, (old, old))

    freed = NodeMemoryDir(root / "trainingd-r-0", "r", 0).reclaim_stale()
    assert freed >= 1 << 20
    assert not stale.exists()
    assert not recycled.exists()
    assert not abandoned.exists()
    for kept in (live_peer, other_run, foreign, starting):
        assert kept.exists(), kept
    # Our own directory held by an owner we cannot see (another host sharing memory_dir).
    foreign_own = NodeMemoryDir(foreign, "r", 3)
    with pytest.raises(StartupCheckError, match=r"cannot see .*another host or PID namespace"):
        foreign_own.reclaim_stale()
    in_progress = NodeMemoryDir(starting, "r", 4)
    with pytest.raises(StartupCheckError, match="being claimed by another process"):
        in_progress.reclaim_stale()


def test_unwritable_memory_dir_is_a_startup_error(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    memory = NodeMemoryDir(blocked / "trainingd-r-0", "r", 0)
    with pytest.raises(StartupCheckError, match=r"memory_dir=.*cannot create trainingd-r-0"):
        memory.claim()
    memory.release()  # nothing claimed, nothing removed
    assert blocked.read_text() == "not a directory"


def test_a_daemon_reclaims_its_killed_predecessor_and_a_stop_leaves_nothing(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    shm = tmp_path / "shm"

    def flags(ckpt: Path) -> list[str]:
        return [
            "--nproc-per-node", "1", "--batch-size", "4", "--warmup-steps", "2", "--max-steps",
            "100000", "--ckpt-every", "2", "--run-id", "memtier", "--memory-dir", str(shm),
            "--ckpt-uri", str(ckpt), *GATED_JOB,
        ]  # fmt: skip

    args = flags(tmp_path / "ckpt")
    mine = shm / "trainingd-memtier-0"

    first_gate = Gate(tmp_path / "gate1", after_steps=2, batch_size=4)
    first = DaemonProc(tmp_path, args, first_gate.env, "first")
    procs.append(first)
    first_gate.wait_until_held(1, first, timeout_s=120)
    owner = json.loads((mine / OWNER_FILE).read_text())
    assert owner["pid"] == first.pid
    assert first.find("memory_budget")[0]["fits"] is True
    # A megabyte more in the tier (ranks write their own slots too; this name is not one of
    # theirs, so the restarted run never recreates it), then the whole session is SIGKILLed:
    # nothing cleans up.
    left = mine / "left-by-the-killed-run.bin"
    left.write_bytes(os.urandom(1 << 20))
    # The named semaphores torch made for the ranks ([Note: a group SIGKILL leaves
    # multiprocessing's semaphores] in semaphores.py): recorded once the ranks started.
    semaphores = json.loads((mine / LEDGER_FILE).read_text())["semaphores"]
    assert semaphores
    assert all(name.startswith("sem.mp-") for name in semaphores)
    first.cleanup(leave_semaphores=True)
    assert (mine / OWNER_FILE).exists()
    shm_dir = Path("/dev/shm")
    assert all((shm_dir / name).exists() for name in semaphores)  # the kill leaves them

    second_gate = Gate(tmp_path / "gate2", after_steps=2, batch_size=4)
    second = DaemonProc(tmp_path, args, second_gate.env, "second")
    procs.append(second)
    second_gate.wait_until_held(1, second, timeout_s=120)
    (reclaimed,) = second.find("memory_tier_reclaimed")
    assert reclaimed["directories"] == [mine.name]
    assert reclaimed["bytes_freed"] >= 1 << 20
    assert reclaimed["semaphores_unlinked"] == len(semaphores)
    assert not any((shm_dir / name).exists() for name in semaphores)
    assert json.loads((mine / OWNER_FILE).read_text())["pid"] == second.pid
    assert not left.exists()

    # The same run and node started again while that daemon lives: refused, exit 2. (Another
    # checkpoint root, so the root's lease does not refuse it first.)
    third = DaemonProc(tmp_path, flags(tmp_path / "ckpt3"), name="third")
    procs.append(third)
    assert third.wait(120) == 2, third.logs()
    assert f"held by a live trainingd, pid {second.pid}" in third.logs()
    assert json.loads((mine / OWNER_FILE).read_text())["pid"] == second.pid

    second.signal(signal.SIGTERM)
    second_gate.open()
    assert second.wait(120) == 128 + signal.SIGTERM, second.logs()
    assert list(shm.iterdir()) == []


def test_with_the_tier_off_a_daemon_still_unlinks_its_killed_predecessors_semaphores(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    # [Note: the semaphore ledger outlives the tier]: torch's launcher makes the semaphores
    # with the tier on or off.
    shm = tmp_path / "shm"

    def args(ckpt: str) -> list[str]:
        # No durable saves, and a root each: the killed daemon's lease on a root it wrote to
        # would hold the second one for its expiry, which has nothing to do with this test.
        return [
            "--nproc-per-node", "2", "--batch-size", "4", "--max-steps", "100000",
            "--ckpt-every", "0", "--run-id", "ledger", "--memory-dir", str(shm),
            "--memory-every", "0", "--ckpt-uri", str(tmp_path / ckpt), *GATED_JOB,
        ]  # fmt: skip

    mine = shm / "trainingd-ledger-0"
    first_gate = Gate(tmp_path / "gate1", after_steps=2, batch_size=4)
    first = DaemonProc(tmp_path, args("ckpt1"), first_gate.env, "first")
    procs.append(first)
    first_gate.wait_until_held(2, first, timeout_s=120)
    assert sorted(p.name for p in mine.iterdir()) == sorted([LEDGER_FILE, OWNER_FILE])
    assert first.max_value("trainingd_memory_tier_bytes") == 0.0
    semaphores = json.loads((mine / LEDGER_FILE).read_text())["semaphores"]
    assert semaphores
    first.cleanup(leave_semaphores=True)
    shm_dir = Path("/dev/shm")
    assert all((shm_dir / name).exists() for name in semaphores)  # the kill leaves them

    second_gate = Gate(tmp_path / "gate2", after_steps=2, batch_size=4)
    second = DaemonProc(tmp_path, args("ckpt2"), second_gate.env, "second")
    procs.append(second)
    second_gate.wait_until_held(2, second, timeout_s=120)
    (reclaimed,) = second.find("memory_tier_reclaimed")
    assert reclaimed["semaphores_unlinked"] == len(semaphores)
    assert not any((shm_dir / name).exists() for name in semaphores)
    second.signal(signal.SIGTERM)
    second_gate.open()
    assert second.wait(120) == 128 + signal.SIGTERM, second.logs()
    assert list(shm.iterdir()) == []
