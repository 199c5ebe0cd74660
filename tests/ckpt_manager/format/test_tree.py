"""`flatten`'s skeleton for lists of plain values ([Note: a list of plain values in one pass])."""

from __future__ import annotations

import dataclasses
import enum
import gc
import random
import weakref
from typing import Any

import pytest
import torch

from ckpt_manager import RankLocal
from ckpt_manager._format import tree
from ckpt_manager._format.tree import flatten


class _Level(enum.IntEnum):
    LOW = 1


def _visited(value: Any) -> Any:
    """The skeleton the generic walk gives (the fast path turned off)."""
    saved = tree._PLAIN_SCALARS
    tree._PLAIN_SCALARS = frozenset()
    try:
        return flatten(value)
    finally:
        tree._PLAIN_SCALARS = saved


def test_a_list_of_plain_values_gets_the_nodes_of_the_generic_walk() -> None:
    _, internal, gauss = random.getstate()
    state = {
        "rng": RankLocal({"python": [3, list(internal), gauss], "torch": torch.get_rng_state()}),
        "mixed": [1, 2.5, "x", None, True, False, float("nan")],  # NaN: saved as before
        "tuple": (1, 2),
        "empty": [],
        "nested": [[1, 2], [3, [4]]],
        "with_tensor": [1, torch.zeros(2)],
        "enum": [_Level.LOW, 2],
    }
    fast, generic = flatten(state), _visited(state)
    assert repr(fast.tree) == repr(generic.tree)
    assert repr(fast.rank_local_trees) == repr(generic.rank_local_trees)
    assert [leaf.key for leaf in fast.leaves] == [leaf.key for leaf in generic.leaves]
    nodes = dict(fast.tree[1])
    python = dict(fast.rank_local_trees[0][1])["python"]
    assert python[0] == "l"
    assert python[1][1] == ["l", [["v", x] for x in internal]]
    assert nodes["mixed"][1][:6] == [["v", 1], ["v", 2.5], ["v", "x"], ["v", None],
                                     ["v", True], ["v", False]]  # fmt: skip
    assert nodes["tuple"] == ["t", [["v", 1], ["v", 2]]]
    assert nodes["empty"] == ["l", []]


def test_a_list_holding_other_values_is_walked_item_by_item() -> None:
    # An IntEnum is an int, but not exactly one: it takes the generic path, as before.
    flat = flatten({"enum": [_Level.LOW, 2], "with_tensor": [1, torch.zeros(2)]})
    assert flat.tree == ["d", [
        ["enum", ["l", [["v", _Level.LOW], ["v", 2]]]],
        ["with_tensor", ["l", [["v", 1], ["T", "with_tensor/1"]]]],
    ]]  # fmt: skip
    assert [leaf.key for leaf in flat.leaves] == ["with_tensor/1"]


@dataclasses.dataclass(frozen=True)
class _Piece:
    """A frozen ShardedTensorLike, as the sharding engine's."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    flat_range: tuple[int, int] | None


@dataclasses.dataclass
class _MutablePiece:
    local: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    flat_range: tuple[int, int] | None


def _leaves(flat: tree.Flattened) -> list[tuple[Any, ...]]:
    return [(*leaf[:2], id(leaf.tensor), *leaf[3:]) for leaf in flat.leaves]


def test_a_memo_gives_the_leaves_of_a_fresh_flatten_and_revalidates_new_objects() -> None:
    """[Note: a sharded leaf is validated once]: the same frozen piece under the same key is
    taken from the memo; a new object, another key or a mutable piece is validated again."""
    weight = torch.arange(8.0)
    a = _Piece(weight[:4], (8,), (0,), (0, 4))
    b = _Piece(weight[4:], (8,), (0,), (4, 8))
    memo = tree.LeafMemo()
    state = {"model": {"a": a, "b": b}, "step": 3}
    first = flatten(state, memo=memo)
    again = flatten(state, memo=memo)
    assert _leaves(again) == _leaves(first) == _leaves(flatten(state))
    assert again.tree == first.tree
    # Under another key the same object is a new leaf.
    moved = flatten({"model": {"c": a, "b": b}}, memo=memo)
    assert [leaf.key for leaf in moved.leaves] == ["model/c", "model/b"]
    # A new object with a bad placement is checked, not taken for the old one.
    bad = _Piece(weight[:4], (8,), (0,), (6, 10))
    with pytest.raises(ValueError, match="flat_range"):
        flatten({"model": {"a": bad, "b": b}}, memo=memo)
    # A mutable piece is never kept: a change of its placement is seen.
    mutable = _MutablePiece(weight[:4], (8,), (0,), (0, 4))
    flatten({"m": mutable}, memo=memo)
    object.__setattr__(mutable, "flat_range", (6, 10))
    with pytest.raises(ValueError, match="flat_range"):
        flatten({"m": mutable}, memo=memo)
    # Two keys for one leaf are still refused on the memo's path.
    flatten({"p": {"q": a}}, memo=memo)
    with pytest.raises(ValueError, match="two state leaves"):
        flatten({"p": {"q": a}, "p/q": a}, memo=memo)


def test_a_memo_does_not_keep_a_dropped_piece_or_its_tensor() -> None:
    memo = tree.LeafMemo()
    piece = _Piece(torch.zeros(4), (4,), (0,), (0, 4))
    storage = weakref.ref(piece.local)
    held = weakref.ref(piece)
    flatten({"p": piece}, memo=memo)
    flatten({"p": piece}, memo=memo)
    del piece
    gc.collect()
    assert held() is None
    assert storage() is None
