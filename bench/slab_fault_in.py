"""What making a slot's mapping on a low-priority thread costs a training thread's allocations.

[Note: a slab is faulted in page by page] in `ckpt_manager/_save/staging.py`. A thread 10 nice
steps down (as the daemon's staging thread) makes 268 MB slot mappings over and over, 0.3 s
apart, while a nice-0 thread (the training thread) allocates, fills and frees a 64 MiB tensor
in a loop (glibc maps and unmaps a block that large each time) and two busy processes keep
both cores of the 2-core VM taken. Per arm, the training thread's iteration times (p50, p99,
max); arms interleaved over `--repeats` passes:

- `page_by_page`: `Slab(..., fd=...)` as the staging thread makes it (a read of one byte per
  page, each fault taking the process's mmap lock for a moment);
- `one_call`: the mapping populated by one `MADV_POPULATE_WRITE` call (what `Slab` did
  before), which holds the lock until every page is in;
- `no_mapping`: the same thread copying memory instead, for the floor of the load itself.

    .venv/bin/python bench/slab_fault_in.py --repeats 2
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import threading
import time
from typing import Any

import _common
import _stats

from ckpt_manager._save import staging

MIB = 1 << 20
SLOT_BYTES = 268 * MIB
ARMS = ("page_by_page", "one_call", "no_mapping")


def _busy(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def _make_mappings(arm: str, stop: threading.Event, ready: threading.Event) -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    ready.set()
    time.sleep(0.5)
    n = 0
    while not stop.is_set():
        if arm == "no_mapping":
            buf = bytearray(8 * MIB)
            for _ in range(30):
                buf[:] = b"\1" * (8 * MIB)
        else:
            path = f"/dev/shm/trainingd-bench-slab-{os.getpid()}-{n}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, SLOT_BYTES)
                if arm == "page_by_page":
                    slab = staging.Slab(n, SLOT_BYTES, fd=os.dup(fd))
                    slab.tensor = None
                    slab.close()
                else:
                    mm = mmap.mmap(fd, SLOT_BYTES, flags=mmap.MAP_SHARED)
                    if not staging._populate_without_the_gil(mm, SLOT_BYTES):
                        raise SystemExit("this kernel has no MADV_POPULATE_WRITE")
                    mm.close()
            finally:
                os.close(fd)
                os.unlink(path)
        n += 1
        time.sleep(0.3)


def _arm(arm: str, seconds: float) -> list[float]:
    import torch

    torch.set_num_threads(1)
    stop = mp.get_context("fork").Event()
    busy = [mp.get_context("fork").Process(target=_busy, args=(stop,)) for _ in range(2)]
    for p in busy:
        p.start()
    halt, ready = threading.Event(), threading.Event()
    maker = threading.Thread(target=_make_mappings, args=(arm, halt, ready))
    maker.start()
    ready.wait()
    times = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            x = torch.empty(64 * MIB, dtype=torch.uint8)
            x.fill_(1)
            del x
            times.append(time.perf_counter() - t0)
    finally:
        halt.set()
        maker.join()
        stop.set()
        for p in busy:
            p.join()
    return times


def _summary(times: list[float]) -> dict[str, float]:
    return {
        "n": len(times),
        "p50_ms": _stats.quantile(times, 0.5) * 1e3,
        "p99_ms": _stats.quantile(times, 0.99) * 1e3,
        "max_ms": max(times) * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved passes")
    parser.add_argument("--seconds", type=float, default=12.0, help="per arm and pass")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    before = _common.machine_conditions()
    passes = []
    for repeat in range(args.repeats):
        order = ARMS if repeat % 2 == 0 else tuple(reversed(ARMS))
        passes.append({arm: _summary(_arm(arm, args.seconds)) for arm in order})
    report = {
        "args": vars(args),
        "machine_before": before,
        "machine_after": _common.machine_conditions(),
        "passes": passes,
    }
    if args.json:
        _common.print_json(report)
        return 0
    rows = [
        [str(i), arm, f"{s['p50_ms']:.1f}", f"{s['p99_ms']:.1f}", f"{s['max_ms']:.1f}", str(s["n"])]
        for i, p in enumerate(passes)
        for arm, s in p.items()
    ]
    print(_common.markdown_table(["pass", "arm", "p50 ms", "p99 ms", "max ms", "n"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
