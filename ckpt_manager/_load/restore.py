"""Loading a verified step into a state: the saved structure, or a template filled in place.

Loading never unpickles: manifests are JSON, tensors are raw bytes at manifest offsets.
Listing and verifying steps lives in `_catalog` (torch-free).

A format-2 step is loaded from its top manifest plus only the index objects of the ranks
holding the tensors the rank builds, and its own (for its RankLocal state); each index is
read once, checked against the manifest's size and CRC-32 ([Note: the top manifest stays
small] in `_format/manifest.py`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from ckpt_manager._format.layout import index_file_name, step_dir
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._format.pieces import Piece
from ckpt_manager._format.rank_index import RankIndex, check_rank_index, piece_of
from ckpt_manager._format.shard_file import dtype_from_name
from ckpt_manager._format.tree import copy_into_template, is_sharded, placement_of
from ckpt_manager._load.reshard import Region, fill_region
from ckpt_manager._store.storage import Storage
from ckpt_manager._types import ALIASES_KEY, RankLocal
from ckpt_manager.errors import CheckpointError, CorruptCheckpointError

__all__ = ["load_state", "read_bytes", "read_piece", "read_piece_into"]

_READ_CHUNK = 64 << 20
"""Largest single read: a huge piece arrives in parts, so a restore can report progress."""


def read_piece(
    storage: Storage,
    step: int,
    piece: Piece,
    dtype: torch.dtype,
    start: int,
    end: int,
    on_read: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Read elements `[start, end)` of one stored piece: only those bytes are fetched.

    Args:
        storage: the checkpoint root.
        step: the committed step the piece belongs to.
        piece: the piece (file, byte offset) from the step's manifest.
        dtype: the tensor's element type.
        start: first element, counted within the piece.
        end: one past the last element.
        on_read: called with the byte count after each read (at most 64 MiB each).

    Returns:
        A new 1-D CPU tensor of `end - start` elements (empty when `end <= start`).

    Raises:
        CorruptCheckpointError: the file is shorter than the manifest says.
        StorageError: the read failed.
    """
    out = torch.empty(max(end - start, 0), dtype=dtype)
    read_piece_into(storage, step, piece, start, out, on_read)
    return out


def read_piece_into(
    storage: Storage,
    step: int,
    piece: Piece,
    start: int,
    out: torch.Tensor,
    on_read: Callable[[int], None] | None = None,
) -> None:
    """Read elements `[start, start + out.numel())` of one stored piece straight into `out`.

    [Note: a durable restore reads into its tensors] A restore reads every stored byte twice
    (the checksum pass, then the load). The load read each piece into a new bytes object
    (its fresh pages faulted in at every read), appended it to a bytearray, wrapped it and
    copied it into the template: 0.34 s of a 256 MiB rank's restore, its bytes already in the
    page cache from the checksum pass. Now the checksum pass reads into one reused buffer and
    the load into the tensor that keeps the elements (the template's own piece where it lies
    in one run of it): 0.05 s (`bench/restore_cost.py --profile`).

    Args:
        storage: the checkpoint root.
        step: the committed step the piece belongs to.
        piece: the piece (file, byte offset) from the step's manifest.
        start: first element, counted within the piece.
        out: a contiguous CPU tensor of the piece's dtype.
        on_read: called with the byte count after each read (at most 64 MiB each).

    Raises:
        CorruptCheckpointError: the file is shorter than the manifest says.
        StorageError: the read failed.
    """
    view = _writable_bytes(out)
    name = f"{step_dir(step)}/{piece.file}"
    lo = piece.offset + start * out.element_size()
    for part in range(0, len(view), _READ_CHUNK):
        chunk = view[part : part + _READ_CHUNK]
        got = storage.read_into(name, lo + part, chunk)
        if on_read is not None:
            on_read(got)
        if got != len(chunk):
            raise CorruptCheckpointError(f"step {step}: {piece.file} is short")


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable buffer (no copy; the tensor must
    outlive it)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("reads go into contiguous CPU tensors")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


def read_bytes(
    storage: Storage,
    name: str,
    lo: int,
    hi: int,
    on_read: Callable[[int], None] | None = None,
) -> bytearray:
    """Bytes `[lo, hi)` of an object in reads of at most 64 MiB, each reported to `on_read`;
    shorter than asked when the object ends early."""
    data = bytearray()
    for part in range(lo, hi, _READ_CHUNK):
        chunk = storage.read(name, part, min(hi, part + _READ_CHUNK))
        data += chunk
        if on_read is not None:
            on_read(len(chunk))
        if len(chunk) != min(hi, part + _READ_CHUNK) - part:
            break
    return data


