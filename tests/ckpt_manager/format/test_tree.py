"""`flatten`'s skeleton for lists of plain values ([Note: a list of plain values in one pass])."""

from __future__ import annotations

import enum
import random
from typing import Any

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
