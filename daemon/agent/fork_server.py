"""Warm rank starts: ranks fork from a server that has imported torch, trainingd and the job.

A spawned rank is a fresh interpreter that imports torch, `sharding`, `ckpt_manager`, the rank
side of `daemon` and the job before it does anything: seconds of every start and every restart
of the group. With `rank_start = "fork_server"` (the default) the launcher (`elastic.py`) starts
multiprocessing's `forkserver` once per daemon, has it import those modules
(`set_forkserver_preload`), and hands torch's elastic agent the `forkserver` start method: every
rank of every restart and membership round is a fork of that server.

[Note: a forked rank is a spawned rank with its imports done]
What a fork takes from the server rather than from the daemon at the rank's start, and how
each is made what a spawned rank gets:
- imports: the point. The server must never have initialized CUDA (a child forked after
  `cuInit` cannot use the GPU; the child creates its own context) nor run threads besides its
  main one (a fork copies only the forking thread: a pool whose workers vanished can hang the
  child). Importing torch starts numpy's OpenBLAS pool, which shuts itself down before every
  fork (a pthread_atfork handler), so the server has one thread when it forks. `ForkServer.start`
  checks all of this on a first forked process (`_probe`): the server's threads at that fork,
  torch's and the driver's CUDA state as the server recorded them after its imports
  (`_server_state.py`), and which modules it imported (multiprocessing skips one that raises
  ImportError without a word). A job that initializes CUDA or starts threads at import makes
  the daemon fall back to spawn, with a warning that says why.
- environment: the server's is the daemon's when the server started; a spawned rank gets the
  daemon's when it starts. `warm_entry` wraps the rank entry point so that unpickling it in the
  new rank (before torch's wrapper sets the agent's per-rank variables) replaces the environment
  with the daemon's of that moment.
- working directory, `sys.path`, `sys.argv`, `__main__`: multiprocessing's preparation data,
  the same for spawn and forkserver; signal handlers: a fresh interpreter's (the server puts
  its own SIGINT/SIGCHLD handlers back in each child); Python's `random` reseeds itself in a
  forked child, torch's generators are seeded by the rank before the job is built.
- the job module is imported once, in the server, before any rank exists: a job that reads
  per-rank settings (`RANK`, ...) at import must read them in its `build` (or run with
  `rank_start = "spawn"`).
- parent: the server, not the daemon ([Note: how rank processes and their checkpoint writers
  die with the daemon] in `daemon/_lifecycle.py`).

[Note: the server imports while the daemon does] The server is a fresh interpreter whose
imports (torch, the rank side, the job: about 4 s on 2 cores) used to start only once the
daemon had imported torch itself and passed its start-up checks (about 2 s more). `trainingd run`
now `launch`es it first thing, before the daemon's own heavy imports (`daemon/cli.py`:
nothing it imports before that loads torch, `tests/daemon/agent/test_fork_server.py` checks),
so the two import at once; `ForkServer.start` later takes the launched server over (its
`preload_s` counts from the launch) and checks it as before. A daemon that ends before its
launcher takes the server over (a failed start-up check, a run already complete) stops it
with `stop_unclaimed`: the server reads the daemon's exit only after its imports.

The server lives as long as the daemon, one for all rounds: multiprocessing keeps one per
process (and starts a new one, with the same preload, if it died). It is the daemon's child, in
the daemon's process group; it exits once the daemon and every rank it forked are gone (its
"alive" pipe closes), and `ForkServer.close()` stops it when the launcher returns.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Final, NamedTuple

from daemon._lifecycle import parent_of, pid_alive
from daemon.errors import ForkServerError

__all__ = [
    "ForkServer",
    "ServerState",
    "launch",
    "preload_modules",
    "stop_unclaimed",
    "warm_entry",
]

START_METHOD: Final = "forkserver"
"""multiprocessing's (and torch's `start_processes`') name of the start method."""

_STATE_MODULE = "daemon.agent._server_state"
_STOP_TIMEOUT_S = 5.0

Entry = Callable[..., dict[str, Any] | None]
"""A rank entry point, as `elastic.Entry`."""


def preload_modules(job: str, entry_module: str, rank_modules: Sequence[str]) -> list[str]:
    """What the server imports: torch, the rank's modules, the entry's and the job's module.

    Args:
        job: the job, `module:callable` or `path/to/job.py:callable` (a file is loaded by
            each rank, not preloaded: only modules are imported by name).
        entry_module: the module of the rank entry point (`daemon.worker`).
        rank_modules: what the entry imports when it starts (`daemon.worker.RANK_MODULES`).
    """
    where = job.rpartition(":")[0]
    # The same test as `daemon.jobs.job.load_job`'s, which this module cannot import (torch).
    by_name = [] if where.endswith(".py") or "/" in where else [where]
    wanted = ["torch", *rank_modules, entry_module, *by_name, _STATE_MODULE]
    return list(dict.fromkeys(wanted))


