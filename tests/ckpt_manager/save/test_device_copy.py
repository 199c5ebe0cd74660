"""CUDA staging: a CPU snapshot keeps the CPU path; a CUDA one is fenced on the device (-m gpu)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager._format.checksum import SAVE_ALGORITHM, checksum
from ckpt_manager._save import landed_checksums
from ckpt_manager._save.device_copy import DeviceFence
from ckpt_manager._save.landed_checksums import LandedChecksums
from ckpt_manager._save.staging import Slab

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_cpu_snapshot_has_no_device_fence() -> None:
    cpu_state = [torch.ones(3), torch.zeros(2, 2), "not a tensor"]
    assert DeviceFence.after_current_work(cpu_state) is None
    assert DeviceFence.after_current_work([]) is None


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    ("split", "marks"),
    [
        (700, [100, 100, 650, 700, 701, 1000]),  # repeated, inside, at and past the split
        (700, [1000]),  # one landing: the whole copy
        (1000, [300, 999]),  # no payload past the file
        (0, [1, 500]),  # no file bytes
    ],
)
def test_checksums_taken_as_a_device_copy_lands_equal_one_pass_after_it(
    split: int, marks: list[int], threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # [Note: the CUDA checksum overlaps the copy]: the same values, whatever the landings, the
    # parts (64 bytes here, so a landing spans several) and the threads folding them.
    monkeypatch.setattr(landed_checksums, "PART_BYTES", 64)
    slab = Slab(0, 1000)
    assert slab.tensor is not None
    slab.tensor[:1000].copy_(torch.randint(0, 256, (1000,), dtype=torch.uint8))
    told: list[int] = []
    sums = LandedChecksums(slab, split, 1000, told.append, threads=threads)
    try:
        for mark in marks:
            sums.landed(mark)
        got = sums.finish()
    finally:
        sums.close()
    data = bytes(slab.tensor[:1000].numpy())
    file_sum = checksum(SAVE_ALGORITHM, data[:split])
    assert got == (file_sum, checksum(SAVE_ALGORITHM, data[split:], file_sum))
    assert told == sorted(set(told))
    assert told[-1] == 1000
    slab.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", [AsyncMode.PERSISTENT, AsyncMode.SYNC])
def test_cuda_state_saved_before_an_in_place_update_keeps_the_old_values(
    tmp_path: pathlib.Path, mode: AsyncMode
) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    state = {
        "w": torch.randn(64 << 20, device=device, generator=gen),  # 256 MiB: the copy takes a while
        "b": torch.randn(7, 3, device=device, generator=gen).t(),  # not contiguous
        "half": torch.randn(1000, device=device, generator=gen).to(torch.bfloat16),
        "cpu": torch.arange(5),
    }
    expected = {k: v.detach().cpu().clone() for k, v in state.items()}
    with CheckpointManager(str(tmp_path), CheckpointConfig(async_mode=mode), run_id="r") as mgr:
        mgr.save(1, state)
        mgr.before_optimizer_step()
        # The "optimizer step": runs on the compute stream, which now waits for the copy.
        for value in state.values():
            value.add_(1)
        mgr.wait_until_finished()
        restored = mgr.restore(1)
    assert restored is not None
    for key, value in expected.items():
        assert torch.equal(restored.state[key].cpu(), value), key
