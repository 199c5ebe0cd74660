"""Per-rank index objects and the format-2 top manifest: round trips and validation."""

from __future__ import annotations

import json

import pytest

from ckpt_manager._format.checksum import crc32
from ckpt_manager._format.layout import index_file_name
from ckpt_manager._format.manifest import FORMAT_VERSION, Manifest, rank_runs
from ckpt_manager._format.pieces import FileEntry, Piece
from ckpt_manager._format.rank_index import (
    DEFAULT_CHECKSUM_ALGORITHM,
    IndexedFile,
    PieceRecord,
    RankIndex,
    RankReport,
    check_rank_index,
)
from ckpt_manager._save.commit import build_top_manifest
from ckpt_manager.errors import CorruptCheckpointError

FILE = "rank-00001.bin"


def _records() -> list[PieceRecord]:
    return [
        # a flat piece of a sharded tensor, an empty piece of another, a box piece
        PieceRecord("w", "sharded", "float32", (10,), Piece(FILE, 128, 16, (4,), None, (6, 10))),
        PieceRecord("e", "sharded", "float32", (8,), Piece(FILE, 192, 0, (0,), None, (0, 0))),
        PieceRecord("b", "sharded", "int64", (4, 3), Piece(FILE, 192, 48, (2, 3), (2, 0), None)),
        PieceRecord("rng", "rank_local", "int32", (3,), Piece(FILE, 256, 12, (3,), None, None)),
    ]


def _index(size: int = 320) -> RankIndex:
    return RankIndex.build(
        step=9,
        rank=1,
        file=IndexedFile(name=FILE, size=size, crc32=77),
        records=_records(),
        rank_local_trees=[["d", [["rng", ["T", "rng"]], ["pos", ["v", 1]]]]],
    )


def test_an_index_keeps_non_empty_pieces_and_round_trips() -> None:
    index = _index()
    assert set(index.tensors) == {"w", "b"}  # the empty piece of "e" is not recorded
    assert set(index.rank_local) == {"rng"}
    again = RankIndex.from_json(index.to_json(), step=9, rank=1)
    assert again == index
    doc = json.loads(index.to_json())
    assert doc["file"]["checksum_algorithm"] == DEFAULT_CHECKSUM_ALGORITHM
    assert "file" not in doc["tensors"]["w"]["piece"]  # always the index's own file


def test_an_index_without_a_checksum_algorithm_reads_as_crc32() -> None:
    doc = json.loads(_index().to_json())
    del doc["file"]["checksum_algorithm"]
    again = RankIndex.from_json(json.dumps(doc).encode(), step=9, rank=1)
    assert again.file is not None
    assert again.file.checksum_algorithm == "crc32"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(rank=2), "says step 9 rank 2"),
        (lambda d: d["tensors"]["w"]["piece"].update(offset=129), "not 64-byte aligned"),
        (lambda d: d["tensors"]["w"]["piece"].update(offset=320), "exceed file"),
        (lambda d: d["tensors"]["b"]["piece"].update(offset=128), "overlap"),
        (lambda d: d["tensors"]["w"]["piece"].update(flat_range=[6, 9]), "holds 3 elements"),
    ],
)
def test_a_damaged_index_is_rejected(edit: object, message: str) -> None:
    doc = json.loads(_index().to_json())
    edit(doc)  # type: ignore[operator]
    with pytest.raises(CorruptCheckpointError, match=message):
        RankIndex.from_json(json.dumps(doc).encode(), step=9, rank=1)


def test_build_refuses_a_piece_in_another_file() -> None:
    bad = [_records()[0]._replace(piece=Piece("rank-00002.bin", 128, 16, (4,), None, (6, 10)))]
    with pytest.raises(ValueError, match="not in the rank's shard file"):
        RankIndex.build(
            step=9,
            rank=1,
            file=IndexedFile(name=FILE, size=320, crc32=0),
            records=bad,
            rank_local_trees=[],
        )


def test_rank_runs_are_half_open_and_sorted() -> None:
    assert rank_runs([7, 0, 1, 2, 1]) == [[0, 3], [7, 8]]
    assert rank_runs([]) == []


