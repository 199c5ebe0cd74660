"""The lease on a checkpoint root: refused while live, taken over after expiry, fencing.

The holders are real processes on the same root; faults come from outside (SIGSTOP/SIGCONT,
a pid that has exited), never from patching our code.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, LeaseHeldError
from ckpt_manager._format.layout import MANIFEST_NAME, shard_file_name, step_dir
from ckpt_manager._store.lease import LEASE_NAME, read_lease
from tests.ckpt_manager._states import wait_until

TTL_S = 2.0

# The first launch: commits step 1, then leaves step 2 in flight (its writer stalls after
# writing a partial temp object), says "ready" and holds the root, refreshing its lease.
# When the file "commit" appears it waits for step 2 and reports how that ended.
_HOLDER = """
import pathlib, sys, time, torch
from ckpt_manager import CheckpointConfig, CheckpointManager
root, flags, ttl = sys.argv[1], pathlib.Path(sys.argv[2]), float(sys.argv[3])
mgr = CheckpointManager(root, CheckpointConfig(lease_ttl_s=ttl), run_id="job")
mgr.save(1, {"t": torch.zeros(4)})
mgr.wait_until_finished()
mgr.save(2, {"t": torch.ones(4)})
mgr.before_optimizer_step()
(flags / "ready").write_text("ready")
deadline = time.monotonic() + 300
while not (flags / "commit").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
try:
    mgr.wait_until_finished()
    print("OUTCOME committed", flush=True)
except Exception as err:
    print(f"OUTCOME {type(err).__name__}: {err} | cause {err.__cause__!r}", flush=True)
mgr.close()
"""

# A second launch of the same job (same run id): holds the root until "done" appears.
_SECOND = """
import pathlib, sys, time
from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, LeaseHeldError
root, flags, ttl = sys.argv[1], pathlib.Path(sys.argv[2]), float(sys.argv[3])
cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, lease_ttl_s=ttl)
t0 = time.monotonic()
try:
    mgr = CheckpointManager(root, cfg, run_id="job")
except LeaseHeldError as err:
    print(f"REFUSED after {time.monotonic() - t0:.2f} s: {err}", flush=True)
    sys.exit(3)
