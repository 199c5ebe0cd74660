"""Request spreading (issue #18): rank objects in hashed sub-prefixes of the step folder.

Simulated ranks go through the save path's own functions (see `test_scale_commit.py`); the
manager tests force spreading on local disk, where it is off by default. The S3 default is
covered in `tests/ckpt_manager/test_s3_manager.py`.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, KeepLast
from ckpt_manager._config import DEFAULT_S3_SPREAD_PREFIXES
from ckpt_manager._format.layout import MANIFEST_NAME, index_file_name, shard_file_name, step_dir
from ckpt_manager._format.manifest import SPREAD_FIELD, Manifest
from ckpt_manager._load.regions import StepRegions
from ckpt_manager._load.restore import load_state
from ckpt_manager._save.commit import commit_step
from ckpt_manager._store.indexes import complete_manifest
from ckpt_manager._store.publish import CommitResult
from ckpt_manager._store.steps import delete_step, read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.cli import main as ckptctl
from ckpt_manager.errors import CorruptCheckpointError
from tests.ckpt_manager._states import assert_restored, sample_state, snapshot
from tests.ckpt_manager.save.test_scale_commit import (
    SIZES,
    STEP,
    WORLD,
    _values,
    rank_state,
    save_rank,
)

SPREAD = 16


@pytest.fixture
def spread_step(tmp_path: pathlib.Path) -> Storage:
    # The 64 simulated ranks of the scale test: 4 ranks' objects in each of 16 prefixes.
    storage = Storage(str(tmp_path / "ckpt"))
    reports = [save_rank(storage, r, SPREAD) for r in range(WORLD)]
    outcome = commit_step(
        storage,
        step=STEP,
        run_id="sim",
        created_unix_s=1.0,
        reports=reports,
        spread_prefixes=SPREAD,
    )
    assert outcome.result is CommitResult.COMMITTED
    return storage


def test_names_without_and_with_spreading() -> None:
    assert shard_file_name(3) == "rank-00003.bin"
    assert index_file_name(3) == "rank-00003.index.json"
    assert shard_file_name(21, 16) == "05/rank-00021.bin"
    assert index_file_name(255, 256) == "ff/rank-00255.index.json"


def test_a_spread_save_uses_p_prefixes_and_restores_bitwise(spread_step: Storage) -> None:
    folder = step_dir(STEP)
    assert spread_step.list_names(folder) == [f"{p:02x}" for p in range(SPREAD)] + [MANIFEST_NAME]
    for p in range(SPREAD):
        held = spread_step.list_names(f"{folder}/{p:02x}")
        assert held  # every rank writes an index, so every prefix holds something
        assert all(int(n[5:10]) % SPREAD == p for n in held)
    manifest = read_manifest(spread_step, STEP)
    assert manifest.spread_prefixes == SPREAD
    assert {index_file_name(r, SPREAD) for r in range(WORLD)} <= set(manifest.files)
    assert all(n.count("/") == 1 for n in manifest.files)
    verify_files(spread_step, manifest, sorted(manifest.files), check_crc=True)
    whole = load_state(spread_step, complete_manifest(spread_step, manifest), 5, None)
    for i in range(len(SIZES)):
        assert torch.equal(whole["params"][f"p{i}"], _values(i))
    rank = 21
    got = load_state(spread_step, manifest, rank, rank_state(rank, zero=True))
    want = rank_state(rank)
    for key, shard in want["params"].items():
        assert torch.equal(got["params"][key].local, shard.local), key
    assert got["rng"]["seed"].item() == rank
    # The region reader (DCP's load path) finds the holders' indexes in their sub-prefixes.
    regions = StepRegions(spread_step, STEP)
    for i in (0, 5, len(SIZES) - 1):
        assert torch.equal(regions.whole(f"params/p{i}"), _values(i))


def test_ckptctl_show_verify_and_deletion_of_a_spread_step(
    spread_step: Storage, capsys: pytest.CaptureFixture[str]
) -> None:
    root = spread_step.root_uri
    assert ckptctl(["verify", root]) == 0, capsys.readouterr().err
    assert "128 files" in capsys.readouterr().out  # 64 shard files and 64 indexes
    assert ckptctl(["show", root, str(STEP), "--json"]) == 0, capsys.readouterr().err
    shown = json.loads(capsys.readouterr().out)
    assert shown["step"] == STEP
    # A damaged shard in a sub-prefix is found like any other.
    name = f"{step_dir(STEP)}/{shard_file_name(2, SPREAD)}"
    data = bytearray(spread_step.read(name))
    data[-1] ^= 0xFF
    spread_step.write(name, bytes(data))
    assert ckptctl(["verify", root]) == 1
    assert shard_file_name(2, SPREAD) in capsys.readouterr().out
    # The newest object anywhere below the folder dates it (the deleter's grace period).
    assert spread_step.modified_unix_s(step_dir(STEP)) is not None
    assert delete_step(spread_step, STEP)
    # Only the root catalog (an index of the committed steps, now empty) stays.
    assert spread_step.list_names() == ["_CATALOG.json"]


def test_manifest_names_in_sub_folders_need_the_recorded_spread(spread_step: Storage) -> None:
    data = spread_step.read(f"{step_dir(STEP)}/{MANIFEST_NAME}")
    doc = json.loads(data)
    assert list(doc)[:5] == ["format", "format_version", "step", "world_size", SPREAD_FIELD]
    for bad_spread, problem in ((0, "must be inside the step folder"), (300, "is above 256")):
        forged = {k: v for k, v in doc.items() if k != "manifest_crc32"}
        forged[SPREAD_FIELD] = bad_spread
        with pytest.raises(CorruptCheckpointError, match=problem):
            Manifest.from_json(json.dumps(forged).encode(), expected_step=STEP)
    deeper = {k: v for k, v in doc.items() if k != "manifest_crc32"}
    deeper["files"] = {
        (f"zz/{n.rsplit('/', 1)[1]}" if n.startswith("01/") else n): e
        for n, e in doc["files"].items()
    }
    with pytest.raises(CorruptCheckpointError, match="inside the step folder"):
        Manifest.from_json(json.dumps(deeper).encode(), expected_step=STEP)


@pytest.mark.parametrize("mode", [AsyncMode.SYNC, AsyncMode.PERSISTENT])
def test_manager_with_spreading_forced_on_local_disk(
    tmp_path: pathlib.Path, mode: AsyncMode
) -> None:
    cfg = CheckpointConfig(async_mode=mode, spread_prefixes=8, retention=KeepLast(n=1))
    state = sample_state(0)
    with CheckpointManager(str(tmp_path), cfg, run_id="run") as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        want = snapshot(state)
        mgr.save(2, state)
        mgr.wait_until_finished()
        result = mgr.restore(2)
        assert result is not None
        assert_restored(result.state, want)
    assert (tmp_path / step_dir(2) / shard_file_name(0, 8)).is_file()
    assert (tmp_path / step_dir(2) / index_file_name(0, 8)).is_file()
    assert not (tmp_path / step_dir(1)).exists()  # retention removed the spread folder


def test_spread_config_defaults_and_validation() -> None:
    cfg = CheckpointConfig()
    assert cfg.spread_for("s3://bucket/run") == DEFAULT_S3_SPREAD_PREFIXES
    assert cfg.spread_for("/data/ckpt") == 0
    assert cfg.spread_for("memory://ckpt") == 0
    assert CheckpointConfig(spread_prefixes=0).spread_for("s3://bucket/run") == 0
    assert CheckpointConfig(spread_prefixes=4).spread_for("/data/ckpt") == 4
    with pytest.raises(ValueError, match="spread_prefixes=257: use 0"):
        CheckpointConfig(spread_prefixes=257)
