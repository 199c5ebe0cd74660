"""How fast a CUDA snapshot's slab is checksummed as it lands, by checksum threads (no GPU).

A CUDA save's bytes reach the pinned slab by DMA; the host's one job is the CRC-32C, handed to
up to 4 threads part by part as the copy's progress marks pass ([Note: the CUDA checksum
overlaps the copy] in `ckpt_manager/_save/landed_checksums.py`). This times that host side
alone: a populated `--size-mib` slab "lands" in 32 MiB marks, as fast as the threads take the
parts, for 1..`--max-threads` threads, in interleaved rounds (wall GB/s, median and min-max).
On a GPU host the staging rate is about the slower of this and the device-to-host copy.

    .venv/bin/python bench/landed_checksums.py [--size-mib 1024] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import _common
from _common import MIB

from ckpt_manager._save.landed_checksums import PART_BYTES, LandedChecksums, checksum_threads
from ckpt_manager._save.staging import Slab


def _time(slab: Slab, nbytes: int, threads: int) -> float:
    sums = LandedChecksums(slab, nbytes, nbytes, None, threads=threads)
    start = time.perf_counter()
    try:
        for upto in range(PART_BYTES, nbytes + PART_BYTES, PART_BYTES):
            sums.landed(upto)
        sums.finish()
    finally:
        sums.close()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-threads", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    nbytes = args.size_mib * MIB
    slab = Slab(0, nbytes)
    assert slab.tensor is not None
    slab.tensor.fill_(7)
    counts = list(range(1, args.max_threads + 1))
    rates: dict[int, list[float]] = {n: [] for n in counts}
    _time(slab, nbytes, max(counts))  # warm-up: the pool's threads, the slab's pages
    for r in range(args.rounds):
        for n in counts if r % 2 == 0 else reversed(counts):
            rates[n].append(nbytes / _time(slab, nbytes, n) / 1e9)
    slab.close()
    report: dict[str, Any] = {
        "size_bytes": nbytes,
        "part_bytes": PART_BYTES,
        "cores": len(os.sched_getaffinity(0)),
        "default_threads": checksum_threads(),
        "gb_per_s": {
            str(n): {
                "median": round(statistics.median(v), 2),
                "min": round(min(v), 2),
                "max": round(max(v), 2),
            }
            for n, v in rates.items()
        },
        "conditions": _common.machine_conditions(),
    }
    if args.json:
        _common.print_json(report)
        return 0
    for n, row in report["gb_per_s"].items():
        print(f"{n} thread(s): {row['median']} GB/s ({row['min']}-{row['max']})")
    print(f"cores {report['cores']}, default threads {report['default_threads']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
