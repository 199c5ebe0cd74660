"""Hang detection: stack-dump parsing, the auto timeout, and a SIGSTOPped rank end to end."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.agent.hang import AUTO_FLOOR_S, HangDetector, process_stopped
from daemon.observe.collector import RankView
from daemon.rundir.progress import ProgressPhase, ProgressWord, progress_path, read_progress
from daemon.rundir.snapshot import RankPhase
from daemon.rundir.stacks import Frame, innermost_frame, parse_stacks, waits_in_collective
from tests.daemon import _spin_job
from tests.daemon._daemon_proc import DaemonProc, wait_for
from tests.support.dist import free_port

_LIB = ("/usr/lib/python3.12", "/venv/lib/python3.12/site-packages")
_DUMP = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 355 in wait
  File "/usr/lib/python3.12/threading.py", line 1010 in run

Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.12/site-packages/torch/distributed/c10d.py", line 2500 in all_reduce
  File "/jobs/my_job.py", line 42 in spin
  File "/src/daemon/rank/loop.py", line 510 in forward_backward
  File "/src/daemon/worker.py", line 170 in run_rank
"""


def test_the_dump_is_parsed_current_thread_first_innermost_frame_first() -> None:
    threads = parse_stacks(_DUMP)
    assert [len(t) for t in threads] == [4, 2]
    assert threads[0][0] == Frame(
        "/venv/lib/python3.12/site-packages/torch/distributed/c10d.py", 2500, "all_reduce"
    )


def test_the_innermost_frame_is_the_jobs_not_a_librarys() -> None:
    frame = innermost_frame(parse_stacks(_DUMP), _LIB)
    assert frame == Frame("/jobs/my_job.py", 42, "spin")
    assert str(frame) == "/jobs/my_job.py:42 in spin"


def test_our_packages_count_as_ours_even_inside_site_packages() -> None:
    dump = _DUMP.replace("/jobs/my_job.py", "/venv/lib/python3.12/site-packages/x/y.py").replace(
        "/src/daemon", "/venv/lib/python3.12/site-packages/daemon"
    )
    frame = innermost_frame(parse_stacks(dump), _LIB)
    assert frame is not None
    assert frame.function == "forward_backward"


def test_a_dump_without_our_frames_names_none() -> None:
    only_lib = "\n".join(_DUMP.splitlines()[:3])
    assert innermost_frame(parse_stacks(only_lib), _LIB) is None


_ENGINE_WAIT = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.12/site-packages/torch/distributed/elastic/timer.py", line 80 in run

Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.12/site-packages/sharding/_comm.py", line 153 in wait
  File "/venv/lib/python3.12/site-packages/sharding/_reduce.py", line 110 in drain
  File "/venv/lib/python3.12/site-packages/torch/autograd/graph.py", line 800 in _engine_run
  File "/jobs/my_job.py", line 30 in loss
  File "/src/daemon/rank/loop.py", line 557 in forward_backward
  File "/src/daemon/worker.py", line 170 in run_rank
"""
_SPIN = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", line 9 in x

Current thread 0x00007f0000000001 (most recent call first):
  File "/jobs/my_job.py", line 12 in spin
  File "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", line 1750 in _call_impl
  File "/src/daemon/rank/loop.py", line 555 in forward_backward
  File "/src/daemon/worker.py", line 170 in run_rank
"""
_READ = """\
Current thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.12/socket.py", line 720 in readinto
  File "/src/ckpt_manager/_local.py", line 50 in read
  File "/src/daemon/rank/loop.py", line 600 in maybe_checkpoint
  File "/src/daemon/worker.py", line 170 in run_rank
"""


@pytest.mark.parametrize(
    ("dump", "waits"),
    [
        (_DUMP, True),  # blocked in a torch.distributed call the job made
        (_ENGINE_WAIT, True),  # the engine's gradient reduction, inside backward
        (_SPIN, False),  # the job's own loop; a torch.distributed thread elsewhere is no wait
        (_READ, False),  # a read from storage
        ("", False),  # no dump at all
    ],
)
def test_a_rank_blocked_in_a_collective_is_told_from_one_stuck_itself(
    dump: str, waits: bool
) -> None:
    assert waits_in_collective(parse_stacks(dump), _LIB) is waits


def test_the_progress_word_round_trips_and_every_mark_changes_it(tmp_path: Path) -> None:
    path = tmp_path / "local-0.progress"
    assert read_progress(path) is None
    word = ProgressWord(path)
    word.mark(ProgressPhase.DATA, 7)
    first = read_progress(path)
    word.mark(ProgressPhase.DATA)
    second = read_progress(path)
    assert first is not None
    assert second is not None
    assert (second.step, second.phase) == (7, ProgressPhase.DATA)
    assert second.sequence == first.sequence + 1
    word.close()


