"""Recovering the newest step that verifies: corrupt files and manifests fall back with a reason."""

from __future__ import annotations

import json
import pathlib
import shutil
import time
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, CorruptCheckpointError
from ckpt_manager._format.layout import MANIFEST_NAME, index_file_name, shard_file_name, step_dir
from ckpt_manager._store.steps import read_manifest
from ckpt_manager._store.storage import Storage
from tests.ckpt_manager.conftest import Shard
from tests.ckpt_manager.fixtures.fixture_state import HERE as V1_CHECKPOINT
from tests.ckpt_manager.fixtures.fixture_state import STEP as V1_STEP


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
    # Asked for explicitly, the corrupt step is an error (and left where it is) ...
    with (
        pytest.raises(CorruptCheckpointError, match="checksum"),
        CheckpointManager(
            str(tmp_path), CheckpointConfig(async_mode=AsyncMode.SYNC), run_id="r"
        ) as mgr,
    ):
        mgr.restore(2)
    # ... the newest-step restore falls back past it (and moves it aside: test_quarantine.py).
    step, reason = _restore_latest(tmp_path, log_events)
    assert step == 1
    assert "checksum" in reason
    assert "rank-00000.bin" in reason


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

    def outside(doc: dict[str, Any]) -> None:
        doc["files"]["../x"] = doc["files"].pop(shard_file_name(0))

    _edit_manifest(tmp_path, 2, outside)
    step, reason = _restore_latest(tmp_path, log_events)
    assert step == 1
    assert "'../x'" in reason


# A corrupted manifest (issue 13, item 5): the manifest's own checksum and its extent checks
# make restore skip the step instead of reading the wrong bytes.

_CHECKSUM_FIELD = "manifest_crc32"


def _edit_manifest(root: pathlib.Path, step: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Change a committed manifest on disk the way a person or bit rot would; `edit` gets
    the parsed document (its checksum field still in it) and changes it in place."""
    manifest = root / step_dir(step) / MANIFEST_NAME
    doc = json.loads(manifest.read_bytes())
    edit(doc)
    manifest.write_text(json.dumps(doc))


def _unsigned(doc: dict[str, Any]) -> None:
    doc.pop(_CHECKSUM_FIELD, None)


def _flat_steps(root: pathlib.Path) -> None:
    """Steps 1 and 2 of a flat shard "t" (elements 64..128 of 128) followed by a tensor "u"."""
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(root), cfg, run_id="r") as mgr:
        for step in (1, 2):
            t = Shard(torch.full((64,), float(step)), (128,), (0,), (64, 128))
            mgr.save(step, {"t": t, "u": torch.full((64,), -float(step))})


def _restore_flat(root: pathlib.Path, events: list[dict[str, Any]]) -> tuple[int, str]:
    """Restore the newest step into a template; the values must be that step's, never others."""
    template = {"t": Shard(torch.zeros(64), (128,), (0,), (64, 128)), "u": torch.zeros(64)}
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(root), cfg, run_id="r") as mgr:
        result = mgr.restore(into=template)
    assert result is not None
    assert torch.equal(template["t"].local, torch.full((64,), float(result.step)))
    assert torch.equal(template["u"], torch.full((64,), -float(result.step)))
    skipped = [e for e in events if e["event"] == "ckpt_restore_skipped_step"]
    return result.step, skipped[0]["reason"] if skipped else ""


def _flip_digit_after(path: pathlib.Path, field: bytes) -> None:
    """Bit rot in the manifest: the last digit of the first number after `"field":`, 4 -> 1."""
    data = path.read_bytes()
    at = data.index(field) + len(field)
    while not data[at : at + 1].isdigit():
        at += 1
    while data[at + 1 : at + 2].isdigit():
        at += 1
    digit = int(data[at : at + 1])
    flipped = str(digit - 3 if digit >= 3 else digit + 3).encode()
    path.write_bytes(data[:at] + flipped + data[at + 1 :])


