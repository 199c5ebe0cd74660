"""The supervisor loop: readiness, sd_notify decisions, progress, orphan reaping."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon._lifecycle import group_in_my_session, kill_group, pid_alive
from daemon.agent.notify import Notifier
from daemon.agent.progress import format_progress, read_progress
from daemon.agent.supervisor import Supervisor, derive_phase
from daemon.observe.collector import RankView, SnapshotAggregator
from daemon.observe.state import NodePhase, NodeState, NodeStatus
from daemon.observe.status import StatusBoard
from daemon.rank.telemetry import RankTelemetry
from daemon.rundir.snapshot import RankPhase, snapshot_path, write_snapshot

# What a node shows while all its ranks are in one phase: every `RankPhase` has a row, so a new
# phase cannot fall through to some default.
NODE_PHASE_OF = {
    RankPhase.STARTING: NodePhase.LOADING,
    RankPhase.LOADING: NodePhase.LOADING,
    RankPhase.RESTORING: NodePhase.LOADING,
    RankPhase.TRAINING: NodePhase.TRAINING,
    RankPhase.STOPPING: NodePhase.CHECKPOINTING,
    RankPhase.FINISHING: NodePhase.CHECKPOINTING,
    # In a checkpoint call that lasted (a save waiting for the writer or storage).
    RankPhase.CHECKPOINTING: NodePhase.CHECKPOINTING,
    # Left the group: not saving any more (this read `checkpointing` before), not ready.
    RankPhase.FINISHED: NodePhase.RENDEZVOUS,
    RankPhase.EXITED: NodePhase.RENDEZVOUS,
}


def _views(tmp_path: Path, *phases: RankPhase) -> list[RankView]:
    for k, phase in enumerate(phases):
        tel = RankTelemetry(snapshot_path(tmp_path, k), rank=k, world_size=len(phases))
        tel.set("trainingd_train_step", 7)
        tel.heartbeat(phase)
    return SnapshotAggregator(tmp_path, len(phases)).refresh()


def test_every_rank_phase_has_a_node_phase() -> None:
    assert set(NODE_PHASE_OF) == set(RankPhase)


@pytest.mark.parametrize("phase", list(RankPhase))
def test_node_phase_of_ranks_all_in_one_phase(tmp_path: Path, phase: RankPhase) -> None:
    assert derive_phase(_views(tmp_path, phase, phase), 2) == (NODE_PHASE_OF[phase], 7)


@pytest.mark.parametrize("done", [RankPhase.FINISHED, RankPhase.EXITED])
def test_finished_or_exited_ranks_count_no_more_but_a_saving_peer_does(
    tmp_path: Path, done: RankPhase
) -> None:
    # One rank committed and left, its peer still commits its final save: still checkpointing.
    views = _views(tmp_path, done, RankPhase.FINISHING)
    assert derive_phase(views, 2) == (NodePhase.CHECKPOINTING, 7)
    # Once both left: not checkpointing, and so not ready.
    state = NodeState(local_ranks=2)
    state.update(phase=NodePhase.TRAINING)
    phase, _ = derive_phase(_views(tmp_path, done, done), 2)
    assert phase is NodePhase.RENDEZVOUS
    assert not state.update(phase=phase).ready


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "n.sock")
    sock.bind(path)
    sock.settimeout(0.2)
    yield sock, path
    sock.close()


def _received(sock: socket.socket) -> list[str]:
    out: list[str] = []
    while True:
        try:
            out.extend(sock.recv(4096).decode().splitlines())
        except TimeoutError:
            return out


def test_ready_once_watchdog_only_while_ranks_beat_and_progress_line(
    tmp_path: Path, systemd: tuple[socket.socket, str]
) -> None:
    sock, path = systemd
    state = NodeState(local_ranks=1)
    board = StatusBoard(max_steps=10, ckpt_uri=str(tmp_path), list_checkpoints=list)
    lines: list[str] = []

    class Lines:
        def observe(self, views: list[RankView], status: NodeStatus, now: float) -> None:
            lines.append(format_progress(read_progress(views, status, board)))

        def finish(self) -> None:
            lines.append("finished")

    sup = Supervisor(
        state,
        SnapshotAggregator(tmp_path, 1),
        Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"}),
        heartbeat_timeout_s=30,
        shutdown_timeout_s=60,
        progress=Lines(),
        board=board,
    )
    sup.tick(now=0.0)  # no rank yet: rendezvous, still healthy
    assert state.status().phase is NodePhase.RENDEZVOUS
    tel = RankTelemetry(snapshot_path(tmp_path, 0), rank=0, world_size=1)
    tel.set("trainingd_train_step", 7)
    tel.set("trainingd_train_loss", 2.5)
    tel.inc("trainingd_train_tokens_total", 100)
    tel.heartbeat(RankPhase.TRAINING)
    sup.tick(now=1.0)
    sup.tick(now=1.1)
    assert state.status().ready
    assert state.status().step == 7
    first = _received(sock)
    assert first.count("READY=1") == 1
    assert "WATCHDOG=1" in first
    assert "STATUS=training: step 7, loss 2.5000" in first
    assert "step 7/10 | loss 2.5000 |" in lines[-1]
    # The rank's loop stops beating: no more watchdog pings.
    tel.set("trainingd_rank_heartbeat_timestamp_seconds", time.time() - 3600)
    tel.publish(force=True)
    sup.tick(now=10.0)
    assert "WATCHDOG=1" not in _received(sock)
    # Draining sends EXTEND_TIMEOUT_USEC while the final save runs.
    assert state.request_stop()
    sup.tick(now=20.0)
    assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in _received(sock))


def test_a_short_runs_final_step_counts_though_its_ranks_exited_before_a_tick(
    tmp_path: Path,
) -> None:
    # A 3-step run can train, publish its final step and exit between two ticks: the ranks'
    # last views are the node's progress (it read no step at all before: a CI failure).
    state = NodeState(local_ranks=1)
    sup = Supervisor(
        state,
        SnapshotAggregator(tmp_path, 1),
        Notifier({}),
        heartbeat_timeout_s=30,
        shutdown_timeout_s=60,
    )
    sup.tick(now=0.0)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    tel = RankTelemetry(snapshot_path(tmp_path, 0), rank=0, world_size=1)
    tel.set("trainingd_train_step", 3)
    tel.heartbeat(RankPhase.FINISHED)
    view = SnapshotAggregator(tmp_path, 1).refresh()[0]
    assert view.pid == os.getpid()
    # The rank's process is gone (the pid of a process that exited).
    dead = int(child.stdout)
    assert not pid_alive(dead)
    published = snapshot_path(tmp_path, 0)
    write_snapshot(published, {**json.loads(published.read_text()), "pid": dead})
    assert SnapshotAggregator(tmp_path, 1).refresh()[0].pid == dead
    sup.tick(now=1.0)
    assert state.status().step == 3
    assert state.status().phase is NodePhase.RENDEZVOUS


def test_start_timeout_is_extended_only_while_the_restore_reads(
    tmp_path: Path, systemd: tuple[socket.socket, str]
) -> None:
    sock, path = systemd
    state = NodeState(local_ranks=1)
    sup = Supervisor(
        state,
        SnapshotAggregator(tmp_path, 1),
        Notifier({"NOTIFY_SOCKET": path}),
        heartbeat_timeout_s=3600,
        shutdown_timeout_s=60,
    )
    beats = iter(range(1_000_000))
    tel = RankTelemetry(
        snapshot_path(tmp_path, 0),
        rank=0,
        world_size=1,
        publish_interval_s=0.0,
        clock=lambda: 1.7e9 + next(beats),
    )

    def extensions() -> int:
        return sum(m.startswith("EXTEND_TIMEOUT_USEC=") for m in _received(sock))

    tel.heartbeat(RankPhase.RESTORING)
    sup.tick(now=0.0)
    assert state.status().phase is NodePhase.LOADING
    assert extensions() == 1
    for now in (5.0, 10.0, 15.0):  # every read of the restore beats: extended each time
        tel.heartbeat()
        sup.tick(now=now)
    assert extensions() == 3
    for now in (20.0, 25.0, 30.0, 120.0):  # stuck in a read: no beat, no extension
        sup.tick(now=now)
    assert extensions() == 0
    tel.heartbeat()  # the read returned
    sup.tick(now=125.0)
    assert extensions() == 1
    tel.heartbeat(RankPhase.TRAINING)
    sup.tick(now=130.0)
    assert state.status().ready
    assert extensions() == 0  # training: systemd's start is over, nothing to extend


def test_dead_rank_group_is_killed_with_its_children(tmp_path: Path) -> None:
    # A "rank" that leads its own group and has a child (its checkpoint writer), then dies.
    code = (
        "import os, subprocess, sys, time\n"
        "os.setpgid(0, 0)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert rank.stdout is not None
    writer = int(rank.stdout.readline())
    try:
        assert group_in_my_session(rank.pid)
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(timeout=10)
        assert not pid_alive(rank.pid)
        assert pid_alive(writer)  # orphaned, still in the dead rank's group
        assert kill_group(rank.pid)
        deadline = time.monotonic() + 10
        while pid_alive(writer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(writer)
        assert not kill_group(os.getpgid(0))  # never our own group
    finally:
        for pid in (rank.pid, writer):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_group_of_zombies_is_no_group_to_kill() -> None:
    # A rank that exited and waits for its parent (here: us) to reap it.
    code = "import os; os.setpgid(0, 0)"
    rank = subprocess.Popen([sys.executable, "-c", code])
    try:
        wait = time.monotonic() + 10
        while pid_alive(rank.pid) and time.monotonic() < wait:
            time.sleep(0.02)
        assert not pid_alive(rank.pid)  # a zombie: not reaped yet
        assert not group_in_my_session(rank.pid)
        assert not kill_group(rank.pid)
    finally:
        rank.wait(timeout=10)
