"""Restoring one step: bitwise round trips in every mode, templates filled in place."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointError, CheckpointManager, SaveResult
from ckpt_manager._format.layout import MANIFEST_NAME, shard_file_name, step_dir
from tests.ckpt_manager._states import assert_restored, mutate, sample_state, snapshot
from tests.ckpt_manager.conftest import Reports, Shard


@pytest.mark.parametrize("mode", list(AsyncMode))
def test_save_mutate_restore_bitwise(tmp_path: pathlib.Path, mode: AsyncMode) -> None:
    reports = Reports()
    state = sample_state(0)
    saved = {}
    cfg = CheckpointConfig(async_mode=mode)
    with CheckpointManager(str(tmp_path), cfg, run_id="run", observer=reports) as mgr:
        for step in (10, 20, 30):
            saved[step] = snapshot(state)
            mgr.save(step, state, metrics={"loss": 1.0 / step})
            mgr.before_optimizer_step()
            mutate(state)  # the optimizer step, right after the fence
            mgr.maybe_finalize()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [10, 20, 30]
        assert mgr.stats().last_committed_step == 30
        for step, want in saved.items():
            result = mgr.restore(step)
            assert result is not None
            assert_restored(result.state, want)
    assert [r.step for r in reports.reports] == [10, 20, 30]
    for r in reports.reports:
        assert r.result is SaveResult.COMMITTED
        assert r.error is None
        assert r.num_bytes > 0
        assert 0 <= r.staging_s <= r.latency_s
        assert r.stall_s <= r.latency_s + 1e-6
    manifest = json.loads((tmp_path / step_dir(30) / MANIFEST_NAME).read_text())
    assert manifest["metrics"] == {"loss": 1.0 / 30}
    assert manifest["world_size"] == 1
    assert set(manifest["versions"]) >= {"torch", "trainingd"}
    assert manifest["files"][shard_file_name(0)]["size"] > 0


def test_restore_into_template_fills_in_place(tmp_path: pathlib.Path) -> None:
    state = sample_state(1)
    want = snapshot(state)
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="run") as mgr:
        mgr.save(1, state)
        template = sample_state(2)
        w = template["model"]["w"]
        result = mgr.restore(into=template)
        assert result is not None
        assert result.step == 1
        assert result.state["model"]["w"] is w
        assert torch.equal(w, want["w"])
        assert torch.equal(template["shard"].local, want["shard"])
        assert result.state["rng"]["pos"] == 3
        with pytest.raises(CheckpointError, match="not in the checkpoint"):
            mgr.restore(1, into={"model": {"missing": torch.zeros(1)}})


def test_empty_template_piece_past_the_end_restores(tmp_path: pathlib.Path) -> None:
    whole = torch.arange(16, dtype=torch.float32)
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="run") as mgr:
        mgr.save(1, {"p": Shard(whole, (16,), (0,), (0, 16))})
        # A rank that owns none of the parameter, placed at the engine's flat cursor.
        empty = Shard(torch.zeros(0), (16,), (0,), (1648, 1648))
        result = mgr.restore(1, into={"p": empty})
        assert result is not None
        assert result.state["p"] is empty
        tail = Shard(torch.zeros(4), (16,), (0,), (12, 16))
        mgr.restore(1, into={"p": tail})
        assert torch.equal(tail.local, whole[12:])
        with pytest.raises(CheckpointError, match="lies outside the 16 elements"):
            mgr.restore(1, into={"p": Shard(torch.zeros(4), (16,), (0,), (14, 18))})


def test_template_aliases_missing_from_an_older_checkpoint_are_kept(
    tmp_path: pathlib.Path,
) -> None:
    # Tie metadata (CONTRACTS.md) comes from the module; a checkpoint without it still loads.
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        mgr.save(1, {"model": {"w": torch.ones(3)}})
        mgr.wait_until_finished()
        template = {"model": {"w": torch.zeros(3), "__aliases__": {"head.w": "w"}}}
        result = mgr.restore(into=template)
        assert result is not None
        assert result.state["model"]["__aliases__"] == {"head.w": "w"}
        assert torch.equal(result.state["model"]["w"], torch.ones(3))
        with pytest.raises(CheckpointError, match=r"keys \['b'\] under"):
            mgr.restore(into={"model": {"w": torch.zeros(3), "b": torch.zeros(1)}})


@pytest.mark.gpu
def test_cuda_tensors_roundtrip(tmp_path: pathlib.Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    state = {
        "w": torch.randn(64, 32, device=dev),
        "s": Shard(torch.randn(100, device=dev), (200,), (0,), (50, 150)),
    }
    want_w, want_s = state["w"].cpu(), state["s"].local.cpu()
    with CheckpointManager(str(tmp_path), CheckpointConfig(), run_id="gpu") as mgr:
        mgr.save(1, state)
        mgr.before_optimizer_step()
        state["w"].add_(1)
        state["s"].local.add_(1)
        mgr.wait_until_finished()
        template = {
            "w": torch.zeros(64, 32, device=dev),
            "s": Shard(torch.zeros(100, device=dev), (200,), (0,), (50, 150)),
        }
        result = mgr.restore(into=template)
    assert result is not None
    assert torch.equal(template["w"].cpu(), want_w)
    assert torch.equal(template["s"].local.cpu(), want_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_piece_is_read_straight_into_a_tensor(tmp_path: pathlib.Path, dtype: torch.dtype) -> None:
    # [Note: a durable restore reads into its tensors] in ckpt_manager/_load/restore.py.
    from ckpt_manager._format.pieces import Piece
    from ckpt_manager._load.restore import read_piece, read_piece_into
    from ckpt_manager._store.storage import Storage
    from ckpt_manager.errors import CorruptCheckpointError

    values = torch.arange(100).to(dtype)
    raw = values.view(torch.uint8).numpy().tobytes()
    storage = Storage(str(tmp_path))
    storage.write(f"{step_dir(3)}/piece.bin", b"head" + raw)
    piece = Piece("piece.bin", 4, len(raw), (100,), (0,), None)
    out = torch.full((30,), 7).to(dtype)
    read_piece_into(storage, 3, piece, 50, out[5:25])
    assert torch.equal(out[5:25], values[50:70])
    assert torch.equal(out[:5], torch.full((5,), 7).to(dtype))  # nothing outside the run
    assert torch.equal(read_piece(storage, 3, piece, dtype, 90, 100), values[90:])
    with pytest.raises(CorruptCheckpointError, match="short"):
        read_piece_into(storage, 3, piece, 95, torch.empty(10, dtype=dtype))
    with pytest.raises(ValueError, match="contiguous"):
        read_piece_into(storage, 3, piece, 0, torch.empty(10, 2, dtype=dtype)[:, 0])
