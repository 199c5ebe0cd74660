"""A 64-simulated-rank commit in one process: index objects, the coordinator's commit, and a
restore of one rank that reads only the indexes and bytes it needs (format 2, issue #18).

Each simulated rank goes through the save path's own functions (`_simulated.save_rank_state`:
flatten, the shard layout, `piece_records`, `prepare_rank`, `write_finished_index`); the
coordinator's `commit_step` turns the 64 reports into the top manifest. Reads are counted at
the `Storage` layer (the real reads, wrapped), not by mocking the loader.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ckpt_manager import RankLocal
from ckpt_manager._format.layout import MANIFEST_NAME, index_file_name, shard_file_name
from ckpt_manager._format.tree import flatten
from ckpt_manager._load.restore import load_state
from ckpt_manager._save.commit import commit_step
from ckpt_manager._save.plan import leaves_to_write
from ckpt_manager._store.indexes import complete_manifest
from ckpt_manager._store.publish import CommitResult
from ckpt_manager._store.steps import read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from tests.ckpt_manager._simulated import save_rank_state
from tests.ckpt_manager.conftest import Shard

WORLD = 64
STEP = 3
# Parameter sizes of a small model, laid end to end in one flat buffer split evenly across
# ranks (ZeRO-style): most parameters live on one or two ranks.
SIZES = [96, 1536, 40, 4096, 8, 640, 2048, 24, 3072, 512] * 4
TOTAL = sum(SIZES)
PER_RANK = math.ceil(TOTAL / WORLD)


def _values(i: int) -> torch.Tensor:
    return torch.arange(SIZES[i], dtype=torch.float32) + 1000.0 * i


def _rank_range(rank: int) -> tuple[int, int]:
    return min(TOTAL, rank * PER_RANK), min(TOTAL, (rank + 1) * PER_RANK)


def rank_state(rank: int, *, zero: bool = False) -> dict[str, Any]:
    """Rank `rank`'s ZeRO-style state (`zero`: the same shapes, zero-filled, as a template)."""
    lo, hi = _rank_range(rank)
    params: dict[str, Any] = {}
    start = 0
    for i, size in enumerate(SIZES):
        a, b = max(lo, start), min(hi, start + size)
        if a < b:
            local = _values(i)[a - start : b - start].clone()
            flat = (a - start, b - start)
        else:
            local, flat = torch.empty(0), (0, 0)
        params[f"p{i}"] = Shard(local.zero_() if zero else local, (size,), (flat[0],), flat)
        start += size
    return {
        "params": params,
        "step": torch.tensor([STEP]) * (0 if zero else 1),
        "rng": RankLocal({"seed": torch.tensor([rank * (0 if zero else 1)]), "pos": rank}),
        "lr": 0.5,
    }


def save_rank(storage: Storage, rank: int, spread_prefixes: int = 0) -> Any:
    """What one rank's trainer and writer do for a save; returns its report."""
    return save_rank_state(
        storage,
        step=STEP,
        rank=rank,
        state=rank_state(rank),
        metrics={"loss": 0.25},
        spread_prefixes=spread_prefixes,
    )


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> Storage:
    storage = Storage(str(tmp_path_factory.mktemp("scale") / "ckpt"))
    reports = [save_rank(storage, r) for r in range(WORLD)]
    outcome = commit_step(storage, step=STEP, run_id="sim", created_unix_s=1.0, reports=reports)
    assert outcome.result is CommitResult.COMMITTED
    return storage


