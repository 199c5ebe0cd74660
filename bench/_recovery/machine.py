"""Reference rates measured on the bench's machine in the same run: memcpy and loopback TCP.

The recovery figures are judged against what the machine does at best: a snapshot against one
memcpy of the rank's state, a replica stream against a plain TCP copy of the same bytes over
127.0.0.1 (one sender, one receiver thread, `sendall` / `recv_into` of 4 MiB pieces).
"""

from __future__ import annotations

import socket
import statistics
import threading
import time

_PIECE = 4 << 20


def memcpy_bytes_per_s(num_bytes: int, repeats: int = 5) -> float:
    """Median rate of `dst.copy_(src)` between two preallocated CPU tensors of `num_bytes`."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page once
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times)


def loopback_tcp_bytes_per_s(num_bytes: int, repeats: int = 3) -> float:
    """Median rate of sending `num_bytes` over a fresh TCP connection on 127.0.0.1."""
    payload = memoryview(bytearray(_PIECE))
    rates = []
    for _ in range(repeats):
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        received = [0]

        def receive(listener: socket.socket = listener, received: list[int] = received) -> None:
            conn, _ = listener.accept()
            buf = bytearray(_PIECE)
            with conn:
                while received[0] < num_bytes:
                    n = conn.recv_into(buf)
                    if n == 0:
                        break
                    received[0] += n

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        with socket.create_connection(("127.0.0.1", port)) as sender:
            t0 = time.perf_counter()
            left = num_bytes
            while left > 0:
                piece = payload[: min(left, _PIECE)]
                sender.sendall(piece)
                left -= len(piece)
            thread.join(timeout=120)
            elapsed = time.perf_counter() - t0
        listener.close()
        if received[0] != num_bytes:
            raise RuntimeError(f"loopback copy received {received[0]} of {num_bytes} bytes")
        rates.append(num_bytes / elapsed)
    return statistics.median(rates)
