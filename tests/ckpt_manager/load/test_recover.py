"""Recovering the newest step that verifies: corrupt files and manifests fall back with a reason."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, CorruptCheckpointError
from ckpt_manager._store.manifest import MANIFEST_NAME, shard_file_name, step_dir


def _flip_byte(path: pathlib.Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _two_steps(root: pathlib.Path) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(root), cfg, run_id="r") as mgr:
        mgr.save(1, {"t": torch.full((64,), 1.0)})
        mgr.save(2, {"t": torch.full((64,), 2.0)})


def _restore_latest(root: pathlib.Path, events: list[dict[str, Any]]) -> tuple[int, str]:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(root), cfg, run_id="r") as mgr:
        result = mgr.restore()
        assert result is not None
        assert torch.equal(result.state["t"], torch.full((64,), float(result.step)))
    skipped = [e for e in events if e["event"] == "ckpt_restore_skipped_step"]
    return result.step, skipped[0]["reason"] if skipped else ""


def test_flipped_byte_falls_back_with_reason(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    _two_steps(tmp_path)
    _flip_byte(tmp_path / step_dir(2) / shard_file_name(0), -3)
    step, reason = _restore_latest(tmp_path, log_events)
    assert step == 1
    assert "checksum" in reason
    assert "rank-00000.bin" in reason
    with (
        pytest.raises(CorruptCheckpointError, match="checksum"),
        CheckpointManager(
            str(tmp_path), CheckpointConfig(async_mode=AsyncMode.SYNC), run_id="r"
        ) as mgr,
    ):
        mgr.restore(2)


def test_truncated_manifest_falls_back(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    _two_steps(tmp_path)
    manifest = tmp_path / step_dir(2) / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes()[:100])
    step, reason = _restore_latest(tmp_path, log_events)
    assert step == 1
    assert "invalid manifest" in reason


def test_manifest_naming_parent_path_is_rejected(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    _two_steps(tmp_path)
    (tmp_path / "x").write_bytes(b"outside")
    manifest = tmp_path / step_dir(2) / MANIFEST_NAME
    doc = json.loads(manifest.read_text())
    entry = doc["files"].pop(shard_file_name(0))
    doc["files"]["../x"] = entry
    for rec in doc["tensors"].values():
        for piece in rec["pieces"]:
            piece["file"] = "../x"
    manifest.write_text(json.dumps(doc))
    step, reason = _restore_latest(tmp_path, log_events)
    assert step == 1
    assert "'../x'" in reason
