"""CPU floor of one checksummed asynchronous save: the pieces any design must pay, measured.

For a buffer of `--size-mib` (default 580, the per-rank state of `bench/ckpt_vs_dcp.py`) it
times, in CPU seconds of this process (fastest of `--repeats`; each is fixed work, so the
minimum is the best estimate of its cost):

- the snapshot copy into a page-aligned shared-memory slab (what the manager's staging does);
- checksums of the slab: zlib CRC-32, ISA-L CRC-32, CRC-32C through ISA-L (`crc32_iscsi`,
  the manager's) and through the `crc32c` package, and, when installed, `google-crc32c`
  (it takes `bytes` only: timed on a copy's worth of cache-resident chunks, not the slab)
  and xxh3-64 (`xxhash` package) for comparison;
- the copy fused with each checksum, chunk by chunk while the chunk is in cache;
- the manager's own staging copy (`copy_into_slab`, checksum fused) for each algorithm a
  manifest can record (`staging_copy_crc32`, `staging_copy_crc32c`), for CRC-32C at fused
  chunk sizes of 128 KiB to 1 MiB (`staging_copy_crc32c_chunk_<K>k`), and for CRC-32C through
  the `crc32c` package (`staging_copy_crc32c_package`: the fallback, and the path before ISA-L),
  and for each byte copy (`staging_copy_crc32c_streaming`: the C helper's non-temporal stores,
  the default where it is built; `staging_copy_crc32c_memmove`: libc's), beside that byte copy
  alone in the same chunks (`copy_streaming`, `copy_memmove`);
- an `O_DIRECT` write of the slab to `--dir` (submission CPU; the bytes move by DMA).

Each figure is also given in memcpys (the issue's unit for checkpoint inflation).

    .venv/bin/python bench/save_cpu_floor.py [--size-mib 580] [--dir /tmp] [--json]
"""

from __future__ import annotations

import argparse
import importlib
import mmap
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any

import _common
from _common import MIB


