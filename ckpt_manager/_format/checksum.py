"""Checksums of shard files at memory speed, by algorithm.

Two algorithms, named in every manifest file record (`FileEntry.algorithm`):

- `crc32`: zlib's CRC-32. Every manifest written before the algorithm was recorded used it, so
  a record without an algorithm means CRC-32. ISA-L's implementation (`isal` package,
  PCLMULQDQ folding) computes the same value 3-6x faster than zlib's; zlib stays as the
  fallback for platforms without an `isal` wheel.
- `crc32c`: CRC-32C (Castagnoli, iSCSI), the checksum object stores offer natively (S3's
  `x-amz-checksum-crc32c`, GCS). [Note: CRC-32C through ISA-L] It is computed by ISA-L's
  `crc32_iscsi` (part of ISA-L's public CRC API, exported by the `isal` package's own
  extension module, called through ctypes on the buffer's address): its PCLMULQDQ/VPCLMULQDQ
  folding ran at 53 GB/s on a cached 1 MiB chunk of the development VM (AMD EPYC, AVX-512),
  against 26 GB/s for the `crc32c` package's 3-way SSE4.2 `crc32q` loop and 25 GB/s for
  `google-crc32c` (which also takes only `bytes`, so it would copy a slab first). The two
  compute the same values (a test pins that); the `crc32c` package stays the fallback for a
  wheel that does not export the symbol, and for read-only buffers other than `bytes`
  (their address cannot be taken without a copy).

`SAVE_ALGORITHM` is what new saves record. [Note: which checksum new saves use] The staging
copy checksums each chunk while it is in cache (`staging.copy_into_slab`), so a save pays the
checksum's arithmetic, not a second pass over memory; which algorithm is cheaper then depends
on the CPU. `bench/save_cpu_floor.py` measures both on the machine at hand. All of them
release the GIL on large buffers.
"""

from __future__ import annotations

import ctypes
import enum
import importlib
import zlib
from collections.abc import Callable
from typing import Any

__all__ = [
    "CRC32C_IMPLEMENTATION",
    "IMPLEMENTATION",
    "SAVE_ALGORITHM",
    "ChecksumAlgorithm",
    "checksum",
    "crc32",
    "crc32c_at",
    "crc32c_combine",
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


_INT_MAX_BYTES = (1 << 31) - 1  # crc32_iscsi takes an `int` length
_CRC32C_CHUNK = 1 << 30


def _load_crc32c_isal() -> Any:
    """ISA-L's `crc32_iscsi(buffer, len, init)`, or None if this `isal` build hides it."""
    try:
        module = importlib.import_module("isal.isal_zlib")
        function = ctypes.CDLL(module.__file__).crc32_iscsi
    except (ImportError, OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    function.restype = ctypes.c_uint32
    return function


_crc32c_isal = _load_crc32c_isal()
CRC32C_IMPLEMENTATION = "isal" if _crc32c_isal is not None else "crc32c"
"""Which library computes CRC-32C here ([Note: CRC-32C through ISA-L])."""


def _crc32c_package(data: bytes | bytearray | memoryview, value: int) -> int:
    # Imported on first use: only saves and files that record CRC-32C need it.
    import crc32c

    return int(crc32c.crc32c(data, value))


def _crc32c(data: bytes | bytearray | memoryview, value: int) -> int:
    if _crc32c_isal is None:
        return _crc32c_package(data, value)
    if isinstance(data, bytes):
        address: int | None = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
        nbytes = len(data)
    else:
        view = memoryview(data)
        if view.readonly or not view.c_contiguous:
            return _crc32c_package(data, value)
        nbytes = view.nbytes
        # The temporary ctypes object holds an export of `view` only for this line.
        address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if nbytes else None
    return crc32c_at(address or 0, nbytes, value)


def crc32c_at(address: int, nbytes: int, value: int = 0) -> int:
    """CRC-32C of the `nbytes` at `address`, continuing from `value` (ISA-L when available).

    For callers that already hold a buffer's address (a tensor's `data_ptr()`), so no
    memoryview needs slicing per chunk. The memory must stay alive during the call.
    """
    if _crc32c_isal is None:
        buffer = (ctypes.c_char * nbytes).from_address(address) if nbytes else b""
        return _crc32c_package(memoryview(buffer).cast("B"), value)
    # ISA-L works on the inverted register: CRC-32C(data, v) = ~iscsi(data, ~v).
    crc = value ^ 0xFFFFFFFF
    done = 0
    while nbytes - done > _INT_MAX_BYTES:
        crc = _crc32c_isal(address + done, _CRC32C_CHUNK, crc)
        done += _CRC32C_CHUNK
    crc = _crc32c_isal(address + done, nbytes - done, crc)
    return int(crc) ^ 0xFFFFFFFF


# [Note: CRC-32C of parts, combined] The CRC of a concatenation follows from the parts' CRCs
# and the second part's length: crc(A + B) = (crc(A) * x^(8 len B) mod P) xor crc(B), the
# arithmetic of polynomials over GF(2) modulo CRC-32C's polynomial, in the reflected bit order
# the register uses (the pre- and post-inversion cancel out). So parts may be checksummed on
# several threads and folded in order: O(log len) 32-bit multiplications per part.
_CRC32C_REFLECTED_POLY = 0x82F63B78
_X0 = 1 << 31  # the polynomial 1 (x^0) in the reflected order


def _multiply_mod_p(a: int, b: int) -> int:
    """a(x) * b(x) mod P(x), both reflected 32-bit polynomials."""
    product = 0
    bit = _X0
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _CRC32C_REFLECTED_POLY if b & 1 else b >> 1
    return product


def _powers_x_2n() -> list[int]:
    # x^(2^n) mod P for n = 0..31: each the square of the one before.
    powers, p = [], _X0 >> 1  # x^1
    for _ in range(32):
        powers.append(p)
        p = _multiply_mod_p(p, p)
    return powers


_X_2N = _powers_x_2n()


def _x_8n_mod_p(nbytes: int) -> int:
    """x^(8 nbytes) mod P: the shift a CRC undergoes over `nbytes` zero bytes."""
    result, k = _X0, 3  # 8 n = n * 2^3
    while nbytes:
        if nbytes & 1:
            result = _multiply_mod_p(_X_2N[k % 32], result)
        nbytes >>= 1
        k += 1
    return result


def crc32c_combine(first: int, second: int, second_nbytes: int) -> int:
    """CRC-32C of `A + B` from `first` = crc(A), `second` = crc(B) and len(B)
    ([Note: CRC-32C of parts, combined])."""
    return _multiply_mod_p(_x_8n_mod_p(second_nbytes), first) ^ second


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
