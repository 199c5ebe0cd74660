"""This node's memory-tier directory: claimed by the daemon at start, removed at every exit.

The memory tier's slots live in tmpfs (`memory_dir`, `/dev/shm` by default) under
`<memory_dir>/trainingd-<run_id>-<node_rank>/` (`DaemonConfig.memory_tier_dir`), owned by the
daemon process, not by its ranks: a SIGKILLed rank (or its writer) leaves its slots for the
restarted rank to restore from. Inside it:

    owner.json                  who owns it (`OwnerRecord`), written atomically at the claim.
    rank-<r:05d>.slot-<k>[.json]   the ranks' local slots (ckpt_manager writes them).
    replicas/                   snapshots a peer node streams here (its own sub-layout).
    kept-step.json              the step of the newest replicas held here, which this node's
                                ranks keep (`replica/holdings.py`, ckpt_manager reads it).
    semaphores.json             multiprocessing's named semaphores the daemon holds (a
                                successor unlinks them: `semaphores.py`).

[Note: who may remove a memory-tier directory] tmpfs is RAM: a directory nobody removes
holds its bytes until the host reboots. So the daemon removes its own on every exit it sees
(`run_daemon`'s `finally`, and the second-signal path that exits at once), and a daemon
starting after its predecessor was SIGKILLed reclaims that run's directories whose owner is
provably dead: its pid is gone (or a zombie), or was recycled (another process start time), or
the host rebooted since (another boot id). An owner that may be alive is never touched: on
another host or in another PID namespace (a shared memory_dir), or alive here. When that owner
holds this daemon's own directory (the same run and node rank running twice) the start fails
with exit 2 and says who holds it. A directory without a readable owner record is a claim
in progress for `_CLAIM_GRACE_S`, then stale. Other runs' directories are left alone: only
their own daemons know whether they are coming back.

[Note: the semaphore ledger outlives the tier] The named semaphores a group SIGKILL leaves
(`semaphores.py`) are torch's launcher's, made whether the memory tier is on or off. With the
tier off (`memory_every 0`, or `auto` gone durable-only) the daemon still claims this directory,
for `owner.json` and `semaphores.json` alone (a few KiB; the tier's metrics read 0), so that a
successor reclaims them the same way. Where memory_dir cannot hold it, or another daemon of
this run and node holds it, the daemon starts as before without a ledger and says so in one
line (`semaphore_ledger_not_kept`): the tier being off, nothing else depends on the directory.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import NamedTuple

import structlog

from daemon.agent.semaphores import record_semaphores, unlink_recorded
from daemon.errors import MemoryTierBusyError, StartupCheckError

__all__ = [
    "OWNER_FILE",
    "REPLICAS_DIR",
    "NodeMemoryDir",
    "OwnerRecord",
    "OwnerState",
    "owner_state",
    "this_process_owner",
]

log = structlog.get_logger("trainingd.memory")

OWNER_FILE = "owner.json"
"""The owner record's file name inside a memory-tier directory."""
REPLICAS_DIR = "replicas"
"""Subdirectory holding the snapshots peers stream to this node (`trainingd_memory_tier_bytes`
counts its bytes as `kind="replica"`, everything else as `kind="local"`)."""
_CLAIM_GRACE_S = 60.0
"""How long a directory without a readable owner record counts as a claim in progress."""
_PROC = Path("/proc")


class OwnerRecord(NamedTuple):
    """Who owns a memory-tier directory: enough to tell a live owner from a recycled pid."""

    pid: int
    """The owning daemon's process id."""
    start_ticks: int | None
    """Its start time in clock ticks since boot (`/proc/<pid>/stat` field 22); None when
    `/proc` is not readable."""
    host: str
    """`socket.gethostname()` of the owner."""
    boot_id: str | None
    """The kernel's boot id when the owner started (a reboot frees tmpfs anyway)."""
    pid_namespace: str | None
    """`/proc/self/ns/pid` of the owner: its pid means nothing in another namespace."""
    run_id: str
    """The run the directory belongs to."""
    node_rank: int
    """The node the directory belongs to."""
    created_unix_s: float
    """When it was claimed."""


class OwnerState(enum.StrEnum):
    """What this process can tell about an owner."""

    ALIVE = "alive"
    """Its process runs, with the recorded start time."""
    DEAD = "dead"
    """Provably gone: no such process, a zombie, a recycled pid, or a reboot since."""
    UNKNOWN = "unknown"
    """On another host or in another PID namespace: may be alive, never touched."""


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _stat_fields(pid: int, proc: Path) -> list[str] | None:
    """`/proc/<pid>/stat` from field 3 (state) on, or None when there is no such process."""
    text = _read_text(proc / str(pid) / "stat")
    if text is None:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return text.rsplit(")", 1)[1].split()


def _pid_namespace(proc: Path) -> str | None:
    try:
        return os.readlink(proc / "self" / "ns" / "pid")
    except OSError:
        return None