def _fastest_cpu_s(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def _optional(module: str, attr: str) -> Any:
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError:
        return None


def _checksums() -> dict[str, Callable[[Any, int], int]]:
    from ckpt_manager._format import checksum as manager

    out: dict[str, Callable[[Any, int], int]] = {
        "zlib_crc32": zlib.crc32,
        "isal_crc32": manager.crc32,
        f"crc32c_{manager.CRC32C_IMPLEMENTATION}": lambda data, value: manager.checksum(
            manager.ChecksumAlgorithm.CRC32C, data, value
        ),
    }
    if (crc32c := _optional("crc32c", "crc32c")) is not None:
        out["crc32c_package"] = crc32c
    if (xxh := _optional("xxhash", "xxh3_64")) is not None:
        # Chained through the seed, so chunked use still covers every byte.
        out["xxh3_64"] = lambda data, value: int(xxh(data, seed=value).intdigest())
    return out


def _slab(nbytes: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("save-cpu-floor", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    os.posix_fallocate(fd, 0, nbytes)
    return fd, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def _direct_write(directory: str, data: memoryview) -> None:
    from ckpt_manager._store.backends.direct_write import write_at_start

    fd, path = tempfile.mkstemp(dir=directory, prefix="save-cpu-floor-")
    try:
        write_at_start(fd, path, data)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)


def _measure_slab(
    mm: mmap.mmap, src: Any, nbytes: int, repeats: int, directory: str
) -> dict[str, float]:
    import torch

    dst = torch.frombuffer(mm, dtype=torch.uint8)
    view = memoryview(mm)
    figures: dict[str, float] = {"memcpy": _fastest_cpu_s(lambda: dst.copy_(src), repeats)}
    checksums = _checksums()
    for name, fn in checksums.items():
        figures[name] = _fastest_cpu_s(lambda fn=fn: fn(view, 0), repeats)  # type: ignore[misc]
    chunk = 1 * MIB
    for name, fn in checksums.items():
        if name == "zlib_crc32":
            continue  # 3x slower than ISA-L's identical values: never fused

        def fused(fn: Callable[[Any, int], int] = fn) -> None:
            value = 0
            for off in range(0, nbytes, chunk):
                dst[off : off + chunk].copy_(src[off : off + chunk])
                value = fn(view[off : off + chunk], value)

        figures[f"memcpy_fused_{name}"] = _fastest_cpu_s(fused, repeats)
    figures.update(_measure_staging(src, nbytes, repeats))
    figures["odirect_write"] = _fastest_cpu_s(lambda: _direct_write(directory, view), repeats)
    view.release()
    return figures


def _measure_staging(src: Any, nbytes: int, repeats: int) -> dict[str, float]:
    """The manager's own staging copy (`copy_into_slab`, checksum fused) per algorithm, on
    the state cut into 64 tensors like a model's (fp32, 64-byte aligned slots)."""
    import torch

    from ckpt_manager._format import checksum as manager
    from ckpt_manager._format.checksum import ChecksumAlgorithm
    from ckpt_manager._format.shard_file import plan_layout
    from ckpt_manager._save import chunk_copy
    from ckpt_manager._save import staging as staging_module
    from ckpt_manager._save.staging import Slab, copy_into_slab

    numel = nbytes // 4 // 64
    tensors = list(src[: numel * 4 * 64].view(torch.float32).split(numel))
    layout = plan_layout([(f"t{i}", torch.float32, (numel,)) for i in range(len(tensors))])
    slab = Slab(0, layout.total_bytes)

    def staging(alg: ChecksumAlgorithm) -> None:
        copy_into_slab(slab, layout, tensors, algorithm=alg)

    try:
        out = {
            f"staging_copy_{alg.value}": _fastest_cpu_s(lambda alg=alg: staging(alg), repeats)
            for alg in ChecksumAlgorithm
        }
        default_chunk = staging_module.FUSED_CHUNK_BYTES
        try:  # the fused copy's granularity ([Note: the checksum rides on the staging copy])
            for kib in (128, 256, 512, 1024):
                staging_module.FUSED_CHUNK_BYTES = kib << 10
                out[f"staging_copy_crc32c_chunk_{kib}k"] = _fastest_cpu_s(
                    lambda: staging(ChecksumAlgorithm.CRC32C), repeats
                )
        finally:
            staging_module.FUSED_CHUNK_BYTES = default_chunk
        # The byte copy itself, chunk by chunk, and the staging copy with each kind
        # ([Note: the staging copy streams past the cache] in `_save/_streaming_copy.c`).
        slab_bytes = slab.tensor
        assert slab_bytes is not None
        dst_address, src_address = slab_bytes.data_ptr(), src.data_ptr()
        usable = numel * 4 * 64
        for kind in chunk_copy.CopyKind:
            if kind is chunk_copy.CopyKind.STREAMING and not chunk_copy.streaming_available():
                continue
            copy = chunk_copy.byte_copy(kind)

            def copy_only(copy: chunk_copy.ByteCopy = copy) -> None:
                step = staging_module.FUSED_CHUNK_BYTES
                for at in range(0, usable, step):
                    copy(dst_address + at, src_address + at, min(step, usable - at))

            out[f"copy_{kind.value}"] = _fastest_cpu_s(copy_only, repeats)
            default_copy = staging_module._copy_bytes
            staging_module._copy_bytes = copy
            try:
                out[f"staging_copy_crc32c_{kind.value}"] = _fastest_cpu_s(
                    lambda: staging(ChecksumAlgorithm.CRC32C), repeats
                )
            finally:
                staging_module._copy_bytes = default_copy
        isal = manager._crc32c_isal
        manager._crc32c_isal = None  # the fallback: the `crc32c` package
        try:
            out["staging_copy_crc32c_package"] = _fastest_cpu_s(
                lambda: staging(ChecksumAlgorithm.CRC32C), repeats
            )
        finally:
            manager._crc32c_isal = isal
        return out
    finally:
        slab.close()


def measure(size_mib: int, repeats: int, directory: str) -> dict[str, Any]:
    """Every figure of the module docstring, in CPU seconds and memcpys."""
    import torch

    torch.set_num_threads(1)
    nbytes = size_mib * MIB
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator())
    fd, mm = _slab(nbytes)
    try:
        figures = _measure_slab(mm, src, nbytes, repeats, directory)
    finally:
        mm.close()
        os.close(fd)
    memcpy = figures["memcpy"]
    return {
        "size_mib": size_mib,
        "cpu_s": figures,
        "x_memcpy": {k: v / memcpy for k, v in figures.items()},
        "conditions": _common.machine_conditions(),
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and print a table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=580)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (local fs)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.size_mib < 8 or args.repeats < 1:
        parser.error("--size-mib must be >= 8 and --repeats >= 1")
    result = measure(args.size_mib, args.repeats, args.dir)
    if args.json:
        _common.print_json(result)
        return 0
    rows = [[k, v, result["x_memcpy"][k]] for k, v in result["cpu_s"].items()]
    print(f"CPU seconds for {args.size_mib} MiB, fastest of {args.repeats}")
    print(_common.markdown_table(["work", "CPU-s", "x memcpy"], rows))
    c = result["conditions"]
    print(f"load average {c['loadavg_1_5_15']}, {c['cpu_count']} cores, torch {c['torch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
