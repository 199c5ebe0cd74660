"""Workers never outlive their daemon.

[Note: how rank processes and their checkpoint writers die with the daemon]
Each rank makes itself the leader of a new process group (`os.setpgid(0, 0)`) before it starts
anything; everything it spawns afterwards, in particular `ckpt_manager`'s writer processes, stays
in that group (multiprocessing's spawn does not change the group; we rely on ckpt_manager not
calling `setsid`/`setpgid`). Two mechanisms then cover the two ways a run can lose a process:

* The daemon dies (SIGKILL, OOM killer): a `ParentWatch` thread in each rank polls `getppid()`
  every 0.25 s; when the parent changed (the rank was re-parented), it SIGKILLs the rank's whole
  process group, itself included. A rank forked by the daemon's fork server
  (`daemon/agent/fork_server.py`) is the server's child, not the daemon's: it watches the
  lineage daemon -> server -> rank, and acts when either link breaks (the server re-parented
  because the daemon died, or the rank re-parented because the server died). Watching the
  server alone would not do: multiprocessing's server exits only once every process holding
  its "alive" pipe is gone, and each rank holds one, so it outlives a dead daemon as long as
  the ranks do. A thread, not `PR_SET_PDEATHSIG`: the death signal would kill
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

__all__ = [
    "ParentWatch",
    "become_group_leader",
    "group_in_my_session",
    "kill_group",
    "parent_of",
    "pid_alive",
]


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
    """Whether some live process of group `pgid` belongs to this process's session.

    Ranks inherit the daemon's session (`setpgid` keeps it), so this tells a rank group apart
    from an unrelated group that reused a dead rank's pid. Zombies do not count: a rank that
    exited and waits to be reaped by its parent (the fork server reaps on its own schedule) is
    no process left to kill.
    """
    my_sid = str(os.getsid(0))
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            # fields: state, ppid, pgrp, session, ...
            if (
                fields is not None
                and fields[2] == str(pgid)
                and fields[3] == my_sid
                and fields[0] not in ("Z", "X")
            ):
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


def parent_of(pid: int) -> int | None:
    """The parent pid of `pid`, or None when there is no such process."""
    fields = _stat_fields(str(pid))
    return int(fields[1]) if fields is not None else None


class ParentWatch:
    """Kills this process's group when its parent changes (the parent died), or, with
    `expected_grandparent`, when its parent's parent changes.

    Args:
        expected_parent: pid of the supervising parent (the daemon, torchrun's agent, or the
            daemon's fork server).
        interval_s: polling period.
        expected_grandparent: pid the parent's parent must stay (the daemon, when
            `expected_parent` is its fork server); None checks the parent only.
    """

    def __init__(
        self,
        expected_parent: int,
        *,
        interval_s: float = 0.25,
        expected_grandparent: int | None = None,
    ) -> None:
        self._parent = expected_parent
        self._grandparent = expected_grandparent
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="trainingd-parent-watch", daemon=True
        )

    @classmethod
    def of_supervisor(cls, supervisor_pid: int, *, interval_s: float = 0.25) -> ParentWatch:
        """A watch on `supervisor_pid`, this process's parent, or its grandparent when the
        parent is a fork server that `supervisor_pid` started (see the Note above).

        A process whose parent is neither is already orphaned: `start()` kills its group.
        """
        parent = os.getppid()
        if parent != supervisor_pid and parent_of(parent) == supervisor_pid:
            return cls(parent, interval_s=interval_s, expected_grandparent=supervisor_pid)
        return cls(supervisor_pid, interval_s=interval_s)

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
        parent = os.getppid()
        orphaned = parent != self._parent or (
            self._grandparent is not None and parent_of(parent) != self._grandparent
        )
        if orphaned:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._check()
