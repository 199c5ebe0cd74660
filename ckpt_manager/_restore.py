"""Reading committed steps: listing, manifests, verification and loading into a state.

Loading never unpickles: manifests are JSON, tensors are raw bytes at manifest offsets.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

import structlog
import torch

from ckpt_manager._format import dtype_from_name
from ckpt_manager._manifest import MANIFEST_NAME, Manifest, Piece, parse_step_dir, step_dir
from ckpt_manager._reshard import Region, fill_region
from ckpt_manager._storage import Storage
from ckpt_manager._tree import is_sharded
from ckpt_manager._types import RankLocal
from ckpt_manager.errors import (
    CheckpointError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    StepNotFoundError,
)

__all__ = [
    "committed_steps",
    "drop_dead_attempts",
    "list_step_dirs",
    "load_state",
    "read_manifest",
    "verify_files",
]

_READ_CHUNK = 64 << 20
_log = structlog.get_logger("ckpt_manager.restore")


def list_step_dirs(storage: Storage) -> list[int]:
    """Steps that have a folder under the root (committed or not), ascending."""
    steps = (parse_step_dir(n) for n in storage.list_names())
    return sorted(s for s in steps if s is not None)


def committed_steps(storage: Storage) -> list[int]:
    """Steps whose manifest exists, ascending (contents not verified)."""
    return [s for s in list_step_dirs(storage) if storage.exists(f"{step_dir(s)}/{MANIFEST_NAME}")]


def drop_dead_attempts(storage: Storage) -> tuple[int, float] | None:
    """Coordinator at start, holding the lease: remove uncommitted folders past the newest commit.

    No live run writes under a leased root, so such a folder is a dead attempt; removing it
    first guarantees a step folder is never written twice.

    Returns:
        `(newest committed step, its commit time)`, or None when nothing is committed.
    """
    steps = list_step_dirs(storage)
    committed = [s for s in steps if storage.exists(f"{step_dir(s)}/{MANIFEST_NAME}")]
    latest = committed[-1] if committed else None
    for s in steps:
        if s not in committed and (latest is None or s > latest):
            _log.warning("ckpt_removing_stale_attempt", ckpt_step=s)
            storage.remove_tree(step_dir(s))
    if latest is None:
        return None
    try:
        return (latest, read_manifest(storage, latest).committed_unix_s)
    except CheckpointError:
        return (latest, 0.0)


def read_manifest(storage: Storage, step: int) -> Manifest:
    """Read and validate a step's manifest.

    Raises:
        StepNotFoundError: no manifest (the step is not committed).
        CorruptCheckpointError: the manifest is invalid.
    """
    try:
        data = storage.read(f"{step_dir(step)}/{MANIFEST_NAME}")
    except ObjectNotFoundError as err:
        raise StepNotFoundError(
            f"step {step} is not committed under {storage.root_uri} (no manifest)"
        ) from err
    return Manifest.from_json(data, expected_step=step)


def verify_files(
    storage: Storage, manifest: Manifest, names: Iterable[str], *, check_crc: bool
) -> None:
    """Check that files exist with the manifest's size (and crc32).

    Raises:
        CorruptCheckpointError: the first file that fails, and why.
    """
    folder = step_dir(manifest.step)
    for name in names:
        entry = manifest.files[name]
        path = f"{folder}/{name}"
        try:
            size = storage.size(path)
        except ObjectNotFoundError as err:
            raise CorruptCheckpointError(f"step {manifest.step}: file {name} is missing") from err
        if size != entry.size:
            raise CorruptCheckpointError(
                f"step {manifest.step}: file {name} has {size} bytes, manifest says {entry.size}"
            )
        if not check_crc:
            continue
        crc = 0
        for start in range(0, size, _READ_CHUNK):
            crc = zlib.crc32(storage.read(path, start, min(size, start + _READ_CHUNK)), crc)
        if crc != entry.crc32:
            raise CorruptCheckpointError(
                f"step {manifest.step}: file {name} checksum {crc:#010x} != manifest "
                f"{entry.crc32:#010x} (corrupted bytes)"
            )


class _Loader:
    def __init__(self, storage: Storage, manifest: Manifest, rank: int) -> None:
        self.storage = storage
        self.m = manifest
        self.rank = rank
        self.folder = step_dir(manifest.step)

    def read(self, piece: Piece, dtype: torch.dtype, start: int, end: int) -> torch.Tensor:
        if end <= start:
            return torch.empty(0, dtype=dtype)
        lo = piece.offset + start * dtype.itemsize
        hi = piece.offset + end * dtype.itemsize
        data = self.storage.read(f"{self.folder}/{piece.file}", lo, hi)
        if len(data) != hi - lo:
            raise CorruptCheckpointError(f"step {self.m.step}: {piece.file} is short")
        return torch.frombuffer(bytearray(data), dtype=dtype)

    def _record(self, key: str) -> tuple[torch.dtype, list[Piece], tuple[int, ...]]:
        rec = self.m.tensors.get(key)
        if rec is None:
            raise CorruptCheckpointError(f"step {self.m.step}: tree names unknown tensor {key!r}")
        return dtype_from_name(rec["dtype"]), list(rec["pieces"]), tuple(rec["global_shape"])

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
        dtype, pieces, shape = self._record(key)
        out = torch.empty(shape, dtype=dtype)
        self.fill(out, Region(shape, offset=(0,) * len(shape), shape=shape), key, dtype, pieces)
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

        fill_region(target, region, pieces, read, key)

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
            if self.rank >= len(self.m.rank_local):
                return None
            mine = self.m.rank_local[self.rank]
            return self.build(mine["trees"][body], dict(mine))
        raise CorruptCheckpointError(f"step {self.m.step}: unknown tree node {tag!r}")

    def into(self, node: Any, template: Any, path: str, rl: dict[str, Any] | None = None) -> Any:
        tag = node[0]
        if isinstance(template, RankLocal):
            if tag != "R":
                raise self._mismatch(path, "RankLocal", tag)
            if self.rank >= len(self.m.rank_local):
                return template.value
            mine = self.m.rank_local[self.rank]
            return self.into(mine["trees"][node[1]], template.value, path, dict(mine))
        if isinstance(template, torch.Tensor):
            if tag not in ("T", "S"):
                raise self._mismatch(path, "tensor", tag)
            value = self.whole(node, rl)
            if tuple(value.shape) != tuple(template.shape):
                raise CheckpointError(
                    f"step {self.m.step}: tensor {path!r} was saved with shape "
                    f"{tuple(value.shape)}, the template has {tuple(template.shape)}"
                )
            with torch.no_grad():
                template.copy_(value)
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
            missing = [k for k in template if k not in saved]
            if missing:
                raise CheckpointError(
                    f"step {self.m.step}: keys {missing} under {path!r} are not in the checkpoint"
                )
            return {k: self.into(saved[k], v, f"{path}/{k}", rl) for k, v in template.items()}
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
        dtype, pieces, shape = self._record(key)
        if tuple(int(d) for d in template.global_shape) != shape:
            raise CheckpointError(
                f"step {self.m.step}: {path!r} was saved with global shape {shape}, the "
                f"template has {tuple(template.global_shape)}"
            )
        local = template.local
        if template.flat_range is not None:
            start, end = (int(x) for x in template.flat_range)
            region = Region(shape, flat_range=(start, end))
        else:
            region = Region(shape, offset=template.global_offset, shape=tuple(local.shape))
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


def load_state(storage: Storage, manifest: Manifest, rank: int, into: Any | None) -> Any:
    """Load a verified step for `rank`: the saved structure, or the template's filled in place.

    Without a template sharded tensors come back whole (consolidated) and RankLocal subtrees
    as this rank's subtree (None if the rank did not exist). With one, tensors and sharded
    tensors are filled in place (resharded to the template's offsets or flat ranges) and
    returned as the same objects.

    Raises:
        CheckpointError: the template does not match the checkpoint.
        CorruptCheckpointError: stored data is inconsistent.
    """
    loader = _Loader(storage, manifest, rank)
    if into is None:
        return loader.build(manifest.tree)
    return loader.into(manifest.tree, into, "")