def this_process_owner(run_id: str, node_rank: int, *, proc: Path = _PROC) -> OwnerRecord:
    """The owner record of this process for `run_id`'s node `node_rank`."""
    pid = os.getpid()
    fields = _stat_fields(pid, proc)
    return OwnerRecord(
        pid=pid,
        start_ticks=int(fields[19]) if fields is not None else None,
        host=socket.gethostname(),
        boot_id=_read_text(proc / "sys" / "kernel" / "random" / "boot_id"),
        pid_namespace=_pid_namespace(proc),
        run_id=run_id,
        node_rank=node_rank,
        created_unix_s=time.time(),
    )


def owner_state(owner: OwnerRecord, *, proc: Path = _PROC) -> OwnerState:
    """Whether `owner` is alive, provably dead, or out of this process's sight.

    See [Note: who may remove a memory-tier directory].
    """
    if owner.host != socket.gethostname():
        return OwnerState.UNKNOWN
    boot = _read_text(proc / "sys" / "kernel" / "random" / "boot_id")
    if boot is not None and owner.boot_id is not None and boot != owner.boot_id:
        return OwnerState.DEAD
    here = _pid_namespace(proc)
    if here is not None and owner.pid_namespace is not None and here != owner.pid_namespace:
        return OwnerState.UNKNOWN
    fields = _stat_fields(owner.pid, proc)
    if fields is None:
        if proc.joinpath("self").exists():
            return OwnerState.DEAD
        try:  # no /proc (not Linux): only whether the pid exists
            os.kill(owner.pid, 0)
        except ProcessLookupError:
            return OwnerState.DEAD
        except PermissionError:
            return OwnerState.ALIVE
        return OwnerState.ALIVE
    if fields[0] in ("Z", "X"):  # killed, not yet reaped by its parent
        return OwnerState.DEAD
    if owner.start_ticks is not None and int(fields[19]) != owner.start_ticks:
        return OwnerState.DEAD  # the pid was recycled by another process
    return OwnerState.ALIVE


def _read_owner(directory: Path) -> OwnerRecord | None:
    text = _read_text(directory / OWNER_FILE)
    if text is None:
        return None
    try:
        doc = json.loads(text)
        return OwnerRecord(**{f: doc[f] for f in OwnerRecord._fields})
    except (ValueError, TypeError, KeyError):
        return None


def _disk_bytes(directory: Path, skip: str = "") -> int:
    """Bytes the files under `directory` hold (allocated blocks: what tmpfs frees), but for
    a top-level file named `skip`."""
    total = 0
    for base, _dirs, files in os.walk(directory):
        for name in files:
            if name == skip and base == str(directory):
                continue
            try:
                total += os.lstat(os.path.join(base, name)).st_blocks * 512
            except OSError:
                continue
    return total


def _describe(owner: OwnerRecord) -> str:
    return f"pid {owner.pid} on host {owner.host} (run {owner.run_id!r}, node {owner.node_rank})"


@dataclasses.dataclass(frozen=True)
class _Found:
    path: Path
    owner: OwnerRecord | None
    state: OwnerState


