"""One committed step opened for region reads: the narrow API readers outside the manager use.

`StepRegions` answers three questions about a committed step and nothing more: its state's
skeleton, each tensor's dtype and global shape, and "fill this box of tensor K". The DCP
reader (`ckpt_manager/dcp.py`) builds on it alone, so how the step's metadata is laid out on
storage stays below this module. Every file a read touches is verified (size, and crc32
unless disabled) the first time it is touched, so corrupted bytes never reach a caller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ckpt_manager._format.layout import index_file_name, step_dir
from ckpt_manager._format.pieces import Piece
from ckpt_manager._format.rank_index import RankIndex, check_rank_index, piece_of
from ckpt_manager._format.shard_file import dtype_from_name
from ckpt_manager._load.reshard import Region, fill_region
from ckpt_manager._load.restore import read_bytes, read_piece
from ckpt_manager._store.steps import committed_steps, read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import CheckpointError, CorruptCheckpointError, StepNotFoundError

__all__ = ["StepRegions", "TensorInfo"]


class TensorInfo(NamedTuple):
    """What a stored tensor is, without its data."""

    dtype: torch.dtype
    """Element type as saved."""
    global_shape: tuple[int, ...]
    """Shape of the whole tensor."""


class StepRegions:
    """A committed step of a checkpoint root, read box by box.

    Args:
        storage: the checkpoint root.
        step: the committed step; None opens the newest committed step.
        verify_checksums: check each touched file's crc32 before its bytes are used (sizes
            are always checked).
        on_read: called with the byte count of every read from storage.

    Raises:
        StepNotFoundError: no such committed step (or none at all).
        CorruptCheckpointError: the step's metadata is invalid.
    """

    def __init__(
        self,
        storage: Storage,
        step: int | None = None,
        *,
        verify_checksums: bool = True,
        on_read: Callable[[int], None] | None = None,
    ) -> None:
        if step is None:
            steps = committed_steps(storage)
            if not steps:
                raise StepNotFoundError(f"{storage.root_uri}: no committed step")
            step = steps[-1]
        self.storage = storage
        self._manifest = read_manifest(storage, step)
        self._verify = verify_checksums
        self._on_read = on_read
        self._verified: set[str] = set()
        self._indexes: dict[int, RankIndex] = {}
        self._lock = threading.Lock()  # readers may fill from several threads

    @property
    def step(self) -> int:
        """The step opened."""
        return self._manifest.step

    @property
    def tree(self) -> Any:
        """The saved state's skeleton (node forms in `_format/tree.py`)."""
        return self._manifest.tree

    def tensor(self, key: str) -> TensorInfo:
        """The dtype and global shape of the replicated or sharded tensor `key`.

        Raises:
            CheckpointError: no such tensor in the step.
        """
        rec = self._manifest.tensors.get(key)
        if rec is None:
            raise CheckpointError(f"step {self.step}: no tensor {key!r}")
        return TensorInfo(dtype_from_name(rec["dtype"]), tuple(int(d) for d in rec["global_shape"]))

    def fill(self, key: str, target: torch.Tensor, offset: Sequence[int]) -> None:
        """Fill `target` (CPU, the saved dtype) with the box of tensor `key` at `offset`.

        Raises:
            CheckpointError: no such tensor, or a target of another dtype / off the CPU.
            CorruptCheckpointError: a file it needs fails verification, or the stored pieces
                do not cover the box.
        """
        info = self.tensor(key)
        if target.dtype != info.dtype or target.device.type != "cpu":
            raise CheckpointError(
                f"step {self.step}: tensor {key!r} fills a CPU {info.dtype} target, got "
                f"{target.device.type} {target.dtype}"
            )
        pieces = self._pieces(key)
        region = Region(info.global_shape, offset=offset, shape=tuple(target.shape))

        def read(piece: Piece, start: int, end: int) -> torch.Tensor:
            self._check_file(piece.file)
            return read_piece(self.storage, self.step, piece, info.dtype, start, end, self._on_read)

        fill_region(target, region, pieces, read, key)

    def whole(self, key: str) -> torch.Tensor:
        """The whole tensor `key`, in its saved dtype (see `fill` for errors)."""
        info = self.tensor(key)
        out = torch.empty(info.global_shape, dtype=info.dtype)
        self.fill(key, out, (0,) * len(info.global_shape))
        return out

    def _pieces(self, key: str) -> list[Piece]:
        """The stored pieces of tensor `key`: from the manifest (format 1), or from the
        indexes of the ranks that hold it (format 2; each index read once, checked against
        the manifest)."""
        rec = self._manifest.tensors[key]
        if self._manifest.complete:
            return list(rec["pieces"])
        return [piece_of(self._index(int(rank)), key) for rank in rec["ranks"]]

    def _index(self, rank: int) -> RankIndex:
        with self._lock:
            found = self._indexes.get(rank)
        if found is not None:
            return found
        name = index_file_name(rank, self._manifest.spread_prefixes)
        entry = self._manifest.files.get(name)
        if entry is None:
            raise CorruptCheckpointError(f"step {self.step}: no index of rank {rank}")
        data = read_bytes(
            self.storage, f"{step_dir(self.step)}/{name}", 0, entry.size, self._on_read
        )
        found = check_rank_index(self._manifest, rank, data)
        with self._lock:
            self._indexes[rank] = found
        return found

    def _check_file(self, name: str) -> None:
        with self._lock:
            if name in self._verified:
                return
            verify_files(
                self.storage,
                self._manifest,
                [name],
                check_crc=self._verify,
                on_read=self._on_read,
            )
            self._verified.add(name)