print(f"TOOK after {time.monotonic() - t0:.2f} s", flush=True)
(flags / "took").write_text("took")
deadline = time.monotonic() + 300
while not (flags / "done").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
mgr.close()
"""


def _python(script: str, *args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


@pytest.fixture
def holder(
    request: pytest.FixtureRequest, tmp_path: pathlib.Path
) -> Iterator[tuple[str, pathlib.Path, subprocess.Popen[str]]]:
    """The first launch, ready: step 1 committed, step 2 in flight (its writer stalls for
    `request.param` seconds), lease refreshed."""
    root, flags = str(tmp_path / "root"), tmp_path / "flags-1"
    flags.mkdir()
    env = {**os.environ, "CKPT_MANAGER_WRITER_FAULT": f"stall={request.param}@2"}
    proc = _python(_HOLDER, root, str(flags), str(TTL_S), env=env, start_new_session=True)
    try:
        wait_until(lambda: (flags / "ready").exists() or proc.poll() is not None, 120)
        # "ready" comes before the writer's stall fault has renamed its partial object into
        # place; a test comparing the folder before and after must not see that rename.
        partial = pathlib.Path(root) / step_dir(2) / f"{shard_file_name(0)}.partial"
        wait_until(lambda: partial.exists() or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.communicate()[0]
        yield root, flags, proc
    finally:
        # Its whole group: the stalled writer child too, which holds our stdout pipe.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)


def _stop_outside_the_lock(pid: int, root: str) -> None:
    """SIGSTOP `pid` at a moment it does not hold the root's lease lock.

    A holder stopped inside its conditional write (a read and a rename under the folder's
    `flock`: [Note: the lease lock covers a read and a rename]) keeps every other process
    from writing the lease until it runs again; a refresh's fsyncs were inside it until they
    moved out, and under load one CI run stopped the holder there. This test is about a
    holder stopped between refreshes, so it stops it again until the lock is free.
    """
    for _ in range(500):
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: _state(pid) in ("T", "t"), 10)
        fd = os.open(root, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return  # free, and the holder cannot take it while stopped (closing releases it)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError(f"process {pid} held the lease lock at each of 500 stops")


def _state(pid: int) -> str:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def _in_flight(root: str) -> list[str]:
    folder = pathlib.Path(root) / step_dir(2)
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.mark.parametrize("holder", [60], indirect=True)
def test_a_second_launch_is_refused_while_the_holder_refreshes(
    holder: tuple[str, pathlib.Path, subprocess.Popen[str]], tmp_path: pathlib.Path
) -> None:
    root, _, first = holder
    before = _in_flight(root)
    assert before, "the first launch has no step in flight"
    flags = tmp_path / "flags-2"
    flags.mkdir()
    (flags / "done").write_text("done")  # should it take the lease, it lets go at once
    second = _python(_SECOND, root, str(flags), str(TTL_S))
    out = second.communicate(timeout=120)[0]
    assert second.returncode == 3, (out, _in_flight(root), before)
    # Named: run id, host, pid, last refresh; and refused fast (it saw a refresh).
    assert f"run 'job' (host {socket.gethostname()}, pid {first.pid}, refresh #" in out
    assert "last refresh 20" in out
    assert float(out.split("REFUSED after ", 1)[1].split(" s", 1)[0]) < TTL_S
    # The first launch's in-flight step is untouched, and it still holds the root.
    assert _in_flight(root) == before
    doc = read_lease(_storage(root))
    assert doc is not None
    assert doc["pid"] == first.pid


def _storage(root: str) -> Any:
    from ckpt_manager._store.storage import Storage

    return Storage(root)


@pytest.mark.parametrize("holder", [1], indirect=True)
def test_b_a_stopped_holder_is_taken_over_after_a_ttl_and_is_fenced(
    holder: tuple[str, pathlib.Path, subprocess.Popen[str]], tmp_path: pathlib.Path
) -> None:
    root, first_flags, first = holder
    _stop_outside_the_lock(first.pid, root)
    flags = tmp_path / "flags-2"
    flags.mkdir()
    second = _python(_SECOND, root, str(flags), str(TTL_S))
    try:
        wait_until(lambda: (flags / "took").exists() or second.poll() is not None, 120)
        assert second.poll() is None, second.communicate()[0]
        # Only after a whole ttl of its own observation (the holder's count did not move).
        assert read_lease(_storage(root))["pid"] == second.pid  # type: ignore[index]
        os.kill(first.pid, signal.SIGCONT)
        (first_flags / "commit").write_text("go")
        out = first.communicate(timeout=120)[0]
    finally:
        (flags / "done").write_text("done")
        took = second.communicate(timeout=120)[0]
    assert float(took.split("TOOK after ", 1)[1].split(" s", 1)[0]) >= TTL_S
    assert "OUTCOME SaveFailedError" in out, out
    assert "LeaseLostError" in out
    assert f"pid {second.pid}" in out  # names the new holder
    assert not (pathlib.Path(root) / step_dir(2) / MANIFEST_NAME).exists()


def test_lease_is_conditional_and_released(tmp_path: pathlib.Path) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, lease_ttl_s=1.0)
    with CheckpointManager(str(tmp_path), cfg, run_id="first"):
        first = json.loads((tmp_path / LEASE_NAME).read_text())
        assert first["run_id"] == "first"
        assert first["pid"] == os.getpid()

        def refreshed() -> bool:
            doc = read_lease(_storage(str(tmp_path)))
            return doc is not None and doc["refresh_count"] > first["refresh_count"]

        wait_until(refreshed, timeout_s=10)
        time.sleep(1.2)  # past one ttl: still live, because it keeps being refreshed
        # The same process, another manager (even with the same run id): refused.
        for run_id in ("intruder", "first"):
            with pytest.raises(LeaseHeldError, match=r"run 'first' \(host .*pid"):
                CheckpointManager(str(tmp_path), cfg, run_id=run_id)
    # Released, not deleted: the next run takes it at once.
    assert json.loads((tmp_path / LEASE_NAME).read_text())["released"] is True
    assert read_lease(_storage(str(tmp_path))) is None
    t0 = time.monotonic()
    CheckpointManager(str(tmp_path), cfg, run_id="next").close()
    assert time.monotonic() - t0 < 1.0


def _own_place() -> dict[str, Any]:
    """Host, boot id and PID namespace as a holder in this process writes them."""
    from ckpt_manager._store.lease import Lease

    doc = json.loads(Lease(_storage("/tmp"), "probe", 1.0)._doc())
    return {k: doc[k] for k in ("host", "boot_id", "pid_ns")}


def test_dead_holder_here_is_taken_over_at_once_elsewhere_after_expiry(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, lease_ttl_s=1.0)
    dead = subprocess.Popen(["true"])
    dead.wait()
    here = _own_place()
    base = {"run_id": "old", "acquired_unix_s": 0, "refreshed_unix_s": time.time(), "ttl_s": 1}
    cases = [
        ({**here, "pid": dead.pid}, False),  # provably dead: same host, boot, namespace
        ({**here, "pid_ns": "pid:[1]", "pid": dead.pid}, True),  # another PID namespace
        ({"host": "elsewhere", "pid": 1}, True),  # another host: only expiry
    ]
    for holder, waits in cases:
        (tmp_path / LEASE_NAME).write_text(json.dumps({**base, **holder}))
        t0 = time.monotonic()
        CheckpointManager(str(tmp_path), cfg, run_id="new").close()
        took = time.monotonic() - t0
        assert (took >= 1.0) is waits, (holder, took)
    takeovers = [e for e in log_events if e["event"] == "ckpt_lease_taken_over"]
    assert len(takeovers) == 3


def test_start_up_check_passes_only_a_node_joining_the_holders_run(tmp_path: pathlib.Path) -> None:
    from ckpt_manager import check_root_lease

    # The holder refreshes every ttl / 3 on a thread: a short ttl on a loaded machine (a
    # parallel test run) can starve that thread past the ttl and make a live holder look gone.
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, lease_ttl_s=3.0)
    with CheckpointManager(str(tmp_path), cfg, run_id="job"):
        with pytest.raises(LeaseHeldError, match=r"run 'job'"):
            check_root_lease(str(tmp_path))
        with pytest.raises(LeaseHeldError, match=r"run 'job'"):
            check_root_lease(str(tmp_path), joining_run_id="another-job")
        # A node rejoining an elastic run finds the lease held by that run's coordinator.
        check_root_lease(str(tmp_path), joining_run_id="job")
