"""State flattening, the shard file format, manifest validation and resharding."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from ckpt_manager import RankLocal
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._format.pieces import Piece
from ckpt_manager._format.shard_file import plan_layout, read_header
from ckpt_manager._format.tree import LeafKind, flatten
from ckpt_manager._load.reshard import Region, fill_region
from ckpt_manager.errors import CorruptCheckpointError
from tests.ckpt_manager.conftest import Shard
from tests.ckpt_manager.format._v1_writer import v1_manifest_bytes


def test_flatten_kinds_and_skeleton() -> None:
    state = {
        "w": torch.ones(2),
        "s": Shard(torch.ones(3), (6,), (0,), (3, 6)),
        "opt": {0: {"step": 3}},
        "rng": RankLocal({"t": torch.zeros(1)}),
        "seq": (1, None, "x"),
    }
    flat = flatten(state)
    kinds = {leaf.key: leaf.kind for leaf in flat.leaves}
    assert kinds == {
        "w": LeafKind.REPLICATED,
        "s": LeafKind.SHARDED,
        "rng/t": LeafKind.RANK_LOCAL,
    }
    assert flat.tree[0] == "d"
    assert ["opt", ["d", [[0, ["d", [["step", ["v", 3]]]]]]]] in flat.tree[1]
    assert flat.rank_local_trees == [["d", [["t", ["T", "rng/t"]]]]]
    json.dumps(flat.tree)


def test_flatten_keys_are_slash_joined_paths() -> None:
    # The walk builds keys by concatenation (not a joined path list): pin the spelling.
    state = {"layers": [{"w": torch.ones(1)}, (torch.ones(1),)], 3: {"b": torch.ones(1)}}
    assert [leaf.key for leaf in flatten(state).leaves] == ["layers/0/w", "layers/1/0", "3/b"]
    assert [leaf.key for leaf in flatten(torch.ones(1)).leaves] == ["<root>"]
    assert [leaf.key for leaf in flatten(RankLocal(torch.ones(1))).leaves] == ["<root>"]


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"x": object()}, "has type object"),
        ({"a/b": torch.ones(1), "a": {"b": torch.ones(1)}}, "map to the tensor key"),
        ({1.5: 1}, "use str or int keys"),
        ({"s": Shard(torch.ones(3), (4,), (2,))}, "exceeds global shape"),
        ({"s": Shard(torch.ones(3), (4,), (0,), (2, 4))}, "does not match"),
        ({"s": Shard(torch.ones(2), (4,), (0,), (3, 5))}, r"lies outside the 4 elements"),
        ({"s": Shard(torch.ones(2), (4,), (0,), (-1, 1))}, r"lies outside the 4 elements"),
        ({"s": Shard(torch.ones(0), (4,), (0,), (5, 6))}, "does not match"),
        ({"r": RankLocal(RankLocal(1))}, "cannot be nested"),
    ],
)
def test_flatten_rejects_with_path(state: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        flatten(state)


@pytest.mark.parametrize(
    ("shard", "offset", "flat_range"),
    [
        # What the sharding engine emits for a rank owning none of a 16-element parameter.
        (Shard(torch.ones(0), (16,), (0,), (1648, 1648)), None, (0, 0)),
        (Shard(torch.ones(0), (16,), (0,), (16, 16)), None, (0, 0)),
        (Shard(torch.ones(0, 4), (3, 4), (7, 9)), (0, 0), None),
    ],
)
def test_flatten_normalises_empty_pieces_wherever_they_lie(
    shard: Shard, offset: tuple[int, ...] | None, flat_range: tuple[int, int] | None
) -> None:
    (leaf,) = flatten({"s": shard}).leaves
    assert leaf.kind is LeafKind.SHARDED
    assert (leaf.global_offset, leaf.flat_range) == (offset, flat_range)
    assert leaf.global_shape == shard.global_shape


def test_layout_header_offsets_are_aligned_and_self_describing() -> None:
    layout = plan_layout(
        [("a", torch.float32, (3,)), ("b", torch.bfloat16, (2, 2)), ("c", torch.int64, ())]
    )
    header = read_header(layout.header)
    entries = header["tensors"]
    assert isinstance(entries, dict)
    for slot in layout.slots:
        assert slot.offset % 64 == 0
        assert entries[slot.key]["offset"] == slot.offset
    assert layout.total_bytes == layout.slots[-1].offset + 8
    with pytest.raises(ValueError, match="bad magic"):
        read_header(b"NOTACKPT" + bytes(16))


def _manifest_doc(**changes: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "format": "trainingd-checkpoint",
        "format_version": 1,
        "step": 5,
        "world_size": 1,
        "run_id": "r",
        "created_unix_s": 1.0,
        "committed_unix_s": 2.0,
        "versions": {},
        "metrics": {},
        "files": {"rank-00000.bin": {"size": 128, "crc32": 7}},
        "tree": ["d", [["w", ["T", "w"]]]],
        "tensors": {
            "w": {
                "dtype": "float32",
                "global_shape": [4],
                "kind": "replicated",
                "pieces": [Piece("rank-00000.bin", 64, 16, (4,)).to_json()],
            }
        },
        "rank_local": [{"trees": [], "tensors": {}}],
    }
    doc.update(changes)
    return doc


def test_manifest_roundtrip() -> None:
    m = Manifest.from_json(json.dumps(_manifest_doc()).encode(), expected_step=5)
    again = Manifest.from_json(v1_manifest_bytes(m), expected_step=5)
    assert again == m
    assert m.num_bytes == 128


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"files": {"../x": {"size": 1, "crc32": 0}}}, "invalid name"),
        ({"files": {"/etc/passwd": {"size": 1, "crc32": 0}}}, "invalid name"),
        ({"files": {"sub/x": {"size": 1, "crc32": 0}}}, "inside the step folder"),
        ({"step": 6}, "folder says 5"),
        ({"format_version": 99}, "newer than supported"),
        ({"format": "other"}, "not a trainingd-checkpoint"),
        ({"files": {"rank-00000.bin": {"size": 70, "crc32": 0}}}, "exceed file"),
    ],
)
def test_manifest_validation(changes: dict[str, object], message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        Manifest.from_json(json.dumps(_manifest_doc(**changes)).encode(), expected_step=5)


def test_truncated_manifest_is_corrupt() -> None:
    data = json.dumps(_manifest_doc()).encode()
    with pytest.raises(CorruptCheckpointError, match="invalid manifest"):
        Manifest.from_json(data[: len(data) // 2], expected_step=5)


def _pieces_flat(
    whole: torch.Tensor, cuts: list[int]
) -> tuple[list[Piece], dict[str, torch.Tensor]]:
    flat = whole.reshape(-1)
    pieces, store = [], {}
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        name = f"f{i}"
        store[name] = flat[a:b].clone()
        pieces.append(Piece(name, 0, (b - a) * 4, (b - a,), None, (a, b)))
    return pieces, store


def _pieces_box(
    whole: torch.Tensor, rows: list[int]
) -> tuple[list[Piece], dict[str, torch.Tensor]]:
    pieces, store = [], {}
    for i, (a, b) in enumerate(itertools.pairwise(rows)):
        name = f"b{i}"
        part = whole[a:b].clone()
        store[name] = part.reshape(-1)
        pieces.append(Piece(name, 0, part.numel() * 4, tuple(part.shape), (a, 0), None))
    return pieces, store


@pytest.mark.parametrize("saved", ["flat", "box"])
@pytest.mark.parametrize("target", ["flat", "box", "whole"])
def test_reshard_between_forms_and_world_sizes(saved: str, target: str) -> None:
    whole = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    if saved == "flat":
        pieces, store = _pieces_flat(whole, [0, 12, 12, 35])  # 3 ranks, one empty
    else:
        pieces, store = _pieces_box(whole, [0, 4, 7])  # 2 ranks

    def read(p: Piece, s: int, e: int) -> torch.Tensor:
        return store[p.file][s:e]

    if target == "flat":
        for a, b in [(0, 9), (9, 23), (23, 35)]:
            out = torch.zeros(b - a)
            fill_region(out, Region((7, 5), flat_range=(a, b)), pieces, read, "t")
            assert torch.equal(out, whole.reshape(-1)[a:b])
    elif target == "box":
        out = torch.zeros(3, 2)
        fill_region(out, Region((7, 5), offset=(3, 2), shape=(3, 2)), pieces, read, "t")
        assert torch.equal(out, whole[3:6, 2:4])
    else:
        out = torch.zeros(7, 5)
        fill_region(out, Region((7, 5), offset=(0, 0), shape=(7, 5)), pieces, read, "t")
        assert torch.equal(out, whole)


def test_flat_pieces_are_read_straight_into_a_flat_target() -> None:
    # [Note: a durable restore reads into its tensors]: with `read_into` a flat target's runs
    # are handed to it as views of the target itself; nothing is read to be copied.
    whole = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    pieces, store = _pieces_flat(whole, [0, 12, 12, 35])
    into: list[tuple[int, int]] = []

    def read(p: Piece, s: int, e: int) -> torch.Tensor:
        raise AssertionError("a flat run is read into the target")

    def read_into(p: Piece, s: int, out: torch.Tensor) -> None:
        into.append((out.data_ptr(), out.numel()))
        out.copy_(store[p.file][s : s + out.numel()])

    out = torch.zeros(20)
    fill_region(out, Region((7, 5), flat_range=(5, 25)), pieces, read, "t", read_into=read_into)
    assert torch.equal(out, whole.reshape(-1)[5:25])
    base = out.data_ptr()
    assert into == [(base, 7), (base + 7 * 4, 13)]


def test_reshard_reports_missing_coverage() -> None:
    whole = torch.arange(10, dtype=torch.float32)
    pieces, store = _pieces_flat(whole, [0, 4])
    with pytest.raises(CorruptCheckpointError, match="cover 4 of 10"):
        fill_region(
            torch.zeros(10),
            Region((10,), flat_range=(0, 10)),
            pieces,
            lambda p, s, e: store[p.file][s:e],
            "t",
        )


def test_is_sharded_agrees_with_the_protocol_check() -> None:
    import dataclasses

    import torch

    from ckpt_manager._format.tree import is_sharded
    from ckpt_manager._types import ShardedTensorLike

    @dataclasses.dataclass
    class Full:
        local: torch.Tensor
        global_shape: tuple[int, ...]
        global_offset: tuple[int, ...]
        flat_range: tuple[int, int] | None

    @dataclasses.dataclass
    class NoFlatRange:
        local: torch.Tensor
        global_shape: tuple[int, ...]
        global_offset: tuple[int, ...]

    t = torch.zeros(2)
    cases = [Full(t, (4,), (0,), None), NoFlatRange(t, (4,), (0,)), {"local": t}, 3, None]
    for value in cases:
        assert is_sharded(value) == isinstance(value, ShardedTensorLike), value
    assert is_sharded(cases[0])
    assert not is_sharded(t)
