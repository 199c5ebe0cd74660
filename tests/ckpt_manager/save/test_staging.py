"""The staging copy checksums what it copies: the value covers the file's every byte (header,
alignment padding, tensors copied in chunks, converted or strided ones) and progress is
still reported in order."""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time

import pytest
import torch

from ckpt_manager._format.checksum import ChecksumAlgorithm, checksum
from ckpt_manager._format.shard_file import FileLayout, plan_layout
from ckpt_manager._save import staging
from ckpt_manager._save.staging import Slab, copy_into_slab


def test_the_returned_checksum_is_that_of_the_staged_file_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Small chunks so that a tensor spans several (the fused loop's chunk boundaries).
    monkeypatch.setattr(staging, "FUSED_CHUNK_BYTES", 4096)
    big = torch.randn(10_001)  # 40 004 bytes: ten chunks and a tail, then padding
    strided = torch.arange(60, dtype=torch.float32).view(6, 10).t()  # not contiguous
    halves = torch.randn(33, dtype=torch.float64)  # stored as float32: converted
    tail = torch.randn(5007)[7:]  # contiguous, at a storage offset (copied by address)
    # A lazy conjugate: its memory holds the unconjugated values (a byte copy would store them).
    conj = torch.randn(20, dtype=torch.complex64).conj()
    layout = plan_layout(
        [
            ("big", torch.float32, (10_001,)),
            ("strided", torch.float32, (10, 6)),
            ("halves", torch.float32, (33,)),
            ("empty", torch.float32, (0,)),
            ("tail", torch.float32, (5000,)),
            ("conj", torch.complex64, (20,)),
        ]
    )
    slab = Slab(1, layout.total_bytes)
    try:
        # Stale bytes where the padding is: the file holds them, so the checksum must too.
        assert slab.tensor is not None
        slab.tensor.fill_(0xAB)
        progress: list[int] = []
        for algorithm in ChecksumAlgorithm:
            progress.clear()
            value = copy_into_slab(
                slab,
                layout,
                [big, strided, halves, torch.empty(0), tail, conj],
                progress.append,
                progress_bytes=1,
                algorithm=algorithm,
            )
            view = slab.view(layout.total_bytes)
            try:
                assert value == checksum(algorithm, view)
                header = bytes(view[: len(layout.header)])
            finally:
                view.release()
            assert header == layout.header
            assert progress == sorted(progress)
            assert progress[-1] == layout.total_bytes
        by_key = {slot.key: slot for slot in layout.slots}
        stored = slab.tensor
        slot = by_key["strided"]
        got = stored[slot.offset : slot.offset + slot.nbytes].view(torch.float32).view(10, 6)
        assert torch.equal(got, strided)
        slot = by_key["halves"]
        got = stored[slot.offset : slot.offset + slot.nbytes].view(torch.float32)
        assert torch.equal(got, halves.float())
        slot = by_key["big"]
        assert torch.equal(stored[slot.offset : slot.offset + slot.nbytes].view(torch.float32), big)
        slot = by_key["tail"]
        got = stored[slot.offset : slot.offset + slot.nbytes].view(torch.float32)
        assert torch.equal(got, tail)
        slot = by_key["conj"]
        got = stored[slot.offset : slot.offset + slot.nbytes].view(torch.complex64)
        assert torch.equal(got, conj.resolve_conj())
        del got, stored
    finally:
        slab.close()


@pytest.mark.parametrize("populate", ["works", "refused"])
def test_a_slab_asks_for_huge_pages_where_shmem_thp_is_advise_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, populate: str
) -> None:
    known = ("", "never", "advise", "within_size", "always", "deny", "force")
    assert staging.shmem_thp_mode() in known  # this host's, read from sysfs
    monkeypatch.setattr(staging, "shmem_thp_mode", lambda: "advise")
    if populate == "refused":  # as an older kernel answers an unknown advice
        monkeypatch.setattr(staging, "_MADV_POPULATE_WRITE", -1)
    layout = plan_layout([("w", torch.float32, (1 << 20,))])  # 4 MiB: room for huge pages
    slab = Slab(2, layout.total_bytes)
    try:
        assert slab.huge_pages_advised is (populate == "works")
        w = torch.randn(1 << 20)
        copy_into_slab(slab, layout, [w])
        assert slab.tensor is not None
        slot = layout.slots[0]
        stored = slab.tensor[slot.offset : slot.offset + slot.nbytes].view(torch.float32)
        assert torch.equal(stored, w)
        del stored
    finally:
        slab.close()
    monkeypatch.setattr(staging, "shmem_thp_mode", lambda: "never")
    plain = Slab(3, layout.total_bytes)
    assert not plain.huge_pages_advised
    plain.close()


