"""Checksums of shard files at memory speed, by algorithm.

Two algorithms, named in every manifest file record (`FileEntry.algorithm`):

- `crc32`: zlib's CRC-32. Every manifest written before the algorithm was recorded used it, so
  a record without an algorithm means CRC-32. ISA-L's implementation (`isal` package,
  PCLMULQDQ folding) computes the same value 3-6x faster than zlib's; zlib stays as the
  fallback for platforms without an `isal` wheel.
- `crc32c`: CRC-32C (Castagnoli, iSCSI), through the maintained `crc32c` package (hardware
  SSE4.2 / ARMv8 CRC instructions, a software fallback otherwise). It is the checksum object
  stores offer natively (S3's `x-amz-checksum-crc32c`, GCS).

`SAVE_ALGORITHM` is what new saves record. [Note: which checksum new saves use] The staging
copy checksums each chunk while it is in cache (`staging.copy_into_slab`), so a save pays the
checksum's arithmetic, not a second pass over memory; which algorithm is cheaper then depends
on the CPU. `bench/save_cpu_floor.py` measures both on the machine at hand. All of them
release the GIL on large buffers.
"""

from __future__ import annotations

import enum
import importlib
import zlib
from collections.abc import Callable
from typing import Any

__all__ = [
    "IMPLEMENTATION",
    "SAVE_ALGORITHM",
    "ChecksumAlgorithm",
    "checksum",
    "crc32",
    "parse_algorithm",
]


class ChecksumAlgorithm(enum.StrEnum):
    """A file checksum algorithm, as its manifest record names it."""

    CRC32 = "crc32"
    """zlib's CRC-32 (the meaning of a record that names none)."""
    CRC32C = "crc32c"
    """CRC-32C (Castagnoli)."""


def _load_crc32() -> tuple[Any, str]:
    try:
        module = importlib.import_module("isal.isal_zlib")
    except ImportError:  # isal is a dependency; the fallback is for platforms without a wheel
        return zlib.crc32, "zlib"
    return module.crc32, "isal"


_crc32_impl, IMPLEMENTATION = _load_crc32()


def _crc32c(data: bytes | bytearray | memoryview, value: int) -> int:
    # Imported on first use: only saves and files that record CRC-32C need it.
    import crc32c

    return int(crc32c.crc32c(data, value))


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """zlib-compatible CRC-32 of `data`, continuing from `value`."""
    return int(_crc32_impl(data, value))


_FUNCTIONS: dict[ChecksumAlgorithm, Callable[[bytes | bytearray | memoryview, int], int]] = {
    ChecksumAlgorithm.CRC32: crc32,
    ChecksumAlgorithm.CRC32C: _crc32c,
}

SAVE_ALGORITHM = ChecksumAlgorithm.CRC32C
"""The algorithm new saves record ([Note: which checksum new saves use])."""


def checksum(
    algorithm: ChecksumAlgorithm, data: bytes | bytearray | memoryview, value: int = 0
) -> int:
    """`algorithm`'s checksum of `data`, continuing from `value` (0 to start)."""
    return _FUNCTIONS[algorithm](data, value)


def parse_algorithm(name: object) -> ChecksumAlgorithm:
    """The algorithm a manifest record names; a record without one (None) means CRC-32.

    Raises:
        ValueError: an unknown name (a newer trainingd wrote it: upgrade to read it).
    """
    if name is None:
        return ChecksumAlgorithm.CRC32
    for algorithm in ChecksumAlgorithm:
        if name == algorithm.value:
            return algorithm
    known = ", ".join(a.value for a in ChecksumAlgorithm)
    raise ValueError(
        f"unknown checksum algorithm {name!r} (known: {known}); "
        "written by a newer trainingd? upgrade to read it"
    )
