"""Workers never outlive their daemon.

[Note: how rank processes and their checkpoint writers die with the daemon]
Each rank makes itself the leader of a new process group (`os.setpgid(0, 0)`) before it starts
anything; everything it spawns afterwards, in particular `ckpt_manager`'s writer processes, stays
in that group (multiprocessing's spawn does not change the group; we rely on ckpt_manager not
calling `setsid`/`setpgid`). Two mechanisms then cover the two ways a run can lose a process:

* The daemon dies (SIGKILL, OOM killer): a `ParentWatch` thread in each rank polls `getppid()`
  every 0.25 s; when the parent changed (the rank was re-parented), it SIGKILLs the rank's whole
  process group, itself included. A thread, not `PR_SET_PDEATHSIG`: the death signal would kill
  only the rank and orphan its writers, and a Python handler for it cannot run while the main
  thread sits in a C++ collective. The thread is independent of the GIL-holding main thread
  because torch's collectives release the GIL. Bound: 0.25 s plus scheduling, far below 10 s.
* One rank dies (SIGKILL, crash) while the daemon lives: the elastic agent restarts the group,
  but the dead rank's writers would survive it. The daemon's supervisor learns each rank's pid
  (= its group id) from the rank snapshots and SIGKILLs the group of every rank that is no longer
  alive (`reap_dead_groups`), before the restarted ranks write to the same checkpoint root.
  The daemon also kills every known group on exit.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["ParentWatch", "become_group_leader", "group_in_my_session", "kill_group", "pid_alive"]


def become_group_leader() -> None:
    """Put this process (and its future children) into a new process group it leads."""
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)


def pid_alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    # The state follows the parenthesised command name, which may contain spaces.
    fields = _stat_fields(str(pid))
    return fields is not None and fields[0] not in ("Z", "X")


def _stat_fields(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def group_in_my_session(pgid: int) -> bool:
    """Whether some process of group `pgid` belongs to this process's session.

    Ranks inherit the daemon's session (`setpgid` keeps it), so this tells a rank group apart
    from an unrelated group that reused a dead rank's pid.
    """
    my_sid = str(os.getsid(0))
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            # fields: state, ppid, pgrp, session, ...
            if fields is not None and fields[2] == str(pgid) and fields[3] == my_sid:
                return True
    return False


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal every process of rank group `pgid`; False when there is no such group of ours."""
    if pgid <= 1 or pgid == os.getpgid(0) or not group_in_my_session(pgid):
        return False  # never our own group, never init's, never a stranger's
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class ParentWatch:
    """Kills this process's group when its parent changes (the parent died).

    Args:
        expected_parent: pid of the supervising parent (the daemon, or torchrun's agent).
        interval_s: polling period.
    """

    def __init__(self, expected_parent: int, *, interval_s: float = 0.25) -> None:
        self._parent = expected_parent
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="trainingd-parent-watch", daemon=True
        )

    def start(self) -> ParentWatch:
        """Start watching (checks once synchronously first: the parent may already be gone)."""
        self._check()
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching (normal exit)."""
        self._stop.set()
        self._thread.join(timeout=2 * self._interval_s + 1)

    def _check(self) -> None:
        if os.getppid() != self._parent:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._check()
