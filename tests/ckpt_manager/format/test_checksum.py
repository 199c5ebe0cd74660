"""File checksums by algorithm: CRC-32C for new saves, CRC-32 records (every older manifest)
still verify, and an unknown or mismatching algorithm is reported, never guessed."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import pathlib
import random
import zlib

import crc32c
import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager._format.checksum import (
    SAVE_ALGORITHM,
    ChecksumAlgorithm,
    checksum,
    crc32c_combine,
    parse_algorithm,
)
from ckpt_manager._format.layout import MANIFEST_NAME, index_file_name, shard_file_name, step_dir
from ckpt_manager._format.manifest import CHECKSUM_FIELD
from ckpt_manager._format.pieces import FileEntry
from ckpt_manager._store.steps import read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CorruptCheckpointError


def test_crc32c_is_castagnoli_and_chains_in_pieces() -> None:
    # The standard check value of CRC-32C (RFC 3720 appendix B.4).
    assert checksum(ChecksumAlgorithm.CRC32C, b"123456789") == 0xE3069283
    data = os.urandom((1 << 20) + 13)
    whole = checksum(ChecksumAlgorithm.CRC32C, data)
    head = checksum(ChecksumAlgorithm.CRC32C, data[:999])
    assert checksum(ChecksumAlgorithm.CRC32C, data[999:], head) == whole
    assert checksum(ChecksumAlgorithm.CRC32, data) == zlib.crc32(data)


def test_crc32c_through_isal_and_the_crc32c_package_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import crc32c

    from ckpt_manager._format import checksum as module

    data = bytearray(os.urandom((1 << 16) + 7))
    view = memoryview(data)
    cases = [(bytes(data), 0), (data, 5), (view[3:4099], 0xFFFFFFFF), (view[:0], 9)]
    expected = [crc32c.crc32c(bytes(buf), value) for buf, value in cases]
    address = ctypes.addressof(ctypes.c_char.from_buffer(data))
    for isal in (module._crc32c_isal, None):  # whichever this platform has, then the fallback
        monkeypatch.setattr(module, "_crc32c_isal", isal)
        assert [checksum(ChecksumAlgorithm.CRC32C, b, v) for b, v in cases] == expected
        assert module.crc32c_at(address + 3, 4096, 0xFFFFFFFF) == expected[2]
        # A read-only view that is not `bytes` has no address to take: the package computes it.
        assert checksum(ChecksumAlgorithm.CRC32C, memoryview(bytes(data))[3:4099]) == (
            crc32c.crc32c(bytes(data[3:4099]))
        )


def test_records_name_their_algorithm_and_crc32_ones_keep_the_old_form() -> None:
    assert parse_algorithm(None) is ChecksumAlgorithm.CRC32  # manifests before the field
    assert parse_algorithm("crc32c") is ChecksumAlgorithm.CRC32C
    with pytest.raises(ValueError, match=r"unknown checksum algorithm 'xxh3'.*crc32, crc32c"):
        parse_algorithm("xxh3")
    assert FileEntry(5, 7).to_json() == {"size": 5, "crc32": 7}
    assert FileEntry(5, 7, ChecksumAlgorithm.CRC32C).to_json() == {
        "size": 5,
        "crc32": 7,
        "checksum_algorithm": "crc32c",
    }


def _save(root: pathlib.Path) -> Storage:
    with CheckpointManager(str(root), CheckpointConfig(async_mode=AsyncMode.SYNC)) as mgr:
        mgr.save(3, {"w": torch.arange(5000, dtype=torch.float32), "b": torch.ones(3)})
    return Storage(str(root))


def test_a_save_records_the_save_algorithm_and_its_value_matches_the_file(
    tmp_path: pathlib.Path,
) -> None:
    storage = _save(tmp_path)
    manifest = read_manifest(storage, 3)
    name = shard_file_name(0)
    entry = manifest.files[name]
    data = (tmp_path / step_dir(3) / name).read_bytes()
    assert entry.algorithm is SAVE_ALGORITHM is ChecksumAlgorithm.CRC32C
    assert entry.crc32 == checksum(ChecksumAlgorithm.CRC32C, data)
    verify_files(storage, manifest, [name], check_crc=True)
    # The value is checked by the recorded algorithm: the same value under CRC-32 is damage.
    as_crc32 = dataclasses.replace(manifest, files={name: FileEntry(entry.size, entry.crc32)})
    with pytest.raises(CorruptCheckpointError, match=r"checksum .* \(crc32; corrupted bytes\)"):
        verify_files(storage, as_crc32, [name], check_crc=True)


def test_a_checkpoint_with_crc32_records_still_verifies_and_restores(
    tmp_path: pathlib.Path,
) -> None:
    storage = _save(tmp_path)
    folder = tmp_path / step_dir(3)
    doc = json.loads((folder / MANIFEST_NAME).read_bytes())
    # Rewrite it as a step from before the algorithm field: zlib CRC-32 values and no
    # algorithm in the rank's index and the manifest, and no manifest checksum (older still).
    shard, index = shard_file_name(0), index_file_name(0)
    shard_crc = zlib.crc32((folder / shard).read_bytes())
    index_doc = json.loads((folder / index).read_bytes())
    index_doc["file"]["crc32"] = shard_crc
    del index_doc["file"]["checksum_algorithm"]
    index_bytes = json.dumps(index_doc).encode()
    (folder / index).write_bytes(index_bytes)
    doc["files"][shard] = {"size": doc["files"][shard]["size"], "crc32": shard_crc}
    doc["files"][index] = {"size": len(index_bytes), "crc32": zlib.crc32(index_bytes)}
    assert not any("checksum_algorithm" in record for record in doc["files"].values())
    del doc[CHECKSUM_FIELD]
    (folder / MANIFEST_NAME).write_text(json.dumps(doc))
    manifest = read_manifest(storage, 3)
    assert all(e.algorithm is ChecksumAlgorithm.CRC32 for e in manifest.files.values())
    verify_files(storage, manifest, sorted(manifest.files), check_crc=True)
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, verify_checksums=True)
    with CheckpointManager(str(tmp_path), cfg) as mgr:
        restored = mgr.restore(3)
    assert torch.equal(restored.state["w"], torch.arange(5000, dtype=torch.float32))


def test_crc32c_of_parts_combined_equals_the_whole() -> None:
    # [Note: CRC-32C of parts, combined], against the reference `crc32c` package.
    rng = random.Random(0)
    for _ in range(100):
        a, b = rng.randbytes(rng.randrange(3000)), rng.randbytes(rng.randrange(3000))
        start = rng.getrandbits(32)
        combined = crc32c_combine(crc32c.crc32c(a, start), crc32c.crc32c(b), len(b))
        assert combined == crc32c.crc32c(a + b, start)
    assert crc32c_combine(0, crc32c.crc32c(b"x"), 1) == crc32c.crc32c(b"x")