def test_small_tensors_are_copied_and_checksummed_a_batch_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: small tensors in one call]: 200 small tensors cost a few GIL-releasing calls,
    not a few per tensor (one by one, 400 checksum calls), and both checksums (the file's,
    up to `split_at`, and the payload's) still cover every byte."""
    calls = []
    counted = staging.checksum

    def counting(*args: object, **kwargs: object) -> int:
        calls.append(1)
        return counted(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(staging, "checksum", counting)
    monkeypatch.setattr(staging, "crc32c_at", lambda *a: pytest.fail("a per-chunk CRC call"))
    tensors = [torch.randn(int(n)) for n in torch.randint(1, 300, (200,))]
    layout = plan_layout([(f"t{i}", torch.float32, tuple(t.shape)) for i, t in enumerate(tensors)])
    split_at = layout.slots[120].offset
    slab = Slab(1, layout.total_bytes)
    try:
        assert slab.tensor is not None
        slab.tensor.fill_(0xAB)
        progress: list[int] = []
        file_value, payload_value = staging.copy_payload_into_slab(
            slab, layout, tensors, split_at, progress.append, progress_bytes=1
        )
        assert len(calls) <= 6
        view = slab.view(layout.total_bytes)
        try:
            assert file_value == counted(ChecksumAlgorithm.CRC32C, view[:split_at])
            assert payload_value == counted(ChecksumAlgorithm.CRC32C, view)
        finally:
            view.release()
        assert progress == sorted(progress)
        assert progress[-1] == split_at
        for slot, tensor in zip(layout.slots, tensors, strict=True):
            got = slab.tensor[slot.offset : slot.offset + slot.nbytes].view(torch.float32)
            assert torch.equal(got, tensor)
        del got
    finally:
        slab.close()


def test_a_copy_program_is_reused_only_for_tensors_it_still_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: the copy program is made once per layout]: the next save of the same layout
    reuses the slab's program and copies the new tensors' values (not the first save's); a
    tensor that no longer fits its batch (another dtype, another device, a strided view of
    the same shape is fine) makes a new program, and every save's bytes and checksums are
    those of its own tensors."""
    monkeypatch.setattr(staging, "FUSED_CHUNK_BYTES", 4096)
    shapes = [(17,), (3, 5), (2000,), (), (9,)]  # (2000,) is 8000 bytes: copied alone

    def fresh(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return [torch.randn(shape) for shape in shapes]

    layout = plan_layout([(f"t{i}", torch.float32, s) for i, s in enumerate(shapes)])
    slab = Slab(1, layout.total_bytes)

    def check(tensors: list[torch.Tensor], on: FileLayout = layout) -> None:
        value = copy_into_slab(slab, on, tensors)
        assert slab.tensor is not None
        view = slab.view(on.total_bytes)
        try:
            assert value == checksum(ChecksumAlgorithm.CRC32C, view)
        finally:
            view.release()
        for slot, tensor in zip(on.slots, tensors, strict=True):
            got = slab.tensor[slot.offset : slot.offset + slot.nbytes].view(torch.float32)
            assert torch.equal(got.view(slot.shape), tensor.float())

    try:
        check(fresh(1))
        program = slab.copy_program
        assert program is not None
        check(fresh(2))  # new tensor objects, new values: the same program
        assert slab.copy_program is program
        transposed = fresh(3)
        transposed[1] = torch.randn(5, 3).t()  # the batch's typed copy takes any strides
        check(transposed)
        assert slab.copy_program is program
        converted = fresh(4)
        converted[0] = converted[0].double()  # a typed copy would convert it silently
        check(converted)
        assert slab.copy_program is not program
        check(fresh(5))
        wrong = fresh(7)
        wrong[0] = torch.randn(1)  # would broadcast into the slot's 17 elements
        with pytest.raises(ValueError, match="'t0' has shape"):
            copy_into_slab(slab, layout, wrong)
        wrong = fresh(8)
        wrong[2] = torch.randn(20)  # the one copied alone, by address: would read past it
        with pytest.raises(ValueError, match="'t2' has shape"):
            copy_into_slab(slab, layout, wrong)
        # Another layout (the same shapes, a different order) into the same slab: a new one.
        program = slab.copy_program
        other = plan_layout(
            [(f"t{i}", torch.float32, s) for i, s in reversed(list(enumerate(shapes)))]
        )
        check(fresh(6)[::-1], other)
        assert slab.copy_program is not program
    finally:
        slab.close()


def _allocated_slot_file(nbytes: int) -> int:
    """A descriptor like a memory slot's file: `nbytes` allocated by its owner."""
    fd = os.memfd_create("slot", os.MFD_CLOEXEC)
    os.posix_fallocate(fd, 0, nbytes)
    return fd


def test_a_slab_is_populated_with_the_gil_released() -> None:
    # [Note: a slab is populated without the GIL]: a slab made on the staging thread must not
    # stop the training thread's Python while its pages fault in (MAP_POPULATE held the GIL
    # 122 ms for 256 MiB). With a switch interval of 100 s the GIL changes hands only where
    # it is released: the other thread counts on while the pages fault in only if that
    # released it. Before: 0-3 counts (mmap's own dup() releases it for a moment).
    nbytes = 128 << 20
    fd = _allocated_slot_file(nbytes)
    go, stop = threading.Event(), threading.Event()
    counts = [0]

    def other_thread() -> None:
        go.wait()
        while not stop.is_set():
            counts[0] += 1
            time.sleep(0)  # gives the GIL back at once

    thread = threading.Thread(target=other_thread)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        thread.start()
        go.set()  # the other thread waits for the GIL, which this one holds...
        slab = Slab(0, nbytes, fd=fd)  # ...unless this releases it
        seen = counts[0]
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()
    assert seen >= 20
    assert slab.tensor is not None
    slab.tensor[-1] = 7  # mapped writable, every page there
    slab.tensor = None
    slab.close()


def test_making_a_slab_leaves_other_threads_their_mappings() -> None:
    # [Note: a slab is faulted in page by page]: populating a slab in one call
    # (MADV_POPULATE_WRITE, or MAP_POPULATE) holds the process's mmap lock while every page
    # faults in, and any other thread's mmap/munmap (the training thread's allocator freeing
    # a large tensor) waits for all of it; below training's priority on a busy core that held
    # training 0.7-0.9 s on the development VM. Faulted in page by page, each fault takes
    # the lock for a moment. Another thread maps and unmaps a page over and over while a
    # 512 MiB slab is made: its slowest mapping must be a part of the slab's time, not all
    # of it. Before: 0.99 of it; after: 0.04 (the bound leaves room for a busy machine's
    # scheduling delays).
    nbytes = 512 << 20
    fd = _allocated_slot_file(nbytes)
    started, stop = threading.Event(), threading.Event()
    slowest = [0.0]

    def other_thread() -> None:
        started.set()
        while not stop.is_set():
            t0 = time.perf_counter()
            mmap.mmap(-1, 4096).close()
            slowest[0] = max(slowest[0], time.perf_counter() - t0)

    thread = threading.Thread(target=other_thread)
    thread.start()
    started.wait()
    try:
        t0 = time.perf_counter()
        slab = Slab(0, nbytes, fd=fd)
        made_s = time.perf_counter() - t0
    finally:
        stop.set()
        thread.join()
    try:
        assert slab.tensor is not None
        slab.tensor[::4096].fill_(1)  # every page mapped writable: no fault left to take
        assert int(slab.tensor[::4096].sum()) == nbytes // 4096
    finally:
        slab.tensor = None
        slab.close()
    assert slowest[0] < 0.5 * made_s, (slowest[0], made_s)


def _nice_of(native_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_a_background_thread_runs_its_jobs_below_the_thread_that_started_it() -> None:
    base = _nice_of(threading.get_native_id())
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def job() -> None:
        seen.append((threading.get_native_id(), _nice_of(threading.get_native_id())))
        done.set()

    worker = staging.BackgroundThread("test-nice", nice=3)
    try:
        worker.submit(job)
        assert done.wait(10)
    finally:
        assert worker.close(10)
    ((tid, nice),) = seen
    assert tid != threading.get_native_id()
    assert nice == min(19, base + 3)
    assert _nice_of(threading.get_native_id()) == base  # only the worker moved
    with pytest.raises(ValueError, match="nice=20: use 0"):
        staging.BackgroundThread("test-nice", nice=20)
