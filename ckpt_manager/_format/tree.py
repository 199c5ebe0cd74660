"""Flatten a nested state into a JSON skeleton plus tensor leaves, and rebuild it.

Skeleton nodes are small JSON lists, so a manifest is plain JSON and restore never unpickles::

    ["v", value]              plain JSON scalar (None, bool, int, float, str)
    ["d", [[key, node], ...]] dict (keys are str or int, order kept)
    ["l", [node, ...]]        list          ["t", [node, ...]]  tuple
    ["T", key]                a plain tensor (replicated; inside a RankLocal: this rank's)
    ["S", key]                a ShardedTensorLike or a DTensor (its box piece: `dtensor.py`)
    ["R", index]              a RankLocal subtree, stored per rank under `index`

Tensor keys are the `/`-joined path of the leaf; two leaves mapping to the same key (a dict
key containing `/`) are rejected rather than silently merged.
"""

from __future__ import annotations

import enum
import math
import weakref
from typing import Any, NamedTuple

import torch

from ckpt_manager._format.dtensor import dtensor_piece, is_dtensor
from ckpt_manager._types import RankLocal
from ckpt_manager.errors import CheckpointError

__all__ = [
    "Flattened",
    "LeafKind",
    "LeafMemo",
    "Placement",
    "TensorLeaf",
    "copy_into_template",
    "flatten",
    "is_sharded",
    "placement_key",
    "placement_of",
]


class LeafKind(enum.StrEnum):
    """How a tensor leaf is saved."""

    REPLICATED = "replicated"
    """Same on every rank: rank 0 writes it, every rank reads it."""
    SHARDED = "sharded"
    """Each rank writes its piece; restore reshards."""
    RANK_LOCAL = "rank_local"
    """Inside a RankLocal: every rank writes its own."""


class TensorLeaf(NamedTuple):
    """One tensor to stage."""

    key: str
    """Path key."""
    kind: LeafKind
    """Replicated, sharded or rank-local."""
    tensor: torch.Tensor
    """Data to copy (the local piece of a sharded leaf)."""
    global_shape: tuple[int, ...]
    """Whole-tensor shape (the tensor's own shape unless sharded)."""
    global_offset: tuple[int, ...] | None
    """Box offset of a sharded leaf, or None."""
    flat_range: tuple[int, int] | None
    """Flat range of a sharded leaf, or None."""


def placement_key(leaf: TensorLeaf) -> tuple[Any, ...]:
    """What a plan of `leaf` depends on (key, kind, dtype, shape and placement), as the raw
    objects: comparing two of them converts nothing (plan caches compare one per leaf per
    save)."""
    return (
        leaf.key,
        leaf.kind,
        leaf.tensor.dtype,
        leaf.tensor.shape,
        leaf.global_shape,
        leaf.global_offset,
        leaf.flat_range,
    )


class Flattened(NamedTuple):
    """A flattened state."""

    tree: Any
    """Skeleton with RankLocal subtrees replaced by `["R", index]`."""
    rank_local_trees: list[Any]
    """Skeletons of the RankLocal subtrees, by index."""
    leaves: list[TensorLeaf]
    """Tensor leaves in traversal order."""
    replica_leaves: dict[str, TensorLeaf] | None = None
    """With `flatten(..., keep_replicas=True)`: for each DTensor leaf that this rank holds as
    a replica (an empty piece in `leaves`, [Note: replicas write once]), the leaf of its
    actual local shard, by key; the memory tier snapshots those ([Note: the memory tier])."""


def is_sharded(value: object) -> bool:
    """Whether a leaf is a ShardedTensorLike (and not a plain tensor).

    The same test as `isinstance(value, ShardedTensorLike)` (a runtime protocol check is a
    `hasattr` per member), spelled out: Python 3.11's protocol machinery re-derives the member
    list on every call, which made it 60 % of `save()`'s time on a 780-leaf state.
    """
    if isinstance(value, torch.Tensor):
        return False
    return _has_sharded_members(value)


def _has_sharded_members(value: object) -> bool:
    # Spelled out rather than `all(hasattr(...) for ...)`: a generator per leaf showed in
    # `save()`'s profile ([Note: flatten per leaf]).
    return (
        hasattr(value, "local")
        and hasattr(value, "global_shape")
        and hasattr(value, "global_offset")
        and hasattr(value, "flat_range")
    )


