"""Run a function on N real `torch.distributed` ranks in fresh processes.

`run_on_ranks(fn, world_size)` starts one process per rank (forked from a fork server),
initialises a gloo process group over a free loopback port, calls `fn(rank, world_size, *args)`
and returns the per-rank results (torch-serialised, so tensors come back intact). A rank that
raises fails the call with that rank's traceback; a rank that hangs fails it when the timeout
expires; either way every child is killed so nothing outlives the test.

`fn` must be importable by the children (a module-level function of a test module).

[Note: ranks fork from a server that imported torch] Importing torch (and DCP, FSDP2, DTensor)
costs each rank several CPU seconds, more than most multi-rank tests spend training, and the
suite starts dozens of rank groups on two cores. So the ranks are started by multiprocessing's
`forkserver`, which imports `PRELOAD` once per session, and each rank is a fork of it: a fresh
process with no process group, no threads and none of the parent's test state, as a spawned
one, but with torch already imported. What a fork would otherwise take from the server rather
than from the test that starts it is passed explicitly: the environment, the working directory,
`sys.path`, and stdout/stderr (so a rank's output lands in that test's captured output).
Arguments reach each rank as a `torch.save` copy (`_Copied`), not as shared tensors.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import reduction
from typing import Any

__all__ = ["RankFailedError", "RankTimeoutError", "free_port", "group_store", "run_on_ranks"]

DEFAULT_TIMEOUT_S = 120.0

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "ckpt_manager",
    # The package exports lazily: importing it alone loads none of the engine.
    "ckpt_manager._manager",
    "sharding",
    # The GPT model and loss many rank functions train (the package exports lazily too).
    "daemon.jobs.gpt",
)
"""Modules the fork server imports once, so no rank imports them again (see the Note above)."""


class RankFailedError(RuntimeError):
    """A rank raised; the message carries its traceback."""


class RankTimeoutError(TimeoutError):
    """Some ranks did not finish within the timeout."""


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_store(world_size: int) -> Any:
    """The rendezvous store of a group of `world_size` ranks, bound by the caller.

    [Note: the parent holds the group's port] A port found free and bound later by rank 0 can
    be taken in between by any other process on the machine (seen as EADDRINUSE under a loaded
    suite), so the process that starts the ranks binds the store itself, on a port the kernel
    picks, and keeps the returned object alive for the group's life; each rank (`_child`)
    connects to `.port` as a client.
    """
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False, use_libuv=True
    )


def rank_context() -> Any:
    """The multiprocessing context ranks start in: the session's torch-preloaded fork server."""
    ctx = mp.get_context("forkserver")
    # Only the first call (before the server starts) takes effect; later ones are the same list.
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class _Fd:
    """One of this process's file descriptors, duplicated into a rank as it starts."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled while the rank starts: `DupFd` hands the descriptor to the fork server then.
        return (_Inherited, (reduction.DupFd(self.fd),))


def _torch_loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


class _Copied:
    """A value that reaches the rank as a copy serialised by `torch.save`.

    multiprocessing would share tensors in the arguments through one file descriptor each
    (torch's reductions), and the fork server takes fewer than 256 descriptors per process: a
    state dict of a few hundred tensors could not start a rank. A copy also keeps ranks from
    writing into each other's arguments.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        import torch

        buf = io.BytesIO()
        torch.save(self.value, buf)
        return (_torch_loads, (buf.getvalue(),))


class _Inherited:
    """A descriptor received by the rank (`fd()` takes it over)."""

    def __init__(self, dup: Any) -> None:
        self._dup = dup

    def fd(self) -> int:
        return int(self._dup.detach())


class ParentState:
    """What a rank takes from the test that starts it: environment, directory, path, stdio."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = {**os.environ, **(env or {})}
        self.cwd = os.getcwd()
        self.sys_path = list(sys.path)
        # Each `_Fd` arrives in the rank as an `_Inherited` descriptor.
        self.stdio: tuple[Any, Any] = (_Fd(1), _Fd(2))

    def apply(self) -> None:
        """In the rank: take the parent's state over."""
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        sys.stdout.flush()
        sys.stderr.flush()
        for target, inherited in zip((1, 2), self.stdio, strict=True):
            fd = inherited.fd()
            os.dup2(fd, target)
            os.close(fd)


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    parent: ParentState,
    threads: int,
    results: Any,
    backend: str,
    pg_timeout_s: float,
) -> None:
    parent.apply()
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    import torch
    import torch.distributed as dist

    # Ranks share 2 cores: one thread each keeps them from thrashing.
    torch.set_num_threads(threads)
    try:
        # A client of the store the parent holds ([Note: the parent holds the group's port]).
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size,
            is_master=False,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        # [Note: every rank is connected before any runs] gloo's full-mesh connect can return
        # on one rank while its peer still reads the handshake: a rank whose `fn` returns at
        # once and exits closed the socket under it, and the peer failed in
        # `init_process_group` ("Connection closed by peer") instead of in its own `fn` (a
        # fresh-clone CI run failed `test_rank_exception_surfaces_traceback` that way). NCCL
        # connects lazily, at the first collective, on the device the test picks.
        if backend == "gloo":
            dist.barrier()
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put(("ok", rank, buf.getvalue()))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    threads: int = 1,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh ranks (forked from a fork server).

    Args:
        fn: module-level function; its return value must be `torch.save`-able.
        world_size: number of ranks.
        *args: extra positional arguments, pickled to every rank.
        timeout_s: wall-clock limit for the whole group.
        backend: process-group backend (`gloo` on CPU).
        env: extra environment variables for the children.
        threads: torch intra-op threads per rank.

    Returns:
        The return values, indexed by rank.

    Raises:
        RankFailedError: a rank raised (message holds its traceback).
        RankTimeoutError: not every rank reported within `timeout_s`.
    """
    import torch

    ctx = rank_context()
    results = ctx.Queue()
    server = group_store(world_size)
    port = server.port
    procs = [
        ctx.Process(
            target=_child,
            args=(
                fn,
                rank,
                world_size,
                port,
                _Copied(args),
                ParentState(env),
                threads,
                results,
                backend,
                # A collective stuck on a dead peer must not outlive our own deadline.
                max(5.0, timeout_s),
            ),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, Any] = {}
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise RankTimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s"
                )
            try:
                status, rank, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is not None
                ]
                if dead:
                    # A child that died without reporting (SIGKILL, segfault) cannot report later;
                    # give its queue a moment to drain, then fail.
                    time.sleep(0.5)
                    if results.empty():
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RankFailedError(f"ranks exited without a result: {codes}") from None
                continue
            if status == "error":
                raise RankFailedError(f"rank {rank} failed:\n{payload}")
            outcomes[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if len(outcomes) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        del server
    return [outcomes[r] for r in range(world_size)]
