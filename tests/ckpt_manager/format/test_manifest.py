"""The manifest's own checksum and the extent checks that keep a bad manifest from restoring.

Torch-free like the modules under test: format-1 manifests (every piece inline, read by
`_format/legacy_v1.py`) are built from `Manifest` / `Piece`, serialised as the format-1
writer did (`_v1_writer.py`), and damaged as bytes or as parsed JSON, the way bit rot or an
operator's edit would. The format-2 top manifest's own checks are in `test_rank_index.py`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from ckpt_manager._format.manifest import CHECKSUM_FIELD, Manifest
from ckpt_manager._format.pieces import FileEntry, Piece
from ckpt_manager.errors import CorruptCheckpointError
from tests.ckpt_manager.format._v1_writer import v1_manifest_bytes

_FILE = "rank-00000.bin"


def _manifest() -> Manifest:
    """A sharded float32 8x4 tensor in two flat pieces and a replicated one, in one file."""
    flat = [
        Piece(_FILE, 64, 64, (16,), None, (0, 16)),
        Piece(_FILE, 128, 64, (16,), None, (16, 32)),
    ]
    return Manifest(
        step=5,
        world_size=1,
        run_id="r",
        created_unix_s=1.5,
        committed_unix_s=2.25,
        versions={"trainingd": "0", "torch": "2", "python": "3"},
        metrics={"loss": 0.5, "tokens": 640},
        files={_FILE: FileEntry(256, 7)},
        tree=["d", [["w", ["S", "w"]], ["b", ["T", "b"]]]],
        tensors={
            "w": {"dtype": "float32", "global_shape": [8, 4], "kind": "sharded", "pieces": flat},
            "b": {
                "dtype": "float32",
                "global_shape": [4],
                "kind": "replicated",
                "pieces": [Piece(_FILE, 192, 16, (4,))],
            },
        },
        rank_local=({"trees": [], "tensors": {}},),
        format_version=1,
        complete=True,
    )


def _legacy_doc() -> dict[str, Any]:
    """The manifest as written before manifests carried their checksum."""
    doc = json.loads(v1_manifest_bytes(_manifest()))
    doc.pop(CHECKSUM_FIELD, None)
    return doc


def _parse(doc: dict[str, Any]) -> Manifest:
    return Manifest.from_json(json.dumps(doc).encode(), expected_step=5)


def test_written_manifest_carries_its_checksum_and_reads_back() -> None:
    data = v1_manifest_bytes(_manifest())
    assert isinstance(json.loads(data)[CHECKSUM_FIELD], int)
    assert Manifest.from_json(data, expected_step=5) == _manifest()


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'"offset":128', b'"offset":138'),  # a flipped digit in a piece's offset
        (b"[16,32]", b"[16,22]"),  # ... in a piece's flat range
        (b'"loss":0.5', b'"loss":0.6'),  # ... in a metric (extent checks cannot see it)
    ],
)
def test_changed_content_under_an_intact_checksum_is_corrupt(old: bytes, new: bytes) -> None:
    data = v1_manifest_bytes(_manifest())
    assert data.count(old) == 1
    with pytest.raises(CorruptCheckpointError, match=r"step 5: manifest checksum") as caught:
        Manifest.from_json(data.replace(old, new), expected_step=5)
    if old.startswith(b"[16"):  # what the extent checks find is reported too
        assert "its content is invalid too: tensor 'w': flat_range [16, 22]" in str(caught.value)


def test_changed_checksum_is_corrupt() -> None:
    doc = json.loads(v1_manifest_bytes(_manifest()))
    doc[CHECKSUM_FIELD] ^= 1 << 3
    with pytest.raises(CorruptCheckpointError, match=r"step 5: manifest checksum"):
        _parse(doc)
    doc[CHECKSUM_FIELD] = "0x1234"
    with pytest.raises(CorruptCheckpointError, match=CHECKSUM_FIELD):
        _parse(doc)


def test_reformatted_manifest_with_the_same_content_still_verifies() -> None:
    # Pretty-printed by a tool (`python -m json.tool` keeps the keys' order).
    pretty = json.dumps(json.loads(v1_manifest_bytes(_manifest())), indent=2).encode() + b"\n"
    assert Manifest.from_json(pretty, expected_step=5) == _manifest()


def test_manifest_without_checksum_still_reads() -> None:
    assert _parse(_legacy_doc()) == _manifest()


def test_a_format_1_manifest_is_read_never_written() -> None:
    read = Manifest.from_json(v1_manifest_bytes(_manifest()), expected_step=5)
    assert (read.format_version, read.complete) == (1, True)
    with pytest.raises(ValueError, match="format-1 manifest is read, never written"):
        read.to_json()


def _set(path: str, value: Any) -> dict[str, Any]:
    """The legacy manifest with one field (a `/`-path, list indices as numbers) replaced."""
    doc = _legacy_doc()
    *parents, last = path.split("/")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[int(last) if isinstance(node, list) else last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("tensors/w/pieces/1/flat_range", [16, 46], "holds 30 elements, shape"),
        ("tensors/w/pieces/1/flat_range", [26, 42], r"outside the 32 elements"),
        ("tensors/w/pieces/1/offset", 130, "not 64-byte aligned"),
        ("tensors/w/pieces/1/offset", 64, r"overlap"),
        ("tensors/b/pieces/0/offset", 128, r"overlap"),
        ("tensors/b/pieces/0/shape", [2, 2], r"shape \(2, 2\) is not the whole"),
        ("tensors/w/pieces/0/flat_range", None, r"shape \(16,\) is not the whole"),
        ("tensors/w/global_shape", [8, 3], r"outside the 24 elements"),
        ("files/rank-00000.bin/size", 200, "exceed file"),
    ],
)
def test_piece_extents_that_do_not_fit_are_corrupt(path: str, value: Any, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        _parse(_set(path, value))


def test_box_pieces_must_lie_inside_the_whole() -> None:
    doc = _legacy_doc()
    rows = [Piece(_FILE, 64, 64, (4, 4), (0, 0)), Piece(_FILE, 128, 64, (4, 4), (4, 0))]
    doc["tensors"]["w"]["pieces"] = [p.to_json() for p in rows]
    assert _parse(doc).tensors["w"]["pieces"] == rows
    doc["tensors"]["w"]["pieces"][1]["global_offset"] = [5, 0]
    with pytest.raises(CorruptCheckpointError, match=r"box at \(5, 0\) of shape \(4, 4\)"):
        _parse(doc)
    doc["tensors"]["w"]["pieces"][1]["global_offset"] = [4]
    with pytest.raises(CorruptCheckpointError, match=r"box at \(4,\) of shape \(4, 4\)"):
        _parse(doc)


def test_empty_pieces_may_claim_any_place() -> None:
    # [Note: empty pieces anywhere] in `_format/tree.py`: older writers kept the engine's flat
    # cursor, e.g. (1648, 1648); plan_layout gives an empty tensor the next tensor's offset.
    doc = _legacy_doc()
    doc["tensors"]["w"]["pieces"].append(Piece(_FILE, 128, 0, (0,), None, (1648, 1648)).to_json())
    assert len(_parse(doc).tensors["w"]["pieces"]) == 3


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("tensors/w/global_shape", [10**6, 10**6]),
        ("tensors/w/global_shape", [10**12, 1]),
        ("tensors/w/pieces/0/shape", [10**12]),
        ("tensors/w/pieces/0/flat_range", [0, 10**12]),
    ],
)
def test_huge_sizes_are_bounded_by_the_bytes_present(path: str, value: Any) -> None:
    start = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match="step 5"):
        _parse(_set(path, value))
    assert time.perf_counter() - start < 1.0