def _check_tensor(t: torch.Tensor, path: str) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"state leaf {path!r}: only strided (dense) tensors can be saved")
    if t.is_quantized:
        raise TypeError(f"state leaf {path!r}: quantized tensors cannot be saved")


class Placement(NamedTuple):
    """Where a sharded piece lies in its whole tensor: exactly one of the two is set."""

    global_offset: tuple[int, ...] | None
    """Box offset, or None for a flat piece."""
    flat_range: tuple[int, int] | None
    """Flat range of the row-major whole, or None for a box."""


def placement_of(value: Any, key: str) -> Placement:
    """Validate a ShardedTensorLike's placement against its local tensor and global shape.

    [Note: empty pieces anywhere] A rank that owns none of a parameter gets an empty piece,
    and the sharding engine places it at its flat cursor, e.g. `(1648, 1648)` for a
    16-element parameter. An empty piece carries no data, so where it claims to lie does not
    matter: it is normalised to the origin (`(0, 0)`, or a zero box offset) instead of being
    rejected. Non-empty pieces must lie inside the whole tensor.

    Args:
        value: the ShardedTensorLike (its `local`, `global_shape`, `global_offset`,
            `flat_range`).
        key: the leaf's path, for messages.

    Returns:
        The (normalised) placement.

    Raises:
        ValueError: the placement does not fit the local tensor or the global shape.
    """
    return _placement(value, value.local, tuple(map(int, value.global_shape)), key)


def _placement(
    value: Any, local: torch.Tensor, global_shape: tuple[int, ...], key: str
) -> Placement:
    # [Note: flatten per leaf] `save()` flattens the whole state on the training thread, so
    # this runs once per sharded leaf per save (2200 on a model of a few hundred parameters
    # with AdamW state): `map(int, ...)` instead of generator expressions, `numel()` and
    # `dim()` asked once, the global shape converted once by the caller.
    numel_local = local.numel()
    flat = value.flat_range
    if flat is not None:
        start, end = int(flat[0]), int(flat[1])
        if local.dim() != 1 or end - start != numel_local:
            raise ValueError(
                f"state leaf {key!r}: flat_range {tuple(flat)} does not match a 1-D local of "
                f"{numel_local} elements"
            )
        if numel_local == 0:
            return _EMPTY_FLAT
        numel = math.prod(global_shape)
        if not 0 <= start < end <= numel:
            raise ValueError(
                f"state leaf {key!r}: flat_range {tuple(flat)} lies outside the {numel} "
                f"elements of global shape {global_shape}"
            )
        return Placement(None, (start, end))
    offset = tuple(map(int, value.global_offset))
    if len(offset) != len(global_shape) or local.dim() != len(global_shape):
        raise ValueError(
            f"state leaf {key!r}: offset {offset} / local shape {tuple(local.shape)} do not "
            f"match global shape {global_shape}"
        )
    if numel_local == 0:
        return Placement((0,) * len(offset), None)
    for o, n, g in zip(offset, local.shape, global_shape, strict=True):
        if o < 0 or o + n > g:
            raise ValueError(
                f"state leaf {key!r}: box at {offset} of shape {tuple(local.shape)} "
                f"exceeds global shape {global_shape}"
            )
    return Placement(offset, None)


_EMPTY_FLAT = Placement(None, (0, 0))


def _sharded_leaf(value: Any, key: str) -> TensorLeaf:
    local = value.local
    if not isinstance(local, torch.Tensor):
        raise TypeError(f"state leaf {key!r}: ShardedTensorLike.local must be a tensor")
    _check_tensor(local, key)
    global_shape = tuple(map(int, value.global_shape))
    where = _placement(value, local, global_shape, key)
    return TensorLeaf(
        key, LeafKind.SHARDED, local, global_shape, where.global_offset, where.flat_range
    )


_PLAIN_SCALARS = frozenset({type(None), bool, int, float, str})
"""Exact types of the JSON scalars a list's fast path takes (subclasses take `visit`).

[Note: a list of plain values in one pass] A rank's state holds long lists of plain values:
Python's RNG state alone is 625 ints (`daemon/rank/loop.py`'s `_rng_state`), 60% of the
default job's skeleton nodes. Visiting each costs a recursive call, its path key and six
type tests; a list whose items are all exact JSON scalars gets the same `["v", x]` nodes from
one comprehension (`flatten` of the default job's state: 1.16 -> ~0.5 ms of CPU). The
memory snapshot calls `flatten` on the training thread at every snapshot.
"""


