"""Reference rates measured on the bench's machine in the same run: memcpy and loopback TCP,
and the daemons' replica path on its own.

The recovery figures are judged against what the machine does at best: a snapshot against one
memcpy of the rank's state, a replica stream against a plain TCP copy of the same bytes over
127.0.0.1 (one sender, one receiver thread: `sendall` of the source, `recv_into` the
destination; [Note: the plain copy moves the same bytes]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

_PIECE = 4 << 20


def memcpy_bytes_per_s(num_bytes: int, repeats: int = 5, *, threads: int | None = None) -> float:
    """Median rate of `dst.copy_(src)` between two preallocated CPU tensors of `num_bytes`,
    with torch's intra-op pool at `threads` (restored after; None: the daemon's default
    `threads_per_rank`, as the bench's ranks run).

    [Note: a memcpy of the rank's state is the rank's own] The step keys count a snapshot's
    cost in memcpys of the rank's state: what it costs that rank to copy its state once. A
    rank copies with the threads it has, `[train] threads_per_rank` (1 by default, as the
    bench's daemons run), so the reference is timed with as many. torch parallelises a
    256 MiB `copy_` over its whole pool: with both of this VM's cores it ran at 11.4-12.7
    GB/s against 6.2-6.6 GB/s on one, a memcpy no rank could make while the other trains
    beside it. `threads=0` times it with torch's default pool (all cores), which the report
    keeps beside it.
    """
    import torch

    from daemon.config import TrainSettings

    if threads is None:
        threads = TrainSettings().threads_per_rank
    before = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        src = torch.ones(num_bytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)  # touch every page once
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return num_bytes / statistics.median(times)


def loopback_tcp_bytes_per_s(
    num_bytes: int, repeats: int = 3, *, shared_memory: bool = True
) -> float:
    """Median rate of copying `num_bytes` from one buffer to another over a fresh TCP
    connection on 127.0.0.1: one `sendall` of the whole source, `recv_into` the destination
    (both allocated and touched first, as a snapshot and a replica slot are).

    [Note: the plain copy moves the same bytes] The buffers are files in /dev/shm, mapped
    shared (`shared_memory`, the default), as a memory-tier slot and a held replica are; or
    anonymous memory. An earlier reference sent one 4 MiB buffer over and over into another
    4 MiB buffer: both stayed in the CPU's cache and the copy never touched the memory a
    replica must (4.3-4.8 GB/s on this VM, `loopback_cached_tcp_bytes_per_s`). Between
    256 MiB buffers in memory this VM copies 1.4-3.3 GB/s from one transfer to the next,
    anonymous or /dev/shm, with `sendfile` or `sendall` alike.
    """
    with (
        _buffer(num_bytes, shared_memory, fill=1) as source,
        _buffer(num_bytes, shared_memory, fill=0) as destination,
    ):

        def receive(conn: socket.socket) -> int:
            got = 0
            while got < num_bytes:
                with destination[got:] as rest:
                    n = conn.recv_into(rest, num_bytes - got)
                if n == 0:
                    break
                got += n
            return got

        rates = [
            _timed_transfer(num_bytes, lambda sock: sock.sendall(source), receive)
            for _ in range(repeats)
        ]
    return statistics.median(rates)


def _timed_transfer(
    num_bytes: int,
    send: Callable[[socket.socket], None],
    receive: Callable[[socket.socket], int],
) -> float:
    """The rate of one transfer on a fresh 127.0.0.1 connection: `send(sender)` while a thread
    runs `receive(accepted)` (which returns the bytes it got), timed to the receiver's end."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = [0]

    def run_receiver() -> None:
        conn, _ = listener.accept()
        with conn:
            received[0] = receive(conn)

    thread = threading.Thread(target=run_receiver, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", listener.getsockname()[1])) as sender:
            t0 = time.perf_counter()
            send(sender)
            thread.join(timeout=120)
            elapsed = time.perf_counter() - t0
    finally:
        listener.close()
    if received[0] != num_bytes:
        raise RuntimeError(f"loopback copy received {received[0]} of {num_bytes} bytes")
    return num_bytes / elapsed


@contextlib.contextmanager
def _buffer(num_bytes: int, shared_memory: bool, fill: int) -> Iterator[memoryview]:
    """`num_bytes` of memory, every page written: a /dev/shm file mapped shared, or not."""
    if not shared_memory:
        with memoryview(bytearray(bytes([fill])) * num_bytes) as view:
            yield view
        return
    with tempfile.TemporaryFile(dir="/dev/shm") as file:
        file.truncate(num_bytes)
        mapped = mmap.mmap(file.fileno(), num_bytes, flags=mmap.MAP_SHARED)
        try:
            with memoryview(mapped) as view:
                view[:] = bytes([fill]) * num_bytes
                yield view
        finally:
            mapped.close()


def loopback_cached_tcp_bytes_per_s(num_bytes: int, repeats: int = 3) -> float:
    """Median rate of sending `num_bytes` as 4 MiB pieces of one buffer into another 4 MiB
    buffer on 127.0.0.1: the kernel's loopback with cache-resident buffers ([Note: the plain
    copy moves the same bytes])."""
    payload = memoryview(bytearray(_PIECE))

    def send(sock: socket.socket) -> None:
        left = num_bytes
        while left > 0:
            piece = payload[: min(left, _PIECE)]
            sock.sendall(piece)
            left -= len(piece)

    def receive(conn: socket.socket) -> int:
        buf, got = bytearray(_PIECE), 0
        while got < num_bytes:
            n = conn.recv_into(buf)
            if n == 0:
                break
            got += n
        return got

    rates = [_timed_transfer(num_bytes, send, receive) for _ in range(repeats)]
    return statistics.median(rates)


def default_streams() -> int:
    """The daemon's default `[checkpoint] memory_replica_streams` (1 before it existed)."""
    from daemon.config import CheckpointSettings

    defaults = {f.name: f.default for f in dataclasses.fields(CheckpointSettings)}
    return int(defaults.get("memory_replica_streams", 1))  # type: ignore[call-overload]


def replica_path_vs_loopback(
    num_bytes: int, rounds: int = 15, streams: int | None = None
) -> dict[str, list[float]]:
    """The peer-replica path alone on this machine, idle, against the plain copy, interleaved:
    `rounds` times, one plain loopback copy of `num_bytes` (`loopback_tcp_bytes_per_s`), then
    one memory-tier snapshot of `num_bytes` made by a real `CheckpointManager` and streamed by
    a `ReplicaSender` to a `ReplicaServer` on 127.0.0.1 (the daemons' code).

    `streams`: the sender's connections (None: the daemon's default `memory_replica_streams`).

    Returns per round: `loopback_bytes_per_s`, `receive_bytes_per_s` (the server's receive
    counters: go-ahead to the last payload byte) and `send_bytes_per_s` (the sender's).

    The bench's 2x1 rounds measure replicas while both nodes' ranks train on this machine's
    cores; this measures what the replica protocol itself moves against the plain copy under
    the same conditions (this VM's rate for one 256 MiB transfer ranges 1.4-3.4 GB/s, so the
    two alternate and the ratio is judged on its interval).
    """
    from pathlib import Path

    import torch

    from ckpt_manager import CheckpointConfig, CheckpointManager, MemoryTierConfig
    from daemon.agent.replica.holdings import ReplicaHoldings
    from daemon.agent.replica.sender import ReplicaSender, Ring
    from daemon.agent.replica.server import ReplicaServer
    from daemon.agent.replica.stats import ReplicaStats

    run_id = "replica-path"
    out: dict[str, list[float]] = {
        "loopback_bytes_per_s": [],
        "receive_bytes_per_s": [],
        "send_bytes_per_s": [],
    }
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, tempfile.TemporaryDirectory() as root:
        local, remote = Path(shm, "local"), Path(shm, "remote")
        local.mkdir()
        remote.mkdir()
        stats_in, stats_out = ReplicaStats(), ReplicaStats()
        holdings = ReplicaHoldings(remote / "replicas", run_id)
        server = ReplicaServer(holdings, str(remote), stats_in, "127.0.0.1", 0)
        sender = ReplicaSender(
            str(local), run_id, node=0, stats=stats_out, streams=streams or default_streams()
        )
        cfg = CheckpointConfig(memory=MemoryTierConfig(str(local)))
        state = {"w": torch.ones(num_bytes // 4, dtype=torch.float32)}
        try:
            with CheckpointManager(root, cfg, run_id=run_id) as manager:
                sender.set_ring(Ring(round=1, target=f"127.0.0.1:{server.port}", ranks=(0,)))
                for step in range(1, rounds + 1):
                    out["loopback_bytes_per_s"].append(loopback_tcp_bytes_per_s(num_bytes, 1))
                    before_in = (stats_in.received_bytes, stats_in.receive_s)
                    before_out = (stats_out.sent_bytes, stats_out.send_s)
                    manager.save(step, state, durable=False)
                    manager.before_optimizer_step()
                    manager.wait_until_finished()
                    deadline = time.monotonic() + 120
                    while stats_in.received_bytes == before_in[0] or stats_out.lag_steps():
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"the replica of step {step} did not arrive")
                        time.sleep(0.01)
                    out["receive_bytes_per_s"].append(
                        (stats_in.received_bytes - before_in[0])
                        / (stats_in.receive_s - before_in[1])
                    )
                    out["send_bytes_per_s"].append(
                        (stats_out.sent_bytes - before_out[0]) / (stats_out.send_s - before_out[1])
                    )
        finally:
            sender.close()
            server.close()
    return out