class NodeMemoryDir:
    """The memory-tier directory of one daemon: claim, measure, release.

    Args:
        path: `DaemonConfig.memory_tier_dir` (`<memory_dir>/trainingd-<run_id>-<node_rank>`).
        run_id: the run; directories of other runs are never touched.
        node_rank: this daemon's node rank (recorded in the owner file).
        proc: the proc filesystem (tests point it elsewhere).
    """

    def __init__(self, path: Path, run_id: str, node_rank: int, *, proc: Path = _PROC) -> None:
        self.path = Path(path)
        self._run_id, self._node_rank = run_id, node_rank
        self._proc = proc
        self._held = False
        """The directory is this daemon's (claimed, not yet released)."""
        self._tier = False
        """...and holds the memory tier (not only the semaphore ledger)."""
        self._semaphores: dict[str, int] | None = None

    @property
    def root(self) -> Path:
        """The configured `memory_dir`."""
        return self.path.parent

    def _this_run(self) -> list[_Found]:
        """This run's directories under `memory_dir` (any node rank), with their owners."""
        prefix = f"trainingd-{self._run_id}-"
        found = []
        try:
            entries = [e for e in self.root.iterdir() if e.name.startswith(prefix)]
        except FileNotFoundError:
            return []
        except OSError as err:
            raise StartupCheckError(
                f"memory_dir={str(self.root)!r}: cannot list it ({err.strerror}); give a "
                "readable, writable memory-backed directory"
            ) from None
        for entry in entries:
            # `<prefix><node rank>` only: run `a` must not take run `a-1`'s directories.
            if not entry.name.removeprefix(prefix).isdigit() or not entry.is_dir():
                continue
            owner = _read_owner(entry)
            if owner is not None:
                state = owner_state(owner, proc=self._proc)
            else:
                try:
                    age_s = time.time() - entry.stat().st_mtime
                except OSError:
                    continue
                state = OwnerState.UNKNOWN if age_s < _CLAIM_GRACE_S else OwnerState.DEAD
            found.append(_Found(entry, owner, state))
        return found

    def reclaim_stale(self) -> int:
        """Remove this run's directories whose owner is provably dead; refuse a live own one.

        Logs one line (`memory_tier_reclaimed`: directories and bytes freed) when anything was
        removed.

        Returns:
            Bytes freed.

        Raises:
            MemoryTierBusyError: this daemon's own directory belongs to a process that may be
                alive (the same run and node rank started twice).
            StartupCheckError: memory_dir cannot be listed.
        """
        freed, removed, semaphores = 0, [], 0
        for found in self._this_run():
            if found.state is not OwnerState.DEAD:
                if found.path == self.path:
                    raise MemoryTierBusyError(self._busy(found))
                continue
            num_bytes = _disk_bytes(found.path)
            # [Note: a group SIGKILL leaves multiprocessing's semaphores] in semaphores.py.
            semaphores += unlink_recorded(found.path)
            shutil.rmtree(found.path, ignore_errors=True)
            if not found.path.exists():
                freed += num_bytes
                removed.append(found.path.name)
        if removed:
            log.warning(
                "memory_tier_reclaimed",
                memory_dir=str(self.root),
                directories=removed,
                bytes_freed=freed,
                semaphores_unlinked=semaphores,
                reason="their daemon is gone (killed without cleaning up)",
            )
        return freed

    def _busy(self, found: _Found) -> str:
        where = f"memory_dir={str(self.root)!r}: {found.path.name}"
        if found.owner is None:
            return (
                f"{where} is being claimed by another process right now (no owner record yet); "
                "another daemon of this run and node is starting: stop it, or give this one "
                "another --run-id, --node-rank or --memory-dir"
            )
        if found.state is OwnerState.ALIVE:
            held = f"is held by a live trainingd, {_describe(found.owner)}"
        else:
            held = (
                f"is held by {_describe(found.owner)}, whose liveness this process cannot see "
                "(another host or PID namespace sharing memory_dir)"
            )
        return (
            f"{where} {held}; the same run and node cannot run twice: stop that daemon, or "
            "give this one another --run-id, --node-rank or --memory-dir"
        )

    def claim(self, *, tier: bool = True) -> None:
        """Create the directory with this process's owner record (after `reclaim_stale`).

        Args:
            tier: the memory tier's directory (True), or the semaphore ledger's alone, with
                the tier off ([Note: the semaphore ledger outlives the tier]).

        Raises:
            MemoryTierBusyError: another process claimed the directory first.
            StartupCheckError: memory_dir is not writable.
        """
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.path.mkdir(mode=0o700)  # atomic: of two daemons claiming it, one fails here
        except FileExistsError:
            if not self.root.is_dir():
                raise StartupCheckError(self._cannot_create("not a directory")) from None
            owner = _read_owner(self.path)
            found = _Found(self.path, owner, OwnerState.ALIVE)
            raise MemoryTierBusyError(self._busy(found)) from None
        except OSError as err:
            reason = err.strerror or type(err).__name__
            raise StartupCheckError(self._cannot_create(reason)) from None
        self._held, self._tier = True, tier
        record = this_process_owner(self._run_id, self._node_rank, proc=self._proc)
        tmp = self.path / f".{OWNER_FILE}.tmp"
        tmp.write_text(json.dumps(record._asdict()))
        os.replace(tmp, self.path / OWNER_FILE)
        if tier:
            log.info("memory_tier_claimed", directory=str(self.path))
        else:
            log.debug("semaphore_ledger_claimed", directory=str(self.path))

    def _cannot_create(self, reason: str) -> str:
        return (
            f"memory_dir={str(self.root)!r}: cannot create {self.path.name} ({reason}); give "
            "a writable memory-backed directory, or memory_every 0"
        )

    @property
    def claimed(self) -> bool:
        """Whether this daemon claimed the directory for the memory tier (the tier is on)."""
        return self._tier

    @property
    def held(self) -> bool:
        """Whether the directory is this daemon's, for the tier or the semaphore ledger alone."""
        return self._held

    def record_semaphores(self) -> None:
        """Record the named semaphores this process holds now (after its ranks started), for a
        successor to unlink if this daemon is killed ([Note: a group SIGKILL leaves
        multiprocessing's semaphores] in `semaphores.py`); nothing unless held."""
        if self._held:
            self._semaphores = record_semaphores(self.path, self._semaphores)

    def release(self) -> None:
        """Remove the directory and everything in it (idempotent; only if claimed here)."""
        if not self._held:
            return
        self._held = self._tier = False
        shutil.rmtree(self.path, ignore_errors=True)

    def tier_bytes(self) -> dict[str, float]:
        """Bytes the tier holds now, by kind (`local`, `replica`): the metric's values (none
        where the directory holds the semaphore ledger alone)."""
        if not self._tier:
            return {"local": 0.0, "replica": 0.0}
        replica = _disk_bytes(self.path / REPLICAS_DIR)
        # The owner record is the daemon's bookkeeping, not the tier's.
        local = _disk_bytes(self.path, skip=OWNER_FILE) - replica
        return {"local": float(max(local, 0)), "replica": float(replica)}
