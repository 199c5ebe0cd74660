"""The named semaphores the daemon process holds, recorded so that a successor can unlink them.

[Note: a group SIGKILL leaves multiprocessing's semaphores] torch's elastic agent starts the
ranks through multiprocessing's forkserver (or spawn) context, whose queues and events are
named POSIX semaphores: `/dev/shm/sem.mp-*`, 32 bytes and a tmpfs page each, about 7 per local
rank and round, created by the daemon process. multiprocessing's resource tracker (a child of
the daemon) unlinks them when the daemon exits, even when the daemon alone is SIGKILLed, but a
SIGKILL of the whole process group or cgroup (systemd's `KillMode=control-group`, the OOM
killer's group kill, the bench's node loss) takes the tracker too, and they stay until the
host reboots: 2054 of them in this VM's /dev/shm after a day of test and bench runs, 7 per node
loss. Their names are random, so nothing tells a stale one from another program's; and a
semaphore in use is mapped under a temporary name, so `/proc/*/maps` does not name it either.

So after its ranks start (every round) the daemon records the `sem.mp-*` semaphores it maps,
matched by inode, in its claimed memory-tier directory (`semaphores.json`, written only when
the set changed; the directory is claimed for it with the tier off too: [Note: the semaphore
ledger outlives the tier] in `memory_dir.py`); the successor that reclaims that directory
after the daemon was killed (`memory_dir.py`) unlinks each one that still exists with the
inode recorded. Linux only (`/proc/self/maps`); elsewhere nothing is recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import structlog

__all__ = ["LEDGER_FILE", "held_semaphores", "record_semaphores", "unlink_named", "unlink_recorded"]

log = structlog.get_logger("trainingd.memory")

LEDGER_FILE = "semaphores.json"
"""The record's file name inside the daemon's memory-tier directory."""
_PREFIX = "sem.mp-"
_SHM = Path("/dev/shm")
_MAPS = Path("/proc/self/maps")


def held_semaphores(shm: Path = _SHM, maps: Path = _MAPS) -> dict[str, int]:
    """multiprocessing's named semaphores in `shm` that a process maps (by default this one;
    `maps`: its `/proc/<pid>/maps`): name -> inode."""
    try:
        text = maps.read_text()
        st_shm = os.stat(shm)
    except OSError:
        return {}
    mapped = set()
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(f"{shm}/sem."):
            major, _, minor = fields[3].partition(":")
            with contextlib.suppress(ValueError):
                mapped.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
    if not mapped:
        return {}
    found = {}
    with contextlib.suppress(OSError), os.scandir(shm) as entries:
        for entry in entries:
            if not entry.name.startswith(_PREFIX):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if (st.st_dev, st.st_ino) in mapped and st.st_dev == st_shm.st_dev:
                    found[entry.name] = st.st_ino
    return found


def record_semaphores(directory: Path, previous: dict[str, int] | None) -> dict[str, int]:
    """Record this process's semaphores in `directory` when they changed since `previous`;
    returns what is recorded now. A failure is logged and costs only the record."""
    held = held_semaphores()
    if held == previous:
        return held
    path = directory / LEDGER_FILE
    temp = path.with_name(f"{LEDGER_FILE}.{os.getpid()}.tmp")
    try:
        temp.write_text(json.dumps({"shm": str(_SHM), "semaphores": held}))
        os.replace(temp, path)
    except OSError as err:
        log.warning("semaphore_record_failed", path=str(path), error=str(err))
        with contextlib.suppress(OSError):
            temp.unlink()
        return previous or {}
    return held


def unlink_recorded(directory: Path) -> int:
    """Unlink the semaphores a killed daemon recorded in `directory` that still exist with
    the recorded inode; returns how many."""
    try:
        raw = json.loads((directory / LEDGER_FILE).read_text())
        shm, held = Path(raw["shm"]), dict(raw["semaphores"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return unlink_named(held, shm)


def unlink_named(held: dict[str, int], shm: Path = _SHM) -> int:
    """Unlink each of multiprocessing's semaphores in `held` (name -> inode) that still exists
    in `shm` with that inode; returns how many."""
    unlinked = 0
    for name, inode in held.items():
        if not (isinstance(name, str) and name.startswith(_PREFIX) and "/" not in name):
            continue  # only multiprocessing's names, only in that directory
        path = shm / name
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode:
                path.unlink()
                unlinked += 1
    return unlinked