@pytest.mark.parametrize("field", [b'"flat_range":', b'"offset":'])
def test_flipped_digit_in_a_piece_falls_back(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]], field: bytes
) -> None:
    # Pieces live in the rank's index object; the manifest records its size and CRC-32.
    _flat_steps(tmp_path)
    _flip_digit_after(tmp_path / step_dir(2) / index_file_name(0), field)
    step, reason = _restore_flat(tmp_path, log_events)
    assert step == 1
    assert "step 2" in reason
    assert index_file_name(0) in reason


def test_flipped_digit_behind_a_matching_index_checksum_falls_back(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    # An index damaged and the manifest (unsigned) edited to match it: the index's own
    # extent checks still catch it.
    _flat_steps(tmp_path)
    index = tmp_path / step_dir(2) / index_file_name(0)
    _flip_digit_after(index, b'"flat_range":')
    data = index.read_bytes()

    def matching(doc: dict[str, Any]) -> None:
        _unsigned(doc)
        doc["files"][index_file_name(0)] = {"size": len(data), "crc32": zlib.crc32(data)}

    _edit_manifest(tmp_path, 2, matching)
    step, reason = _restore_flat(tmp_path, log_events)
    assert step == 1
    assert "invalid index of rank 0 at step 2" in reason
    assert "holds 67 elements" in reason


def test_flipped_digit_of_an_unsigned_format_1_manifest_falls_back(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    # Without the checksum (a manifest from before it) the extent checks still catch it.
    root = tmp_path / "ckpt"
    shutil.copytree(V1_CHECKPOINT, root)
    manifest = root / step_dir(V1_STEP) / MANIFEST_NAME
    _edit_manifest(root, V1_STEP, _unsigned)
    _flip_digit_after(manifest, b'"flat_range": [0, ')  # rank 0's piece [0, 6] -> [0, 3]
    with pytest.raises(CorruptCheckpointError, match="holds 3 elements"):
        read_manifest(Storage(str(root)), V1_STEP)


def test_changed_manifest_checksum_falls_back(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    _flat_steps(tmp_path)
    _edit_manifest(tmp_path, 2, lambda doc: doc.update({_CHECKSUM_FIELD: doc[_CHECKSUM_FIELD] ^ 1}))
    step, reason = _restore_flat(tmp_path, log_events)
    assert step == 1
    assert "step 2: manifest checksum" in reason


def test_huge_global_shape_falls_back_before_allocating(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        for step in (1, 2):
            mgr.save(step, {"t": Shard(torch.full((64,), float(step)), (64,), (0,), (0, 64))})

    def huge(doc: dict[str, Any]) -> None:
        _unsigned(doc)  # unsigned, so the size bound itself must catch it
        doc["tensors"]["t"]["global_shape"] = [10**12]

    _edit_manifest(tmp_path, 2, huge)
    start = time.perf_counter()
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        result = mgr.restore()
    assert time.perf_counter() - start < 30
    assert result is not None
    assert result.step == 1
    assert torch.equal(result.state["t"], torch.full((64,), 1.0))
    skipped = [e for e in log_events if e["event"] == "ckpt_restore_skipped_step"]
    assert "bytes" in skipped[0]["reason"]


def test_manifest_without_checksum_still_restores(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    _flat_steps(tmp_path)
    _edit_manifest(tmp_path, 2, _unsigned)
    assert _restore_flat(tmp_path, log_events) == (2, "")


def test_a_skeleton_that_breaks_loading_falls_back_instead_of_raising(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    # An unsigned manifest whose tree a bit flip made malformed: loading raises a plain
    # TypeError. It must become a skipped step on every rank, never escape one rank alone
    # (the others would then wait in the next collective until the timeout).
    _flat_steps(tmp_path)
    _edit_manifest(tmp_path, 2, lambda doc: (_unsigned(doc), doc.update(tree=["d", 5])))
    step, reason = _restore_flat(tmp_path, log_events)
    assert step == 1
    assert reason.startswith("TypeError")
