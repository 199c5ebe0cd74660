"""A checkpoint written by the format-version-1 code still lists, verifies, shows and restores.

The fixture (`tests/ckpt_manager/fixtures/v1_checkpoint/`) was written by the code of commit
e253ed2 (see `fixtures/fixture_state.py`); its values are rebuilt here from
`fixture_state.rank_state`, and the same state written in today's format restores the same.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from ckpt_manager._load.restore import load_state
from ckpt_manager._store.publish import CommitResult
from ckpt_manager._store.root_catalog import read_catalog
from ckpt_manager._store.steps import read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.cli import main
from tests.ckpt_manager.conftest import Shard
from tests.ckpt_manager.fixtures.fixture_state import HERE, STEP, rank_state, write_current_format


@pytest.fixture
def root(tmp_path: pathlib.Path) -> pathlib.Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(HERE, copy)
    return copy


def test_the_fixture_is_format_version_1(root: pathlib.Path) -> None:
    doc = json.loads(next(root.glob("step-*/manifest.json")).read_bytes())
    assert doc["format_version"] == 1
    assert "rank-00001.bin" in doc["files"]


def test_ckptctl_lists_shows_and_verifies_it(
    root: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["list", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["state"], r["world_size"]) for r in rows] == [(STEP, "committed", 2)]
    assert main(["show", str(root), str(STEP)]) == 0
    shown = capsys.readouterr().out
    assert "flat" in shown
    assert "loss" in shown
    assert main(["verify", str(root), str(STEP)]) == 0
    capsys.readouterr()
    # `show --json` prints the stored document: format 1 is read, never re-serialised.
    assert main(["show", str(root), str(STEP), "--json"]) == 0
    stored = json.loads(capsys.readouterr().out)["manifest"]
    assert stored == json.loads(next(root.glob("step-*/manifest.json")).read_bytes())
    assert stored["format_version"] == 1


def _assert_each_rank_restores_bitwise(storage: Storage) -> None:
    """Both saved ranks restore their `rank_state` into a template of zeros (-1 seeds)."""
    manifest = read_manifest(storage, STEP)
    verify_files(storage, manifest, sorted(manifest.files), check_crc=True)
    for rank in range(2):
        want = rank_state(rank)
        template = rank_state(rank)
        template["model"]["w"].zero_()
        template["flat"].local.zero_()
        template["box"].local.zero_()
        template["rng"].value["seed"].fill_(-1)
        got = load_state(storage, manifest, rank, template)
        assert torch.equal(got["model"]["w"], want["model"]["w"])
        assert torch.equal(got["flat"].local, want["flat"].local)
        assert torch.equal(got["box"].local, want["box"].local)
        assert torch.equal(got["rng"]["seed"], want["rng"].value["seed"])
        assert got["rng"]["pos"] == rank
        assert got["meta"] == want["meta"]


def test_each_rank_restores_its_state_bitwise(root: pathlib.Path) -> None:
    _assert_each_rank_restores_bitwise(Storage(str(root), {}))


def test_it_restores_consolidated_and_resharded(root: pathlib.Path) -> None:
    storage = Storage(str(root), {})
    manifest = read_manifest(storage, STEP)
    whole = load_state(storage, manifest, 1, None)
    assert torch.equal(whole["flat"], torch.arange(10, dtype=torch.float32) * 0.5)
    assert torch.equal(whole["box"], torch.arange(12, dtype=torch.int64).reshape(4, 3))
    # One rank of a 3-way flat split, across both stored pieces.
    target = Shard(torch.zeros(4), (10,), (3,), (3, 7))
    got = load_state(storage, manifest, 0, {"flat": target})
    assert torch.equal(got["flat"].local, torch.arange(3, 7, dtype=torch.float32) * 0.5)


def test_the_same_state_written_today_is_format_2_and_restores_the_same(
    tmp_path: pathlib.Path,
) -> None:
    current = tmp_path / "current"
    outcome = write_current_format(str(current))
    assert outcome.result is CommitResult.COMMITTED, outcome
    doc = json.loads(next(current.glob("step-*/manifest.json")).read_bytes())
    assert doc["format_version"] == 2
    assert [e.step for e in read_catalog(Storage(str(current))).entries.values()] == [STEP]
    _assert_each_rank_restores_bitwise(Storage(str(current), {}))