class LeafMemo:
    """Sharded leaves validated by an earlier `flatten`, by object, for the next one.

    [Note: a sharded leaf is validated once] A caller that hands the same frozen pieces to
    every save (the sharding engine's are made once: [Note: saved pieces are made once] in
    `sharding/_state_dict.py`) gets each one's placement checked at its first `flatten` only;
    later calls take the leaf from here (the memory tier flattens the state on the training
    thread at every snapshot). Only frozen dataclass instances are kept, by weak reference and
    without their tensor (a dropped piece frees its storage); an entry serves the same object
    under the same key, and each `flatten` keeps just the entries it used.
    """

    def __init__(self) -> None:
        self.types: set[type] = set()
        """Types of the values kept (a node of another type is not looked up)."""
        self._entries: dict[int, _MemoEntry] = {}
        self._next: dict[int, _MemoEntry] = {}

    def get(self, value: Any, key: str) -> TensorLeaf | None:
        entry = self._entries.get(id(value))
        if entry is None or entry[1] != key:
            return None
        held = entry[0]()
        if held is not value:  # a dead entry (None) whose id a new object took
            return None
        self._next[id(value)] = entry
        return TensorLeaf(key, LeafKind.SHARDED, held.local, entry[2], entry[3], entry[4])

    def put(self, value: Any, leaf: TensorLeaf) -> None:
        cls = type(value)
        if _is_frozen(cls):
            self.types.add(cls)
            entry = (weakref.ref(value), leaf.key, leaf.global_shape, leaf.global_offset)
            self._next[id(value)] = (*entry, leaf.flat_range)

    def turn(self) -> None:
        """End one `flatten`: what it did not use is forgotten."""
        self._entries, self._next = self._next, {}


_MemoEntry = tuple[
    "weakref.ref[Any]", str, tuple[int, ...], tuple[int, ...] | None, tuple[int, int] | None
]
"""A kept leaf: its object (weakly), key, global shape, global offset and flat range."""
_FROZEN: dict[type, bool] = {}


def _is_frozen(cls: type) -> bool:
    frozen = _FROZEN.get(cls)
    if frozen is None:
        params = getattr(cls, "__dataclass_params__", None)
        frozen = _FROZEN[cls] = bool(params is not None and params.frozen) and hasattr(
            cls, "__weakref__"
        )
    return frozen


