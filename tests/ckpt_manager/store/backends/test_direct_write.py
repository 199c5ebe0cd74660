"""Large local writes past the page cache, and the checksum they are recorded with."""

from __future__ import annotations

import errno
import mmap
import os
import zlib
from pathlib import Path

import pytest

from ckpt_manager._format import checksum
from ckpt_manager._store.backends import direct_write, uring
from ckpt_manager._store.backends.direct_write import DIRECT_ALIGN, write_at_start
from ckpt_manager._store.storage import Storage

SIZE = (6 << 20) + 1234  # over the O_DIRECT threshold, not a whole number of blocks


def _slab(size: int) -> mmap.mmap:
    """A page-aligned shared mapping like the staging slabs, filled with a pattern."""
    mm = mmap.mmap(-1, size)
    mm.write(bytes(range(251)) * (size // 251) + b"\x07" * (size % 251))
    return mm


def _write(path: Path, data: memoryview) -> bytes:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_at_start(fd, str(path), data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return path.read_bytes()


def test_aligned_slab_is_written_whole_through_the_direct_path(tmp_path: Path) -> None:
    mm = _slab(SIZE)
    view = memoryview(mm)
    assert direct_write._direct_candidate(view)
    assert _write(tmp_path / "shard.bin", view) == mm[:]
    view.release()


def _direct_fd_or_skip(path: Path) -> int:
    """`path` created and opened with `O_DIRECT`; the test is skipped where the filesystem
    refuses it (the buffered path writes it all)."""
    path.touch()
    fd = direct_write._open_direct(str(path))
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    return fd


def test_direct_prefix_is_block_aligned_or_refused(tmp_path: Path) -> None:
    mm = _slab(SIZE)
    view = memoryview(mm)
    path = tmp_path / "prefix.bin"
    fd = _direct_fd_or_skip(path)
    try:
        aligned = SIZE // DIRECT_ALIGN * DIRECT_ALIGN
        written, usable = direct_write._write_direct(fd, view, 0, aligned)
    finally:
        os.close(fd)
    assert (written, usable) == (aligned, True)
    assert path.read_bytes() == mm[:written]
    view.release()


@pytest.mark.parametrize(
    "marks", [[SIZE], [1, 4096, 5000, (4 << 20) + 7, SIZE], [0, 3 << 20, 3 << 20, SIZE]]
)
def test_staged_counts_write_each_final_part(tmp_path: Path, marks: list[int]) -> None:
    mm = _slab(SIZE)
    assert _write_staged(tmp_path / "s.bin", memoryview(mm), marks) == mm[:]


@pytest.mark.parametrize(
    ("marks", "message"),
    [([5000, 4000, SIZE], "outside"), ([4096, SIZE + 1], "outside"), ([4096, 8192], "stopped")],
)
def test_bad_staged_counts_are_refused(tmp_path: Path, marks: list[int], message: str) -> None:
    mm = _slab(SIZE)
    with pytest.raises(ValueError, match=message):
        _write_staged(tmp_path / "bad.bin", memoryview(mm), marks)


def _write_staged(path: Path, data: memoryview, marks: list[int]) -> bytes:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_at_start(fd, str(path), data, iter(marks))
    finally:
        os.close(fd)
    return path.read_bytes()


@pytest.mark.parametrize("kind", ["read-only bytes", "unaligned view", "small"])
def test_other_buffers_take_the_buffered_path(tmp_path: Path, kind: str) -> None:
    mm = _slab(SIZE + 1)
    data = {
        "read-only bytes": memoryview(mm[:SIZE]),
        "unaligned view": memoryview(mm)[1:],
        "small": memoryview(mm)[: 4096 + 3],
    }[kind]
    assert not direct_write._direct_candidate(data)
    assert _write(tmp_path / "f.bin", data) == bytes(data)
    data.release()


def test_storage_write_of_a_slab_is_atomic_and_exact(tmp_path: Path) -> None:
    mm = _slab(SIZE)
    storage = Storage(str(tmp_path / "root"))
    view = memoryview(mm)
    storage.write("step-000000000001/rank-00000.bin", view)
    view.release()
    folder = tmp_path / "root" / "step-000000000001"
    assert [p.name for p in folder.iterdir()] == ["rank-00000.bin"]  # no temp file left
    assert (folder / "rank-00000.bin").read_bytes() == mm[:]


def test_disk_full_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(OSError) as info:
            write_at_start(fd, "/dev/full", memoryview(b"x" * 10))
    finally:
        os.close(fd)
    assert info.value.errno == 28  # ENOSPC


def test_checksum_matches_zlib_in_pieces() -> None:
    data = os.urandom((3 << 20) + 17)
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data[1000:], checksum.crc32(data[:1000])) == zlib.crc32(data)
    assert checksum.IMPLEMENTATION == "isal"  # a dependency: the fast path is the real one


@pytest.fixture
def ring() -> uring.DirectRing:
    found = uring.shared_ring()
    if found is None:
        pytest.skip("io_uring is unavailable here (kernel, seccomp or TRAININGD_IO_URING)")
    return found


def test_a_registered_slab_is_written_through_the_ring(
    tmp_path: Path, ring: uring.DirectRing
) -> None:
    # [Note: direct writes from registered buffers]: the aligned bulk from the pinned pages,
    # the tail buffered; a mapping nobody registered takes pwrite; forgotten, pwrite again.
    mm = _slab(SIZE)
    other = _slab(SIZE)
    try:
        assert direct_write.register_buffer(mm)
        before = ring.bytes_written
        view = memoryview(mm)
        os.close(_direct_fd_or_skip(tmp_path / "probe"))
        assert _write(tmp_path / "ring.bin", view) == mm[:]
        aligned = SIZE // DIRECT_ALIGN * DIRECT_ALIGN
        assert ring.bytes_written - before == aligned
        assert _write_staged(tmp_path / "staged.bin", view, [4096, 3 << 20, SIZE]) == mm[:]
        assert ring.bytes_written - before == 2 * aligned
        before = ring.bytes_written
        other_view = memoryview(other)
        assert _write(tmp_path / "other.bin", other_view) == other[:]
        assert ring.bytes_written == before  # not registered: pwrite
        direct_write.forget_buffer(mm)
        assert ring.find(view) is None
        assert _write(tmp_path / "forgotten.bin", view) == mm[:]
        assert ring.bytes_written == before
        view.release()
        other_view.release()
    finally:
        direct_write.forget_buffer(mm)
        mm.close()
        other.close()


def test_a_ring_write_error_is_raised(tmp_path: Path, ring: uring.DirectRing) -> None:
    mm = _slab(SIZE)
    path = tmp_path / "ro.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert direct_write.register_buffer(mm)
        view = memoryview(mm)
        found = ring.find(view)
        view.release()
        assert found is not None
        index, address = found
        with pytest.raises(OSError) as info:
            ring.write(fd, index, address, 1 << 20, 0)
        assert info.value.errno == errno.EBADF
    finally:
        os.close(fd)
        direct_write.forget_buffer(mm)
        mm.close()


def test_a_refused_registration_leaves_pwrite(tmp_path: Path, ring: uring.DirectRing) -> None:
    # Over the kernel's 1 GiB limit per buffer (mapped, never touched): refused without
    # asking the kernel, and written by pwrite.
    mm = mmap.mmap(-1, (1 << 30) + 4096)
    mm[: 1 << 20] = bytes(range(256)) * 4096
    before = ring.bytes_written
    try:
        assert not direct_write.register_buffer(mm)
        view = memoryview(mm)[: 8 << 20]
        assert _write(tmp_path / "plain.bin", view) == mm[: 8 << 20]
        view.release()
    finally:
        mm.close()
    assert ring.bytes_written == before


def test_a_mapping_closed_without_forget_is_never_written_from_its_pinned_pages(
    tmp_path: Path, ring: uring.DirectRing
) -> None:
    # The ring writes from the pages pinned at registration, whatever is mapped at that
    # address later: a new mapping at the old one's address must not match its range.
    old = _slab(SIZE)
    assert direct_write.register_buffer(old)
    old.close()  # unmapped without forget_buffer: its pages stay pinned in the ring
    new = mmap.mmap(-1, SIZE)
    new.write(b"\x5a" * SIZE)
    try:
        before = ring.bytes_written
        view = memoryview(new)
        assert _write(tmp_path / "new.bin", view) == b"\x5a" * SIZE  # not the old pattern
        view.release()
        assert ring.bytes_written == before
        # Registering another mapping drops the closed one's range (its pages unpinned).
        assert direct_write.register_buffer(new)
        assert [n for _, n in ring.registered] == [-(-SIZE // mmap.PAGESIZE) * mmap.PAGESIZE]
    finally:
        direct_write.forget_buffer(new)
        new.close()


def test_io_uring_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(uring.IO_URING_ENV, "off")
    assert uring.DirectRing.open() is None
