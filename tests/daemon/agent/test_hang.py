"""Hang detection: stack-dump parsing, the auto timeout, and a SIGSTOPped rank end to end."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from daemon.agent.hang import AUTO_FLOOR_S, process_stopped
from daemon.rundir.progress import ProgressPhase, ProgressWord, read_progress
from daemon.rundir.stacks import Frame, innermost_frame, parse_stacks
from tests.daemon._daemon_proc import DaemonProc, wait_for

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
    wait_for(lambda: daemon.find("step"), 120, "a first step line")
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
    assert hung[0]["seconds_without_progress"] >= 3
    assert daemon.wait(150) == 0, daemon.logs()
    assert [int(e["restart"]) for e in daemon.find("restored")][-1] >= 1, daemon.logs()