class _Flattener:
    def __init__(self, keep_replicas: bool, memo: LeafMemo | None) -> None:
        self.memo = memo
        self.leaves: list[TensorLeaf] = []
        self.rank_local: list[Any] = []
        self.keys: set[str] = set()
        self.replicas: dict[str, TensorLeaf] | None = {} if keep_replicas else None

    def _claim(self, key: str) -> str:
        if key in self.keys:
            raise ValueError(f"two state leaves map to the tensor key {key!r}; rename one")
        self.keys.add(key)
        return key

    def visit(self, value: Any, key: str, in_rank_local: bool) -> Any:
        # `key` is the `/`-joined path ("" at the root), built by concatenation as the walk
        # descends rather than joined from a path list at every node ([Note: flatten per
        # leaf]).
        cls = type(value)
        # Exact built-in containers and scalars first: they have no sharded members, and the
        # four failing `hasattr` of that test were a third of a dict node's cost.
        if cls is dict:
            return self._dict(value, key, in_rank_local)
        if cls in _PLAIN_SCALARS:
            return ["v", value]
        if cls is list or cls is tuple:
            return self._sequence(value, key, in_rank_local)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, key or "<root>", in_rank_local)
        if isinstance(value, RankLocal):
            if in_rank_local:
                raise TypeError(f"state leaf {key or '<root>'!r}: RankLocal cannot be nested")
            index = len(self.rank_local)
            self.rank_local.append(None)
            self.rank_local[index] = self.visit(value.value, key, True)
            return ["R", index]
        memo = self.memo
        if memo is not None and cls in memo.types and not in_rank_local:
            # [Note: a sharded leaf is validated once]
            known = memo.get(value, key or "<root>")
            if known is not None:
                self._claim(known.key)
                self.leaves.append(known)
                return ["S", known.key]
        if _has_sharded_members(value):  # not a tensor: that was tested first
            key = key or "<root>"
            if in_rank_local:
                raise TypeError(f"state leaf {key!r}: a sharded tensor inside RankLocal")
            leaf = _sharded_leaf(value, self._claim(key))
            self.leaves.append(leaf)
            if memo is not None:
                memo.put(value, leaf)
            return ["S", key]
        if value is None or isinstance(value, bool | int | float | str):
            return ["v", value]
        if isinstance(value, dict):
            return self._dict(value, key, in_rank_local)
        if isinstance(value, list | tuple):
            return self._sequence(value, key, in_rank_local)
        raise TypeError(
            f"state leaf {key or '<root>'!r} has type {type(value).__name__}: use tensors, "
            "sharded tensors, RankLocal or plain JSON values (convert numpy arrays to tensors)"
        )

    def _dict(self, value: dict[Any, Any], key: str, in_rank_local: bool) -> Any:
        items = []
        prefix = f"{key}/" if key else ""
        for k, v in value.items():
            if type(k) is not str and (isinstance(k, bool) or not isinstance(k, str | int)):
                raise TypeError(
                    f"state dict under {key or '<root>'!r} has key {k!r}: use str or int keys"
                )
            items.append([k, self.visit(v, prefix + str(k), in_rank_local)])
        return ["d", items]

    def _sequence(self, value: list[Any] | tuple[Any, ...], key: str, in_rank_local: bool) -> Any:
        tag = "t" if isinstance(value, tuple) else "l"
        if _PLAIN_SCALARS.issuperset(map(type, value)):
            # [Note: a list of plain values in one pass] the same nodes as below.
            return [tag, [["v", v] for v in value]]
        prefix = f"{key}/" if key else ""
        return [
            tag,
            [self.visit(v, prefix + str(i), in_rank_local) for i, v in enumerate(value)],
        ]

    def _tensor(self, value: torch.Tensor, key: str, in_rank_local: bool) -> Any:
        if is_dtensor(value):
            if in_rank_local:
                raise TypeError(f"state leaf {key!r}: a DTensor inside RankLocal")
            piece = dtensor_piece(value, key, for_write=True)
            self.leaves.append(_sharded_leaf(piece, self._claim(key)))
            if self.replicas is not None and piece.flat_range is not None:
                held = dtensor_piece(value, key, for_write=False)
                if held.local.numel() > 0:  # a replica, not a rank outside the mesh
                    self.replicas[key] = _sharded_leaf(held, key)
            return ["S", key]
        _check_tensor(value, key)
        kind = LeafKind.RANK_LOCAL if in_rank_local else LeafKind.REPLICATED
        shape = tuple(value.shape)
        self.leaves.append(TensorLeaf(self._claim(key), kind, value, shape, None, None))
        return ["T", key]


def flatten(state: Any, *, keep_replicas: bool = False, memo: LeafMemo | None = None) -> Flattened:
    """Flatten a state (see the module docstring for the skeleton).

    Args:
        state: the state.
        keep_replicas: also record the local shard of each DTensor replica
            (`Flattened.replica_leaves`).
        memo: sharded leaves an earlier call validated ([Note: a sharded leaf is validated
            once]); updated with this call's.

    Raises:
        TypeError: an unsupported leaf type (the message names its path).
        ValueError: inconsistent sharded-tensor metadata or colliding keys.
    """
    f = _Flattener(keep_replicas, memo)
    try:
        tree = f.visit(state, "", False)
    finally:
        if memo is not None:
            memo.turn()
    return Flattened(tree, f.rank_local, f.leaves, f.replicas)


def copy_into_template(template: torch.Tensor, value: torch.Tensor, path: str, step: int) -> None:
    """Copy a restored whole tensor into the template's tensor at `path`, same shape only.

    Raises:
        CheckpointError: the shapes differ (the message names the step, path and both).
    """
    if tuple(value.shape) != tuple(template.shape):
        raise CheckpointError(
            f"step {step}: tensor {path!r} was saved with shape "
            f"{tuple(value.shape)}, the template has {tuple(template.shape)}"
        )
    with torch.no_grad():
        template.copy_(value)