class _Launch(NamedTuple):
    modules: tuple[str, ...]
    at: float
    """`time.monotonic()` of the launch."""
    pids: frozenset[int]
    """Children of this process that appeared while `launch` started the server: the server,
    known by its pid before its `exec` shows in /proc ([Note: an unclaimed server is known by
    its pid])."""


class _Pending:
    launch: _Launch | None = None
    """The server `launch` started in this process, until `ForkServer.start` takes it over."""


def launch(modules: Sequence[str]) -> None:
    """Start the server process now, importing `modules`, and return at once.

    Its imports run while the caller goes on ([Note: the server imports while the daemon
    does]); `ForkServer.start` with the same modules takes it over. Call it before this process
    starts threads or imports torch (that is the point) and before anything else uses
    multiprocessing's forkserver.
    """
    ctx = multiprocessing.get_context(START_METHOD)
    ctx.set_forkserver_preload(list(modules))
    started = time.monotonic()
    before = _live_children()
    multiprocessing.forkserver.ensure_running()
    _Pending.launch = _Launch(tuple(modules), started, frozenset(_live_children() - before))


def stop_unclaimed() -> None:
    """Stop a server `launch` started that no `ForkServer.start` took over (idempotent).

    [Note: an unclaimed server is known by its pid] multiprocessing forks the server and
    returns without waiting for its `exec`: until the new program is loaded its /proc cmdline
    is this process's, and empty while the kernel swaps it, so a stop right after the launch
    (a daemon that fails its start-up checks at once) could find no server by its command
    line (a test counting servers that way right after the launch saw none, under load).
    The pids `launch` saw appear are stopped too while they are still our children and not
    yet another program.
    """
    launch, _Pending.launch = _Pending.launch, None
    if launch is None:
        return
    mine = os.getpid()
    starting = {
        pid for pid in launch.pids
        if parent_of(pid) == mine and pid_alive(pid) and _server_or_starting(pid)
    }  # fmt: skip
    _kill_servers(starting | _forkserver_children())


class ServerState(NamedTuple):
    """What the first forked process saw of the server."""

    pid: int
    """The server's pid."""
    threads: tuple[str, ...]
    """Names of the server's threads right after the fork (safe: one)."""
    cuda_initialized: bool
    """torch's CUDA state was initialized in the server."""
    cuda_driver_initialized: bool
    """The CUDA driver was initialized in the server (`cuInit`)."""
    missing: tuple[str, ...]
    """Modules of the preload list the server did not import."""

    def unsafe_reason(self) -> str | None:
        """Why forking this server would break a rank, or None when it is safe."""
        if self.cuda_initialized or self.cuda_driver_initialized:
            what = "torch's CUDA state" if self.cuda_initialized else "the CUDA driver"
            return (
                f"{what} was initialized while the server imported the job, and a forked "
                "rank could not use CUDA; call no CUDA function at import (for "
                "torch.cuda.is_available() set PYTORCH_NVML_BASED_CUDA_CHECK=1)"
            )
        if _STATE_MODULE in self.missing:
            return "the server did not finish its imports"
        if len(self.threads) > 1:
            return (
                f"the server runs {len(self.threads)} threads after its imports "
                f"({', '.join(self.threads)}); something imported starts threads a fork would "
                "leave behind"
            )
        return None


class ForkServer:
    """The daemon's rank fork server, checked safe to fork; `start()` makes one.

    Args:
        state: what the first forked process saw of it.
        preload_s: from the start to the server's first fork (its imports).
    """

    def __init__(self, state: ServerState, preload_s: float) -> None:
        self.state = state
        self.preload_s = preload_s
        self._closed = False

    @property
    def pid(self) -> int:
        """The server's pid."""
        return self.state.pid

    @classmethod
    def start(cls, modules: Sequence[str], *, timeout_s: float) -> ForkServer:
        """Start the server with `modules` imported and check it with a first fork.

        Call it once per process, before anything else uses multiprocessing's forkserver
        (the preload list is that of the first server).

        Raises:
            ForkServerError: it died while importing (its traceback is on stderr), did not
                answer within `timeout_s`, or is not safe to fork (then it is stopped).
        """
        ctx = multiprocessing.get_context(START_METHOD)
        if _Pending.launch is not None and _Pending.launch.modules == tuple(modules):
            started = _Pending.launch.at  # importing since the launch
        else:
            stop_unclaimed()  # launched with another list: it would not import `modules`
            ctx.set_forkserver_preload(list(modules))
            started = time.monotonic()
        _Pending.launch = None
        receive, send = ctx.Pipe(duplex=False)
        probe = ctx.Process(
            target=_probe, args=(send, tuple(modules)), name="trainingd-fork-server-probe"
        )
        try:
            try:
                _start_within(probe, timeout_s)
            finally:
                send.close()  # the probe's copy is its own: EOF here when it dies
            remaining = max(0.0, timeout_s - (time.monotonic() - started))
            state: ServerState | None = None
            if receive.poll(remaining):
                try:
                    state = receive.recv()
                except EOFError:
                    state = None
            probe.join(_STOP_TIMEOUT_S)
        finally:
            receive.close()
        if state is None:
            raise ForkServerError(
                f"the fork server's first process did not report (exit code {probe.exitcode})"
            )
        server = cls(state, preload_s=time.monotonic() - started)
        reason = state.unsafe_reason()
        if reason is not None:
            server.close()
            raise ForkServerError(reason)
        return server

    def close(self) -> None:
        """Stop the server (idempotent), and the one multiprocessing started in its place if
        it died. Ranks it forked that still run lose their parent and end their process
        groups (`daemon/_lifecycle.py`)."""
        if self._closed:
            return
        self._closed = True
        servers = _forkserver_children()
        # Only children of ours: unreaped, so the pid cannot be another process's.
        if parent_of(self.pid) == os.getpid():
            servers.add(self.pid)
        _kill_servers(servers)