class _Loader:
    def __init__(
        self,
        storage: Storage,
        manifest: Manifest,
        rank: int,
        on_read: Callable[[int], None] | None = None,
    ) -> None:
        self.storage = storage
        self.m = manifest
        self.rank = rank
        self.on_read = on_read
        self._indexes: dict[int, RankIndex] = {}

    def read(self, piece: Piece, dtype: torch.dtype, start: int, end: int) -> torch.Tensor:
        return read_piece(self.storage, self.m.step, piece, dtype, start, end, self.on_read)

    def index(self, rank: int) -> RankIndex:
        """A rank's index object (format 2), read on first use."""
        found = self._indexes.get(rank)
        if found is None:
            name = index_file_name(rank, self.m.spread_prefixes)
            if name not in self.m.files:
                raise CorruptCheckpointError(f"step {self.m.step}: no index of rank {rank}")
            data = read_bytes(
                self.storage,
                f"{step_dir(self.m.step)}/{name}",
                0,
                self.m.files[name].size,
                self.on_read,
            )
            found = self._indexes[rank] = check_rank_index(self.m, rank, data)
        return found

    def _spec(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        rec = self.m.tensors.get(key)
        if rec is None:
            raise CorruptCheckpointError(f"step {self.m.step}: tree names unknown tensor {key!r}")
        return dtype_from_name(rec["dtype"]), tuple(rec["global_shape"])

    def _pieces(self, key: str) -> list[Piece]:
        """The stored pieces of a tensor (format 2: reads its holders' indexes)."""
        rec = self.m.tensors[key]
        if self.m.complete:
            return list(rec["pieces"])
        return [piece_of(self.index(r), key) for r in rec["ranks"]]

    def rank_local(self) -> dict[str, Any] | None:
        """This rank's saved RankLocal state (`{"trees", "tensors"}`), None if it was not
        a saved rank."""
        if self.m.complete:
            if self.rank >= len(self.m.rank_local):
                return None
            mine = dict(self.m.rank_local[self.rank])
        else:
            if self.rank >= self.m.world_size:
                return None
            own = self.index(self.rank)
            mine = {
                "trees": list(own.rank_local_trees),
                "tensors": {k: {"dtype": d, "piece": p} for k, (d, p) in own.rank_local.items()},
            }
        # A saved rank records each RankLocal subtree the tree names; only a rank `ckptctl
        # reshard` added past the saved world records none (format 2 has an index for every
        # rank): like a rank past a format-1 manifest's `rank_local`, it keeps its template.
        return mine if mine["trees"] else None

    def _local_record(self, key: str, rl: dict[str, Any]) -> tuple[torch.dtype, Piece]:
        rec = rl["tensors"].get(key)
        if rec is None:
            raise CorruptCheckpointError(f"step {self.m.step}: unknown rank-local tensor {key!r}")
        return dtype_from_name(rec["dtype"]), rec["piece"]

    def whole(self, node: list[Any], rl: dict[str, Any] | None) -> torch.Tensor:
        key = node[1]
        if rl is not None:
            dtype, piece = self._local_record(key, rl)
            return self.read(piece, dtype, 0, self._numel(piece.shape)).reshape(piece.shape)
        dtype, shape = self._spec(key)
        out = torch.empty(shape, dtype=dtype)
        region = Region(shape, offset=(0,) * len(shape), shape=shape)
        self.fill(out, region, key, dtype, self._pieces(key))
        return out

    @staticmethod
    def _numel(shape: tuple[int, ...]) -> int:
        n = 1
        for d in shape:
            n *= d
        return n

    def fill(
        self,
        target: torch.Tensor,
        region: Region,
        key: str,
        dtype: torch.dtype,
        pieces: list[Piece],
    ) -> None:
        def read(p: Piece, s: int, e: int) -> torch.Tensor:
            return self.read(p, dtype, s, e)

        def read_into(p: Piece, s: int, out: torch.Tensor) -> None:
            read_piece_into(self.storage, self.m.step, p, s, out, self.on_read)

        fill_region(target, region, pieces, read, key, read_into=read_into)

    def build(self, node: Any, rl: dict[str, Any] | None = None) -> Any:
        tag, body = node[0], node[1]
        if tag == "v":
            return body
        if tag == "d":
            return {k: self.build(v, rl) for k, v in body}
        if tag in ("l", "t"):
            items = [self.build(v, rl) for v in body]
            return tuple(items) if tag == "t" else items
        if tag in ("T", "S"):
            return self.whole(node, rl)
        if tag == "R":
            mine = self.rank_local()
            if mine is None:
                return None
            return self.build(mine["trees"][body], mine)
        raise CorruptCheckpointError(f"step {self.m.step}: unknown tree node {tag!r}")

    def into(self, node: Any, template: Any, path: str, rl: dict[str, Any] | None = None) -> Any:
        tag = node[0]
        if isinstance(template, RankLocal):
            if tag != "R":
                raise self._mismatch(path, "RankLocal", tag)
            mine = self.rank_local()
            if mine is None:
                return template.value
            return self.into(mine["trees"][node[1]], template.value, path, mine)
        if isinstance(template, torch.Tensor):
            if tag not in ("T", "S"):
                raise self._mismatch(path, "tensor", tag)
            copy_into_template(template, self.whole(node, rl), path, self.m.step)
            return template
        if is_sharded(template):
            if tag not in ("T", "S") or rl is not None:
                raise self._mismatch(path, "sharded tensor", tag)
            self._into_sharded(node[1], template, path)
            return template
        if isinstance(template, dict):
            if tag != "d":
                raise self._mismatch(path, "dict", tag)
            saved = {k: v for k, v in node[1]}
            missing = [k for k in template if k not in saved and k != ALIASES_KEY]
            if missing:
                raise CheckpointError(
                    f"step {self.m.step}: keys {missing} under {path!r} are not in the checkpoint"
                )
            return {
                k: self.into(saved[k], v, f"{path}/{k}", rl) if k in saved else v
                for k, v in template.items()
            }
        if isinstance(template, list | tuple):
            if tag not in ("l", "t") or len(node[1]) != len(template):
                raise self._mismatch(path, f"sequence of {len(template)}", tag)
            items = [
                self.into(n, t, f"{path}/{i}", rl)
                for i, (n, t) in enumerate(zip(node[1], template, strict=True))
            ]
            return tuple(items) if isinstance(template, tuple) else items
        return self.build(node, rl)

    def _into_sharded(self, key: str, template: Any, path: str) -> None:
        dtype, shape = self._spec(key)
        if tuple(int(d) for d in template.global_shape) != shape:
            raise CheckpointError(
                f"step {self.m.step}: {path!r} was saved with global shape {shape}, the "
                f"template has {tuple(template.global_shape)}"
            )
        local = template.local
        try:
            where = placement_of(template, path)
        except ValueError as err:
            raise CheckpointError(f"step {self.m.step}: template {err}") from err
        if where.flat_range is not None:
            region = Region(shape, flat_range=where.flat_range)
        else:
            region = Region(shape, offset=where.global_offset, shape=tuple(local.shape))
        if region.numel == 0:
            return  # nothing of it is this rank's: no index of its holders is read
        pieces = self._pieces(key)
        if local.dtype == dtype and local.device.type == "cpu":
            with torch.no_grad():
                self.fill(local, region, key, dtype, pieces)
            return
        # Assemble on the CPU in the saved dtype, then one copy casts and/or moves it.
        staged = torch.empty(tuple(local.shape), dtype=dtype)
        self.fill(staged, region, key, dtype, pieces)
        with torch.no_grad():
            local.copy_(staged)

    def _mismatch(self, path: str, expected: str, tag: str) -> CheckpointError:
        kinds = {"v": "value", "d": "dict", "l": "list", "t": "tuple", "T": "tensor"}
        found = kinds.get(tag, {"S": "sharded tensor", "R": "RankLocal"}.get(tag, tag))
        return CheckpointError(
            f"step {self.m.step}: {path or '<root>'!r} is a {expected} in the template but a "
            f"{found} in the checkpoint"
        )


def load_state(
    storage: Storage,
    manifest: Manifest,
    rank: int,
    into: Any | None,
    on_read: Callable[[int], None] | None = None,
) -> Any:
    """Load a verified step for `rank`: the saved structure, or the template's filled in place.

    Without a template sharded tensors come back whole (consolidated) and RankLocal subtrees
    as this rank's subtree (None if the rank did not exist). With one, tensors and sharded
    tensors are filled in place (resharded to the template's offsets or flat ranges) and
    returned as the same objects. `on_read(num_bytes)` follows every read from storage.

    Raises:
        CheckpointError: the template does not match the checkpoint.
        CorruptCheckpointError: stored data is inconsistent.
    """
    loader = _Loader(storage, manifest, rank, on_read)
    if into is None:
        return loader.build(manifest.tree)
    return loader.into(manifest.tree, into, "")
