"""Checkpoints of hybrid (HSDP) runs: each shard written once, restored onto any layout.

The daemon composes `sharding` and `ckpt_manager`; so does this test: HSDP 2x2 saves ->
ZeRO-3 on 4 ranks restores and saves -> no_shard on 1 (this process) restores and saves ->
HSDP 2x2 restores, and must hold bitwise the weights and optimizer state it saved.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_manager._store.indexes import complete_manifest
from ckpt_manager._store.steps import read_manifest
from ckpt_manager._store.storage import Storage
from tests.daemon._hybrid_ckpt_ranks import STEP, committed, no_shard_single, round_trip
from tests.sharding._helpers import single_thread
from tests.support.dist import run_on_ranks

_WAIT_S = 240.0
"""Bound of each wait of one side for the other's checkpoint."""


def _manifest(root: str) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads(
        (Path(root) / f"step-{STEP:012d}" / "manifest.json").read_text()
    )
    return manifest


def _tensor_bytes_by_file(root: str) -> dict[str, int]:
    """Bytes of tensor data each rank's file holds (from the pieces the rank indexes list)."""
    storage = Storage(root)
    manifest = complete_manifest(storage, read_manifest(storage, STEP))
    out: dict[str, int] = {}
    for record in manifest.tensors.values():
        for piece in record["pieces"]:
            out[piece.file] = out.get(piece.file, 0) + piece.nbytes
    return out


@pytest.mark.slow
def test_hybrid_checkpoint_round_trip_through_zero3_and_no_shard(tmp_path: Path) -> None:
    roots = {name: str(tmp_path / name) for name in ("hybrid", "zero3", "no_shard")}
    failures: list[BaseException] = []
    ranks_done = threading.Event()

    def world_size_one() -> None:
        # The no_shard-on-1 stage, while the ranks wait for its checkpoint.
        try:
            deadline = time.monotonic() + _WAIT_S
            while not committed(roots["zero3"]):
                if ranks_done.wait(0.1):
                    return  # the ranks failed before they saved it: their error is reported
                if time.monotonic() > deadline:
                    raise TimeoutError("the ranks never committed the ZeRO-3 checkpoint")
            with single_thread():
                no_shard_single(roots)
        except BaseException as err:  # re-raised by the test below
            failures.append(err)

    stage = threading.Thread(target=world_size_one, daemon=True)
    stage.start()
    try:
        results = run_on_ranks(round_trip, 4, roots, _WAIT_S, timeout_s=_WAIT_S + 60)
    finally:
        ranks_done.set()
        stage.join(timeout=_WAIT_S)
    if failures:
        raise failures[0]

    for rank, result in enumerate(results):
        saved, back = result["saved"], result["back"]
        for a, b in zip(saved["weights"], back["weights"], strict=True):
            assert torch.equal(a, b), rank
        for a, b in zip(saved["optimizer"], back["optimizer"], strict=True):
            assert a is not None
            assert b is not None
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), (rank, key)
    # The replicas (ranks 2, 3) of the shards of ranks 0, 1 wrote no tensor data: the
    # checkpoint holds every element once, as ZeRO-3 on 4 and no_shard on 1 write it.
    hybrid = _tensor_bytes_by_file(roots["hybrid"])
    # (Format 2 lists non-empty pieces only, so a rank without data has no entry.)
    assert hybrid.get("rank-00002.bin", 0) == hybrid.get("rank-00003.bin", 0) == 0
    # ... and no file at all: the step's files are the 2-rank ZeRO-3 layout's plus two indexes.
    step_folder = Path(roots["hybrid"]) / f"step-{STEP:012d}"
    assert sorted(p.name for p in step_folder.glob("*.bin")) == ["rank-00000.bin", "rank-00001.bin"]
    assert hybrid["rank-00000.bin"] > 0
    assert hybrid["rank-00001.bin"] > 0
    total = sum(hybrid.values())
    assert total == sum(_tensor_bytes_by_file(roots["zero3"]).values())
    assert total == sum(_tensor_bytes_by_file(roots["no_shard"]).values())
    assert _manifest(roots["hybrid"])["world_size"] == 4