def test_this_process_is_not_stopped_and_the_auto_floor_holds() -> None:
    assert not process_stopped(os.getpid())
    assert AUTO_FLOOR_S == 60.0


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Stand-ins for rank processes: `sleep` that ignores the stack-dump signal."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def _sleeper(started: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    # An ignored signal stays ignored across exec: the stand-in survives the dump request.
    proc = subprocess.Popen(["sh", "-c", "trap '' USR2; exec sleep 60"])
    started.append(proc)
    # Until the shell has set the trap and become `sleep`, a dump request would kill it.
    wait_for(lambda: Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep", 10, "exec")
    return proc


def _view(rank: int, pid: int, restart: int = 0, world_size: int = 2) -> RankView:
    return RankView(
        rank=rank,
        local_rank=rank,
        pid=pid,
        restart=restart,
        world_size=world_size,
        phase=RankPhase.TRAINING,
        counters={},
        gauges={},
        histograms={},
    )


def test_a_stopped_rank_is_the_cause_its_waiting_peer_is_not_and_both_are_killed(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    procs = [_sleeper(sleepers), _sleeper(sleepers)]
    words = [ProgressWord(progress_path(tmp_path, k)) for k in (0, 1)]
    words[0].mark(ProgressPhase.BACKWARD, 45)
    words[1].mark(ProgressPhase.COLLECTIVE, 45)
    os.kill(procs[0].pid, signal.SIGSTOP)
    wait_for(lambda: process_stopped(procs[0].pid), 10, "the stopped state")
    killed: list[int] = []
    detector = HangDetector(
        tmp_path, node=3, hang_timeout_s=3.0, startup_timeout_s=300.0, kill=killed.append
    )
    views = [_view(0, procs[0].pid), _view(1, procs[1].pid)]
    assert detector.observe(views, now=100.0) == []
    assert detector.observe(views, now=102.9) == []
    found = detector.observe(views, now=103.5)
    assert [(h.rank, h.stopped, h.cause) for h in found] == [(0, True, True), (1, False, False)]
    assert sorted(killed) == sorted(p.pid for p in procs)
    ledger = detector.ledger
    assert ledger.hung_ranks() == [0]
    assert (ledger.num_hangs(0), ledger.num_hangs(1), detector.num_hangs) == (1, 0, 1)
    cause, waiter = ledger.last()
    assert (cause.node, cause.phase, cause.step, cause.stopped) == (3, "backward", 45, True)
    assert (waiter.phase, waiter.waiting, waiter.cause) == ("collective", True, False)
    # Declared once: the same stall is not declared again on the next tick.
    assert detector.observe(views, now=110.0) == []
    # The restarted incarnation: hung through start-up and restore, recovered in the loop.
    fresh = [_sleeper(sleepers), _sleeper(sleepers)]
    views = [_view(k, p.pid, restart=1) for k, p in enumerate(fresh)]
    words = [ProgressWord(progress_path(tmp_path, k)) for k in (0, 1)]
    for word in words:
        word.mark(ProgressPhase.RESTORING, 40)
    detector.observe(views, now=111.0)
    assert ledger.hung_ranks() == [0]
    for word in words:
        word.mark(ProgressPhase.FORWARD, 40)
    detector.observe(views, now=112.0)
    assert ledger.hung_ranks() == []
    assert ledger.num_hangs(0) == 1


def test_a_hung_rank_the_node_no_longer_runs_recovers_when_the_new_group_trains(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    procs = [_sleeper(sleepers), _sleeper(sleepers)]
    words = [ProgressWord(progress_path(tmp_path, k)) for k in (0, 1)]
    for word in words:
        word.mark(ProgressPhase.BACKWARD, 9)
    detector = HangDetector(
        tmp_path, node=1, hang_timeout_s=3.0, startup_timeout_s=300.0, kill=lambda pid: None
    )
    views = [_view(k, p.pid) for k, p in enumerate(procs)]
    detector.observe(views, now=0.0)
    detector.observe(views, now=4.0)
    assert detector.ledger.hung_ranks() == [0, 1]  # both stuck outside a collective
    # An elastic round gives this node global ranks 2 and 3; the new group trains.
    fresh = [_sleeper(sleepers), _sleeper(sleepers)]
    renumbered = [
        dataclasses.replace(_view(k, p.pid, restart=1), rank=2 + k) for k, p in enumerate(fresh)
    ]
    words = [ProgressWord(progress_path(tmp_path, k)) for k in (0, 1)]
    detector.observe(renumbered, now=5.0)
    words[0].mark(ProgressPhase.DATA, 9)
    detector.observe(renumbered, now=6.0)
    assert detector.ledger.hung_ranks() == []


def test_a_stall_that_ends_while_the_stacks_are_dumped_is_not_declared(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    # The other node restarted its group: this node's rank, which waited for it, unwinds
    # (its loop marks `exited`) while its daemon waits for the stack dumps.
    procs = [_sleeper(sleepers)]
    word = ProgressWord(progress_path(tmp_path, 0))
    word.mark(ProgressPhase.BACKWARD, 10)
    killed: list[int] = []
    detector = HangDetector(
        tmp_path, node=0, hang_timeout_s=3.0, startup_timeout_s=300.0, kill=killed.append
    )
    views = [_view(0, procs[0].pid)]
    assert detector.observe(views, now=0.0) == []
    # The stand-in ignores the dump request: the detector waits the whole dump time (1 s).
    unwinding = threading.Timer(0.2, lambda: word.mark(ProgressPhase.EXITED, 10))
    unwinding.start()
    try:
        assert detector.observe(views, now=4.0) == []
    finally:
        unwinding.join()
    assert killed == []
    assert detector.ledger.hung_ranks() == []
    assert detector.num_hangs == 0


@pytest.mark.parametrize(("world_size", "named"), [(4, "rank_waiting"), (2, "rank_hung")])
def test_ranks_that_all_wait_in_a_collective_are_waiting_unless_no_other_node_exists(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]], world_size: int, named: str
) -> None:
    procs = [_sleeper(sleepers), _sleeper(sleepers)]
    for k in (0, 1):
        ProgressWord(progress_path(tmp_path, k)).mark(ProgressPhase.COLLECTIVE, 7)
    killed: list[int] = []
    detector = HangDetector(
        tmp_path, node=0, hang_timeout_s=3.0, startup_timeout_s=300.0, kill=killed.append
    )
    views = [_view(k, p.pid, world_size=world_size) for k, p in enumerate(procs)]
    detector.observe(views, now=0.0)
    found = detector.observe(views, now=4.0)
    # The other node's daemon names its own cause; with no other node, the collective hangs.
    assert [h.waiting for h in found] == [True, True]
    assert [r.cause for r in detector.ledger.last()] == [named == "rank_hung"] * 2
    assert detector.ledger.num_hangs(0) == (1 if named == "rank_hung" else 0)
    assert len(killed) == 2  # restarted either way


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(200)
def test_a_sigstopped_rank_is_named_stopped_and_the_group_restarts(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    args = ["--nproc-per-node", "2", "--max-steps", "60", "--ckpt-every", "10"]
    args += ["--ckpt-uri", str(tmp_path / "ckpt"), "--hang-timeout-s", "3"]
    daemon = DaemonProc(tmp_path, args)
    procs.append(daemon)
    # A committed step first, so that the restart has one to restore whatever the stopped
    # rank was doing: stopped in the first snapshot's meta write (seen), its memory tier
    # holds nothing, and without a commit the group would start from scratch.
    wait_for(lambda: daemon.find("ckpt_committed"), 120, "the first commit")
    # Every rank exports both hang families from the start, at 0.
    assert sorted(lab["rank"] for lab, _ in daemon.scrape()["trainingd_rank_hung"]) == ["0", "1"]
    assert daemon.max_value("trainingd_rank_hangs_total") == 0.0
    victim = daemon.rank_pids()[0]
    stopped_at = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    hung = wait_for(lambda: daemon.find("rank_hung"), 30, "rank_hung")
    detected_s = time.monotonic() - stopped_at
    # Detected within the timeout + 2 s (plus the 0.2 s poll and one tick).
    assert detected_s <= 3 + 2 + 0.5, (detected_s, daemon.logs())
    assert len(hung) == 1, daemon.logs()
    assert hung[0]["frame"] == "stopped", daemon.logs()
    assert hung[0]["state"] == "stopped"
    # The group stalled for the timeout; the stopped rank itself may have moved its progress
    # word a little after its waiting peer last did (seen: 2.8 s for the cause, under load).
    stalls = [e["seconds_without_progress"] for e in hung + daemon.find("rank_waiting")]
    assert max(stalls) >= 3, daemon.logs()
    rank = str(hung[0]["rank"])
    # Its peer, blocked in a collective for it, is reported waiting, not as a cause.
    assert [e["rank"] for e in daemon.find("rank_waiting")] == [1 - int(rank)], daemon.logs()
    assert daemon.max_value("trainingd_rank_hangs_total", rank=rank) == 1.0
    _, body = daemon.get("/api/status")
    last = json.loads(body)["hangs"]["last"]
    assert (last[0]["rank"], last[0]["stopped"], last[0]["cause"]) == (int(rank), True, True)
    assert daemon.wait(150) == 0, daemon.logs()
    restored = daemon.find("restored")
    assert restored, daemon.logs()
    assert int(restored[-1]["restart"]) >= 1, daemon.logs()


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(200)
def test_a_rank_spinning_in_the_jobs_code_is_named_by_its_frame_its_peer_waits(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    source = Path(_spin_job.__file__)
    line = next(
        n
        for n, text in enumerate(source.read_text().splitlines(), 1)
        if _spin_job.SPIN_MARK in text and text.lstrip().startswith("while")
    )
    args = ["--nproc-per-node", "2", "--max-steps", "20", "--ckpt-every", "0"]
    args += ["--batch-size", "4", "--ckpt-uri", str(tmp_path / "ckpt"), "--hang-timeout-s", "5"]
    args += ["--job", "tests.daemon._spin_job:build", "--data-prefetch", "0"]
    # Rank 1 spins when it fetches step 11's first sample (its peer blocks in a collective).
    env = {_spin_job.SPIN_RANK_ENV: "1", _spin_job.SPIN_AFTER_SAMPLES_ENV: str(10 * 4)}
    daemon = DaemonProc(tmp_path, args, env=env)
    procs.append(daemon)
    hung = wait_for(lambda: daemon.find("rank_hung"), 150, "rank_hung")
    assert len(hung) == 1, daemon.logs()
    assert hung[0]["rank"] == 1, daemon.logs()
    assert hung[0]["state"] == "running"
    assert hung[0]["phase"] == "data"
    assert hung[0]["step"] == 10
    assert hung[0]["frame"].endswith(f"tests/daemon/_spin_job.py:{line} in _spin"), hung[0]
    # Rank 0 waits for it in a collective (inside forward or backward, or the agreement).
    waiting = daemon.find("rank_waiting")
    assert [e["rank"] for e in waiting] == [0], daemon.logs()
    assert waiting[0]["phase"] in ("forward", "backward", "collective"), waiting[0]
    # [Note: a hang's stacks outlive the restart]: read once the restarted rank 1 has opened
    # (truncated) its own dump file, while the daemon runs (its run directory goes at exit);
    # the hang's dump is where rank_hung points.
    wait_for(
        lambda: [e for e in daemon.find("device_selected") if e["rank"] == 1 and e["restart"]],
        150,
        "rank 1 restarted",
    )
    assert Path(hung[0]["stacks"]).read_text().count("_spin_job.py") >= 1, hung[0]["stacks"]
    assert daemon.wait(150) == 0, daemon.logs()
    assert [int(e["restart"]) for e in daemon.find("restored")][-1] >= 1, daemon.logs()
    assert daemon.find("rank_hung") == hung  # the restarted group trained to the end


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(300)
def test_of_two_daemons_the_node_of_the_stopped_rank_names_it(
    tmp_path: Path, procs: list[DaemonProc]
) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    common = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
        "--rdzv-timeout-s", "120", "--max-steps", "30", "--ckpt-every", "0",
        "--ckpt-uri", str(tmp_path / "ckpt"), "--hang-timeout-s", "5",
    ]  # fmt: skip
    nodes = [
        DaemonProc(tmp_path, [*common, "--node-rank", str(k)], name=f"node{k}") for k in (0, 1)
    ]
    procs.extend(nodes)
    # Rank 0 logs the steps. Node 1's rank is 1 unless the rendezvous ordered the daemons the
    # other way (it sorts them by pid, which a machine that wraps its pids can give node 1 the
    # lower one of).
    wait_for(lambda: nodes[0].find("step") or nodes[1].find("step"), 150, "a first step line")
    (victim,) = nodes[1].rank_pids()
    (started,) = nodes[1].find("training")
    rank = int(started["rank"])
    os.kill(victim, signal.SIGSTOP)
    hung = wait_for(lambda: nodes[1].find("rank_hung"), 60, "rank_hung on node 1")
    both = nodes[0].logs() + nodes[1].logs()
    assert [(e["rank"], e["node"], e["frame"]) for e in hung] == [(rank, 1, "stopped")], both
    assert nodes[1].max_value("trainingd_rank_hangs_total", rank=str(rank)) == 1.0
    # Node 0's rank only waited for it: never named hung there (at most `rank_waiting`).
    assert nodes[0].find("rank_hung") == [], both
    assert all(e["rank"] == 1 - rank for e in nodes[0].find("rank_waiting")), both
    assert nodes[0].max_value("trainingd_rank_hangs_total") == 0.0
    assert [node.wait(200) for node in nodes] == [0, 0], both
    assert nodes[0].find("rank_hung") == [], nodes[0].logs()
