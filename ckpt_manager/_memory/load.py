"""Reading one memory slot: verify its payload, rebuild the state or fill a template.

Purely local: the payload file is mapped copy-on-write (nothing is written to it), checked
against the meta's checksum, and every tensor is a copy of its bytes, so the restored state
is bitwise the snapshot and no longer needs the slot once `load_slot` returns.

Without a template the saved structure comes back as a durable restore gives it (RankLocal
subtrees as this rank's subtree); a sharded leaf comes back whole, so only a snapshot whose
sharded leaves are whole on this rank can be loaded that way (`needs_template`). With a
template (its layout fingerprint checked by the caller) tensors, sharded tensors' local
pieces and DTensor pieces are filled in place and the template's structure is returned.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any

import torch

from ckpt_manager._format.checksum import checksum
from ckpt_manager._format.shard_file import dtype_from_name
from ckpt_manager._format.tree import copy_into_template, is_sharded
from ckpt_manager._memory.meta import SlotMeta
from ckpt_manager._types import ALIASES_KEY, RankLocal
from ckpt_manager.errors import CheckpointError

__all__ = ["load_slot", "map_verified", "needs_template", "verify_slot"]


def _map(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"payload file is shorter than the meta's {nbytes} bytes")
        # Copy-on-write and never written: a writable buffer (torch.frombuffer and ISA-L's
        # CRC take its address) without touching the file.
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE)
    finally:
        os.close(fd)


def verify_slot(path: str, meta: SlotMeta) -> str | None:
    """Why the payload at `path` does not match `meta` (None: it does)."""
    mapped, refused = map_verified(path, meta)
    if mapped is not None:
        mapped.close()
    return refused


def map_verified(path: str, meta: SlotMeta) -> tuple[mmap.mmap | None, str | None]:
    """The payload at `path` mapped and checked against `meta`: `(mapping, None)`, or
    `(None, why not)`. The caller closes the mapping; `load_slot(..., mapped=it)` loads from
    the pages the check already mapped ([Note: the chosen slot is verified once])."""
    try:
        mm = _map(path, meta.payload_bytes)
    except (OSError, ValueError) as err:
        return None, str(err)
    try:
        view = memoryview(mm)
        try:
            found = checksum(meta.algorithm, view)
        finally:
            view.release()
    except BaseException:
        mm.close()
        raise
    if found != meta.checksum:
        mm.close()
        return None, (
            f"checksum mismatch ({meta.algorithm.value} {found:#010x}, meta {meta.checksum:#010x})"
        )
    return mm, None


def needs_template(meta: SlotMeta) -> bool:
    """Whether some sharded leaf of the snapshot is only a piece here (a restore without a
    template must return it whole)."""
    return not all(record.is_whole() for record in meta.records.values())


def load_slot(path: str, meta: SlotMeta, into: Any | None, mapped: mmap.mmap | None = None) -> Any:
    """The snapshot's state (`into` None) or `into` filled in place.

    Args:
        path: the payload file.
        meta: its meta.
        into: a template to fill, or None.
        mapped: the payload as `map_verified` mapped it (the caller closes it), or None to
            map `path` here.

    Raises:
        CheckpointError: the template does not match the snapshot.
        ValueError: the payload or the meta is inconsistent.
    """
    mm = _map(path, meta.payload_bytes) if mapped is None else mapped
    try:
        builder = _Builder(meta, torch.frombuffer(mm, dtype=torch.uint8))
        try:
            if into is None:
                return builder.build(meta.tree)
            return builder.into(meta.tree, into, "")
        finally:
            del builder  # the payload's tensor views go before the mapping
    finally:
        if mapped is None:
            with contextlib.suppress(BufferError):  # a view still alive: unmapped when it goes
                mm.close()


class _Builder:
    def __init__(self, meta: SlotMeta, payload: torch.Tensor) -> None:
        self.meta = meta
        self.payload = payload

    def _view(self, key: str) -> torch.Tensor:
        """The saved local tensor of `key`, as a view on the payload (not a copy)."""
        record = self.meta.records.get(key)
        if record is None:
            raise ValueError(f"step {self.meta.step}: the tree names unknown tensor {key!r}")
        dtype = dtype_from_name(record.dtype)
        if record.nbytes == 0:
            return torch.empty(record.shape, dtype=dtype)
        raw = self.payload[record.offset : record.offset + record.nbytes]
        return raw.view(dtype).view(record.shape)

    def _whole(self, node: list[Any]) -> torch.Tensor:
        key = node[1]
        record = self.meta.records.get(key)
        if record is not None and not record.is_whole():
            raise ValueError(f"step {self.meta.step}: {key!r} is only a piece on this rank")
        value = self._view(key).clone()
        return value.reshape(record.global_shape) if record is not None else value

    def build(self, node: Any) -> Any:
        tag, body = node[0], node[1]
        if tag == "v":
            return body
        if tag == "d":
            return {k: self.build(v) for k, v in body}
        if tag in ("l", "t"):
            items = [self.build(v) for v in body]
            return tuple(items) if tag == "t" else items
        if tag in ("T", "S"):
            return self._whole(node)
        if tag == "R":
            return self.build(self._rank_local(body))
        raise ValueError(f"step {self.meta.step}: unknown tree node {tag!r}")

    def _rank_local(self, index: Any) -> Any:
        trees = self.meta.rank_local_trees
        if not isinstance(index, int) or not 0 <= index < len(trees):
            raise ValueError(f"step {self.meta.step}: no RankLocal subtree {index!r}")
        return trees[index]

    def into(self, node: Any, template: Any, path: str) -> Any:
        tag = node[0]
        if isinstance(template, RankLocal):
            if tag != "R":
                raise self._mismatch(path, "RankLocal", tag)
            return self.into(self._rank_local(node[1]), template.value, path)
        if isinstance(template, torch.Tensor):
            if tag not in ("T", "S"):
                raise self._mismatch(path, "tensor", tag)
            copy_into_template(template, self._view(node[1]), path, self.meta.step)
            return template
        if is_sharded(template):
            if tag != "S":
                raise self._mismatch(path, "sharded tensor", tag)
            local = template.local
            value = self._view(node[1])
            if value.numel() != local.numel():
                raise CheckpointError(
                    f"step {self.meta.step}: {path!r} holds {value.numel()} elements on this "
                    f"rank, the template's piece {local.numel()}"
                )
            with torch.no_grad():
                local.copy_(value.reshape(local.shape))
            return template
        if isinstance(template, dict):
            if tag != "d":
                raise self._mismatch(path, "dict", tag)
            saved = {k: v for k, v in node[1]}
            missing = [k for k in template if k not in saved and k != ALIASES_KEY]
            if missing:
                raise CheckpointError(
                    f"step {self.meta.step}: keys {missing} under {path!r} are not in the "
                    "memory snapshot"
                )
            return {
                k: self.into(saved[k], v, f"{path}/{k}") if k in saved else v
                for k, v in template.items()
            }
        if isinstance(template, list | tuple):
            if tag not in ("l", "t") or len(node[1]) != len(template):
                raise self._mismatch(path, f"sequence of {len(template)}", tag)
            items = [
                self.into(n, t, f"{path}/{i}")
                for i, (n, t) in enumerate(zip(node[1], template, strict=True))
            ]
            return tuple(items) if isinstance(template, tuple) else items
        return self.build(node)

    def _mismatch(self, path: str, expected: str, tag: str) -> CheckpointError:
        kinds = {"v": "value", "d": "dict", "l": "list", "t": "tuple", "T": "tensor"}
        found = kinds.get(tag, {"S": "sharded tensor", "R": "RankLocal"}.get(tag, tag))
        return CheckpointError(
            f"step {self.meta.step}: {path or '<root>'!r} is a {expected} in the template but "
            f"a {found} in the memory snapshot"
        )
