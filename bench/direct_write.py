"""CPU of one large local write: `O_DIRECT` with `pwrite` against the registered buffer (issue 33).

Writes a `--size-mib` staging-like slab (a memfd mapping, populated) to a new file in
`--dir` with `direct_write.write_at_start` and fsync, `--rounds` times each way, interleaved:
once from a mapping nobody registered (`pwrite`: the kernel pins every page per call) and
once from the same mapping registered with the process's io_uring (`keep_buffer`: pinned
once; [Note: direct writes from registered buffers] in `ckpt_manager/_store/backends/uring.py`).
Reports each way's process CPU per write in memcpys of the slab (memcpy timed in the same
run), its median with a bootstrap 95% interval, and the write rate.

    .venv/bin/python bench/direct_write.py --size-mib 512 --rounds 8
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import tempfile
import time
from typing import Any

from _common import print_json
from _stats import summary

from ckpt_manager._store.backends import direct_write, uring


def _slab(nbytes: int) -> mmap.mmap:
    fd = os.memfd_create("bench-slab", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    mm.write(bytes(range(256)) * (nbytes // 256))
    return mm


def _memcpy_s(nbytes: int, rounds: int = 5) -> float:
    src, dst = bytearray(b"\x01" * nbytes), bytearray(nbytes)
    to, frm = (ctypes.c_char * nbytes).from_buffer(dst), (ctypes.c_char * nbytes).from_buffer(src)
    times = []
    for _ in range(rounds):
        t = time.process_time()
        ctypes.memmove(to, frm, nbytes)
        times.append(time.process_time() - t)
    del to, frm
    return min(times)


def _write_once(folder: str, mm: mmap.mmap) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) of one write and fsync of a new file."""
    path = os.path.join(folder, f"shard-{time.monotonic_ns()}.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(mm)
        cpu, wall = time.process_time(), time.perf_counter()
        direct_write.write_at_start(fd, path, view)
        os.fsync(fd)
        out = time.process_time() - cpu, time.perf_counter() - wall
        view.release()
    finally:
        os.close(fd)
        os.unlink(path)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dir", default=None, help="a folder on the disk to test (default: /tmp)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    nbytes = args.size_mib << 20
    ring = uring.shared_ring()
    plain, kept = _slab(nbytes), _slab(nbytes)
    registered = direct_write.register_buffer(kept)
    memcpy_s = _memcpy_s(nbytes)
    ways: dict[str, list[tuple[float, float]]] = {"pwrite": [], "registered": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for _ in range(args.rounds):
            ways["pwrite"].append(_write_once(folder, plain))
            ways["registered"].append(_write_once(folder, kept))
    direct_write.forget_buffer(kept)
    out: dict[str, Any] = {
        "size_bytes": nbytes,
        "memcpy_s": memcpy_s,
        "memcpy_gib_s": nbytes / memcpy_s / (1 << 30),
        "io_uring": ring is not None,
        "registered": registered,
        "rounds": args.rounds,
    }
    for way, samples in ways.items():
        out[f"{way}_cpu_memcpys"] = summary([cpu / memcpy_s for cpu, _ in samples])
        out[f"{way}_gb_s"] = summary([nbytes / wall / 1e9 for _, wall in samples])
    if args.json:
        print_json(out)
    else:
        print(
            f"memcpy of {args.size_mib} MiB: {memcpy_s * 1e3:.1f} ms; io_uring {ring is not None}, "
            f"registered {registered}"
        )
        for way in ways:
            cpu, rate = out[f"{way}_cpu_memcpys"], out[f"{way}_gb_s"]
            print(
                f"{way:11s} CPU {cpu['median']:.3f} memcpys [{cpu['ci95_lo']:.3f}-"
                f"{cpu['ci95_hi']:.3f}]  {rate['median']:.2f} GB/s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