class _CountedReads:
    """Every `Storage.read` and `read_into` (object name, bytes read), through the real
    implementation."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[str, int]] = []
        real = Storage.read

        def read(storage: Storage, name: str, start: int | None = None, end: int | None = None):  # type: ignore[no-untyped-def]
            data = real(storage, name, start, end)
            self.reads.append((name, len(data)))
            return data

        monkeypatch.setattr(Storage, "read", read)
        real_into = Storage.read_into

        def read_into(storage: Storage, name: str, start: int, out: memoryview) -> int:
            got = real_into(storage, name, start, out)
            self.reads.append((name, got))
            return got

        monkeypatch.setattr(Storage, "read_into", read_into)

    def objects(self) -> set[str]:
        return {name.rsplit("/", 1)[-1] for name, _ in self.reads}

    def num_bytes(self) -> int:
        return sum(n for _, n in self.reads)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> _CountedReads:
    return _CountedReads(monkeypatch)


def test_the_64_rank_commit_reads_back_and_verifies(committed: Storage) -> None:
    manifest = read_manifest(committed, STEP)
    assert manifest.world_size == WORLD
    assert not manifest.complete
    # A parameter lives on the ranks its flat range overlaps, and on no other.
    for i, size in enumerate(SIZES):
        holders = manifest.holders(f"params/p{i}")
        assert 1 <= len(holders) <= size // PER_RANK + 2
        assert holders == tuple(range(holders[0], holders[-1] + 1))
    assert manifest.holders("step") == (0,)
    assert {index_file_name(r) for r in range(WORLD)} <= set(manifest.files)
    verify_files(committed, manifest, sorted(manifest.files), check_crc=True)
    whole = load_state(committed, complete_manifest(committed, manifest), 5, None)
    for i in range(len(SIZES)):
        assert torch.equal(whole["params"][f"p{i}"], _values(i))
    assert whole["rng"]["pos"] == 5


def test_one_rank_restore_reads_only_the_indexes_it_needs(
    committed: Storage, counted: _CountedReads
) -> None:
    rank = 17
    manifest = read_manifest(committed, STEP)
    manifest_bytes = counted.num_bytes()
    template = rank_state(rank, zero=True)
    got = load_state(committed, manifest, rank, template)
    want = rank_state(rank)
    for key, shard in want["params"].items():
        assert torch.equal(got["params"][key].local, shard.local), key
    assert torch.equal(got["step"], want["step"])
    assert got["rng"]["seed"].item() == rank
    # The indexes read: this rank's own, rank 0's (the replicated "step"), and those of
    # the ranks holding the parameters this rank's range overlaps (its neighbours).
    needed = {0, rank}
    for i in range(len(SIZES)):
        if want["params"][f"p{i}"].local.numel():
            needed |= set(manifest.holders(f"params/p{i}"))
    read = counted.objects() - {MANIFEST_NAME}
    # Shard bytes only from this rank's own file and rank 0's (the replicated tensor): at
    # the same world size a neighbour's piece never overlaps this rank's range.
    assert read == {index_file_name(r) for r in needed} | {shard_file_name(r) for r in (0, rank)}
    assert len(needed) <= 4
    own = sum(s.local.numel() * 4 for s in want["params"].values()) + 8 + 8
    # Issue #18's target: one rank's restore reads <= 2x its own pieces + the top manifest.
    assert counted.num_bytes() <= 2 * (own + manifest_bytes)


def test_a_rank_whose_pieces_are_all_empty_writes_no_shard_file() -> None:
    # A hybrid (HSDP) replica or a DTensor replica hands over only empty pieces: nothing to
    # read back, so no file (a hybrid checkpoint holds one replica's bytes). A zero-element
    # tensor keeps its empty piece, so the manifest still names it.
    empty = {
        "w": Shard(torch.empty(0), (8,), (0,), (0, 0)),
        "nothing": Shard(torch.empty(0), (0,), (0,), (0, 0)),
        "lr": 0.5,
    }
    leaves = leaves_to_write(flatten(empty), rank=1)
    assert [leaf.global_shape for leaf in leaves] == [(0,)]
    holder = {"w": Shard(torch.ones(4), (8,), (0,), (0, 4)), "lr": 0.5}
    assert len(leaves_to_write(flatten(holder), rank=1)) == 1
