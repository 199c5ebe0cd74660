"""The staging copy's byte copy: the C helper's streaming stores and the memmove fallback."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from ckpt_manager._save import chunk_copy
from ckpt_manager._save.chunk_copy import STAGING_COPY, CopyKind, byte_copy, streaming_available
from tests.conftest import STRICT_VARIABLE, strict_mode

_KINDS = [CopyKind.MEMMOVE, CopyKind.STREAMING]
_GUARD = 128
"""Bytes on each side of the destination that a copy must leave alone."""


def _needs_streaming(kind: CopyKind) -> None:
    if kind is CopyKind.STREAMING and not streaming_available():
        reason = "the C helper ckpt_manager._save._streaming_copy is not built here"
        if strict_mode():
            pytest.fail(f"{reason} [{STRICT_VARIABLE}/CI strict mode: no skip]", pytrace=False)
        pytest.skip(reason)


@pytest.mark.parametrize("kind", _KINDS, ids=lambda k: k.value)
@pytest.mark.parametrize(
    "nbytes",
    # Below a line, around a line, around the four-stride block, and a staging chunk plus a
    # tail: every path of the helper (head, blocks, lines, tail).
    [1, 15, 63, 64, 65, 4095, 16384, 16384 * 3 + 77, (256 << 10) + 5],
)
@pytest.mark.parametrize(("src_offset", "dst_offset"), [(0, 0), (3, 61), (17, 0), (0, 33)])
def test_a_copy_lands_every_byte_and_nothing_else(
    kind: CopyKind, nbytes: int, src_offset: int, dst_offset: int
) -> None:
    _needs_streaming(kind)
    gen = torch.Generator().manual_seed(nbytes + src_offset)
    src = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, generator=gen)
    dst = torch.full((nbytes + 2 * _GUARD,), 0xA5, dtype=torch.uint8)
    byte_copy(kind)(dst.data_ptr() + _GUARD + dst_offset, src.data_ptr() + src_offset, nbytes)
    landed = dst[_GUARD + dst_offset : _GUARD + dst_offset + nbytes]
    assert torch.equal(landed, src[src_offset : src_offset + nbytes])
    assert bool((dst[: _GUARD + dst_offset] == 0xA5).all())
    assert bool((dst[_GUARD + dst_offset + nbytes :] == 0xA5).all())


def test_the_streaming_copy_refuses_what_it_cannot_copy_safely() -> None:
    _needs_streaming(CopyKind.STREAMING)
    copy = byte_copy(CopyKind.STREAMING)
    buf = ctypes.create_string_buffer(b"x" * 4096)
    at = ctypes.addressof(buf)
    with pytest.raises(ValueError, match="overlap"):
        copy(at + 100, at, 1000)
    with pytest.raises(ValueError, match="nbytes=-1"):
        copy(at + 2048, at, -1)
    with pytest.raises(ValueError, match="null address"):
        copy(0, at, 16)
    copy(0, 0, 0)  # nothing to copy: no address is read
    assert buf.raw == b"x" * 4096 + b"\0"


def test_the_staging_copy_streams_where_the_helper_is_built() -> None:
    """On x86-64 an install with a C compiler builds the helper and the staging copy uses it;
    CI's strict mode fails when it was not built (a silent fallback would cost every save
    the destination's reads)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        # The helper may build here, but it has no streaming stores: memmove it is.
        assert not streaming_available()
        assert STAGING_COPY is CopyKind.MEMMOVE
        return
    _needs_streaming(CopyKind.STREAMING)
    assert STAGING_COPY is CopyKind.STREAMING


def test_without_the_helper_streaming_is_refused_with_the_way_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(chunk_copy, "_helper", None)
    assert not streaming_available()
    with pytest.raises(ValueError, match=r"CopyKind\.MEMMOVE"):
        byte_copy(CopyKind.STREAMING)
    assert byte_copy(CopyKind.MEMMOVE) is ctypes.memmove