def _top(world_size: int = 2) -> tuple[Manifest, list[bytes]]:
    """A 2-rank top manifest: rank 0 holds w[0:6] and the replicated r, rank 1 the index above."""
    rank0 = RankIndex.build(
        step=9,
        rank=0,
        file=IndexedFile(name="rank-00000.bin", size=256, crc32=5),
        records=[
            PieceRecord(
                "w",
                "sharded",
                "float32",
                (10,),
                Piece("rank-00000.bin", 128, 24, (6,), None, (0, 6)),
            ),
            PieceRecord(
                "e", "sharded", "float32", (8,), Piece("rank-00000.bin", 192, 0, (0,), None, (0, 0))
            ),
            PieceRecord(
                "r",
                "replicated",
                "float32",
                (2,),
                Piece("rank-00000.bin", 192, 8, (2,), None, None),
            ),
        ],
        rank_local_trees=[],
    )
    indexes = [rank0, _index()]
    blobs = [i.to_json() for i in indexes]
    tree = ["d", [["w", ["S", "w"]], ["e", ["S", "e"]], ["r", ["T", "r"]]]]
    records = [
        [
            PieceRecord("w", "sharded", "float32", (10,), rank0.tensors["w"][1]),
            PieceRecord(
                "e", "sharded", "float32", (8,), Piece("rank-00000.bin", 192, 0, (0,), None, (0, 0))
            ),
            PieceRecord("r", "replicated", "float32", (2,), rank0.tensors["r"][1]),
        ],
        _records(),
    ]
    reports = [
        RankReport.of(
            idx,
            FileEntry(len(blob), crc32(blob)),
            recs,
            tree=tree if idx.rank == 0 else None,
            metrics={"loss": 0.5} if idx.rank == 0 else None,
        )
        for idx, blob, recs in zip(indexes, blobs, records, strict=True)
    ]
    top = build_top_manifest(
        step=9, run_id="r", created_unix_s=1.0, committed_unix_s=2.0, reports=reports
    )
    return top, blobs


def test_the_top_manifest_records_holders_not_pieces_and_round_trips() -> None:
    top, blobs = _top()
    assert top.format_version == FORMAT_VERSION
    assert top.holders("w") == (0, 1)
    assert top.holders("e") == ()  # empty on every rank, still known (dtype, shape)
    assert top.holders("r") == (0,)
    assert top.form_of("w") == "flat"
    assert top.form_of("b") == "box"
    assert set(top.files) == {
        "rank-00000.bin",
        FILE,
        index_file_name(0),
        index_file_name(1),
    }
    data = top.to_json()
    assert b"offset" not in data  # no piece records at all
    again = Manifest.from_json(data, expected_step=9)
    assert not again.complete
    assert {k: {**v, "ranks": list(v["ranks"])} for k, v in again.tensors.items()} == top.tensors
    assert check_rank_index(again, 1, blobs[1]) == _index()


def test_the_top_manifest_rejects_a_rank_outside_the_world() -> None:
    top, _ = _top()
    doc = json.loads(top.to_json())
    del doc["manifest_crc32"]
    doc["tensors"]["w"]["ranks"] = [[0, 3]]
    with pytest.raises(CorruptCheckpointError, match="outside world size 2"):
        Manifest.from_json(json.dumps(doc).encode(), expected_step=9)


def test_an_index_that_does_not_match_the_manifest_is_rejected() -> None:
    top, blobs = _top()
    with pytest.raises(CorruptCheckpointError, match="does not match the manifest"):
        check_rank_index(top, 1, blobs[1] + b" ")


def test_ranks_disagreeing_on_a_shape_fail_the_merge() -> None:
    def report(rank: int, shape: tuple[int, ...]) -> RankReport:
        return RankReport(
            rank, FileEntry(1, 1), None, {"w": ("float32", shape, "sharded", "flat", True)}
        )

    with pytest.raises(ValueError, match="rank 1 saved float32 \\[11\\]"):
        build_top_manifest(
            step=9,
            run_id="r",
            created_unix_s=1.0,
            committed_unix_s=2.0,
            reports=[report(0, (10,)), report(1, (11,))],
        )
    with pytest.raises(ValueError, match="rank order"):
        build_top_manifest(
            step=9, run_id="r", created_unix_s=1.0, committed_unix_s=2.0, reports=[report(1, (10,))]
        )