def _kill_servers(servers: set[int]) -> None:
    """SIGKILL these fork servers (children of ours) and wait a little for them to go."""
    for pid in servers:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    while any(pid_alive(p) for p in servers) and time.monotonic() < deadline:
        time.sleep(0.01)


_SERVER_COMMAND = b"multiprocessing.forkserver import main"


def _live_children() -> set[int]:
    """This process's live (not zombie) children."""
    me = os.getpid()
    return {
        int(entry) for entry in os.listdir("/proc")
        if entry.isdigit() and parent_of(int(entry)) == me and pid_alive(int(entry))
    }  # fmt: skip


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None  # ended meanwhile


def _server_or_starting(pid: int) -> bool:
    """Whether child `pid` runs the fork server or has not finished its `exec` yet (its
    command line still this process's, or empty mid-exec)."""
    command = _cmdline(pid)
    return command is not None and (
        _SERVER_COMMAND in command or command in (b"", _cmdline(os.getpid()))
    )


def _forkserver_children() -> set[int]:
    """This process's live children that run multiprocessing's fork server (the daemon starts
    no other): multiprocessing names none but the newest, and that one only privately."""
    return {pid for pid in _live_children() if _SERVER_COMMAND in (_cmdline(pid) or b"")}


def _start_within(process: BaseProcess, timeout_s: float) -> None:
    """`process.start()`, which waits for the server's imports, within `timeout_s`."""
    done = threading.Event()
    failures: list[BaseException] = []

    def start() -> None:
        try:
            process.start()
        except BaseException as err:  # handed to the caller below
            failures.append(err)
        finally:
            done.set()

    threading.Thread(target=start, name="trainingd-fork-server-start", daemon=True).start()
    if not done.wait(timeout_s):
        raise ForkServerError(f"the fork server did not finish its imports within {timeout_s} s")
    if failures:
        raise ForkServerError(
            f"the fork server exited while importing ({type(failures[0]).__name__}: "
            f"{failures[0]}); its traceback is on stderr"
        ) from failures[0]


def _probe(conn: Connection, modules: tuple[str, ...]) -> None:
    """In the first forked process: report what it inherited from the server."""
    server = os.getppid()
    recorded = sys.modules.get(_STATE_MODULE)
    conn.send(
        ServerState(
            pid=server,
            threads=_thread_names(server),
            cuda_initialized=bool(getattr(recorded, "CUDA_INITIALIZED", False)),
            cuda_driver_initialized=bool(getattr(recorded, "CUDA_DRIVER_INITIALIZED", False)),
            missing=tuple(m for m in modules if m not in sys.modules),
        )
    )
    conn.close()


def _thread_names(pid: int) -> tuple[str, ...]:
    names = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue  # ended meanwhile
    return tuple(names)


class _WithDaemonEnviron:
    """A rank entry point that brings the daemon's environment of the moment along.

    Pickled once per rank as the rank starts; unpickling it in the rank replaces the
    environment the rank inherited from the fork server ([Note: a forked rank is a spawned
    rank with its imports done]).
    """

    def __init__(self, entry: Entry) -> None:
        self._entry = entry
        # torch names the entry point by `__qualname__` in its logs and error records.
        functools.update_wrapper(self, entry)

    def __call__(self, *args: Any) -> dict[str, Any] | None:
        return self._entry(*args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_with_environ, (dict(os.environ), self._entry))


def _with_environ(environ: dict[str, str], entry: Entry) -> Entry:
    os.environ.clear()
    os.environ.update(environ)
    return entry


def warm_entry(entry: Entry) -> Entry:
    """`entry` for ranks forked from the server: each starts with the daemon's environment of
    its start, as a spawned rank does, then the agent's per-rank variables."""
    return _WithDaemonEnviron(entry)
