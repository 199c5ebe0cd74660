"""Read our committed steps with `torch.distributed.checkpoint` (DCP): `Reader`, a StorageReader.

    import torch.distributed.checkpoint as dcp
    from ckpt_manager.dcp import Reader

    state = {"model": model.state_dict()}          # plain tensors or DTensors (FSDP2, TP)
    dcp.load(state, storage_reader=Reader("s3://bucket/run", step=None,
                                          storage_options={...}))
    model.load_state_dict(state["model"])

How our step maps onto DCP's metadata: the saved state's skeleton is flattened the way DCP
flattens a state dict (its own `flatten_state_dict`: dict keys and list indices joined by
`.`, so `{"model": {"0.weight": t}}` is `model.0.weight`), each tensor (replicated, sharded
or DTensor when saved) becomes a `TensorStorageMetadata` with one chunk, the whole tensor,
and every plain value (ints, strings, lists of them, optimizer hyperparameters) a
`BytesStorageMetadata`. DCP's planner then asks for boxes of those whole tensors (each
rank its local shard of a DTensor, the whole of a plain tensor); `read_data` fills each box
from our stored pieces through `_load/regions.py`, reading only the pieces that overlap it,
after verifying each touched file's size and crc32. Works at any world size, and without a
process group (`dcp.load(..., no_dist=True)` or a single process).

RankLocal subtrees (per-rank RNG states, data positions) have no DCP equivalent and are left
out of the metadata, as `ckptctl restore` leaves them out of consolidated files. Tied names
(`__aliases__`) are keys of their own, read from their target's pieces, so a tied model's
`state_dict()` loads as it is. The optimizer keeps our layout (parameters named under
`param_names`); `ckptctl restore --format dcp` writes torch's `get_optimizer_state_dict`
layout for tools that need it.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckpt_manager._load.regions import StepRegions
from ckpt_manager._store.storage import Storage
from ckpt_manager._types import ALIASES_KEY
from ckpt_manager.errors import CheckpointError, CorruptCheckpointError

__all__ = ["Reader"]


class _TensorKey(NamedTuple):
    """A tensor inside a value DCP reads as bytes (e.g. a tuple of tensors), by our key."""

    key: str


class Reader(StorageReader):
    """A `torch.distributed.checkpoint.StorageReader` over one committed step of ours.

    Args:
        uri: the checkpoint root (local path, `s3://bucket/prefix`, any fsspec URL).
        step: the committed step; None reads the newest committed step.
        storage_options: fsspec options for the root (e.g. `S3Options(...).storage_options()`).
        verify_checksums: check each file's crc32 before its bytes are used (sizes are always
            checked).

    Raises:
        StepNotFoundError: from `read_metadata`, when the step is not committed.
        CorruptCheckpointError: from `read_metadata` / `read_data`, when stored data fails
            verification.
    """

    def __init__(
        self,
        uri: str | os.PathLike[str],
        step: int | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        verify_checksums: bool = True,
    ) -> None:
        super().__init__()
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be an int >= 0 or None (newest), got {step!r}")
        self.uri = os.fspath(uri)
        self.step = step
        self.storage_options = dict(storage_options or {})
        self.verify_checksums = verify_checksums
        self._regions: StepRegions | None = None
        self._leaves: dict[str, str] = {}  # DCP key -> our tensor key
        self._values: dict[str, Any] = {}  # DCP key -> plain value

    # ----------------------------------------------------------- StorageReader
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Forget what was read; a `checkpoint_id` (a root URI) replaces the root."""
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)
        self._regions = None
        self._leaves = {}
        self._values = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether `checkpoint_id` is a root of ours with a committed step (a cheap probe)."""
        from ckpt_manager._store.steps import committed_steps

        try:
            return bool(committed_steps(Storage(os.fspath(checkpoint_id))))
        except (CheckpointError, ValueError, OSError):
            return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP metadata of the step: one whole-tensor chunk per tensor, values as bytes."""
        regions = self._open()
        # Stand-ins are meta tensors (no memory), so DCP's flattening treats them exactly as
        # it treats the caller's tensors (e.g. a list of tensors is walked, not pickled).
        stand_ins: dict[int, str] = {}
        virtual = self._virtual(regions.tree, stand_ins)
        if not isinstance(virtual, dict):
            raise CheckpointError(
                f"step {regions.step}: DCP needs a dict at the top of the saved state, found "
                f"{type(virtual).__name__}"
            )
        flat, mappings = flatten_state_dict(virtual)
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self._leaves, self._values = {}, {}
        for fqn, item in flat.items():
            if isinstance(item, torch.Tensor):
                key = stand_ins[id(item)]
                info = regions.tensor(key)
                shape = torch.Size(info.global_shape)
                entries[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=info.dtype),
                    size=shape,
                    chunks=[ChunkStorageMetadata(torch.Size([0] * len(shape)), shape)],
                )
                self._leaves[fqn] = key
            else:
                entries[fqn] = BytesStorageMetadata()
                self._values[fqn] = self._keys_of(item, stand_ins)
        return Metadata(state_dict_metadata=entries, planner_data=mappings)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Nothing to agree: every rank reads the step's metadata itself."""
        if self._regions is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan as DCP made it (reads are already as narrow as the boxes asked for)."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans as DCP made them."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Serve each ReadItem: a box of a tensor from our pieces, or a plain value."""
        regions = self._open()
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                if fqn not in self._values:
                    raise CheckpointError(f"step {regions.step}: no value {fqn!r}")
                buf = io.BytesIO()
                torch.save(self._materialize(self._values[fqn], regions), buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            self._read_tensor(item, planner, regions)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    # ----------------------------------------------------------------- helpers
    def _open(self) -> StepRegions:
        if self._regions is None:
            storage = Storage(self.uri, self.storage_options)
            self._regions = StepRegions(storage, self.step, verify_checksums=self.verify_checksums)
        return self._regions

    def _read_tensor(self, item: ReadItem, planner: LoadPlanner, regions: StepRegions) -> None:
        fqn = item.storage_index.fqn
        key = self._leaves.get(fqn)
        if key is None:
            raise CheckpointError(f"step {regions.step}: no tensor {fqn!r}")
        info = regions.tensor(key)
        chunk_offset = item.storage_index.offset or torch.Size([0] * len(info.global_shape))
        offset = [c + s for c, s in zip(chunk_offset, item.storage_offsets, strict=True)]
        staged = torch.empty(tuple(item.lengths), dtype=info.dtype)
        regions.fill(key, staged, offset)
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != tuple(staged.shape):
            raise CorruptCheckpointError(
                f"step {regions.step}: {fqn!r} box of shape {tuple(staged.shape)} does not fit "
                f"the target's {tuple(target.shape)}"
            )
        target.copy_(staged)
        planner.commit_tensor(item, target)

    def _virtual(self, node: Any, stand_ins: dict[int, str]) -> Any:
        """The saved structure with meta tensors for tensors (RankLocal left out)."""
        tag, body = node[0], node[1]
        if tag == "v":
            return body
        if tag == "d":
            out = {str(k): self._virtual(v, stand_ins) for k, v in body if v[0] != "R"}
            return self._with_aliases(out, stand_ins)
        if tag in ("l", "t"):
            items = [self._virtual(v, stand_ins) for v in body if v[0] != "R"]
            return tuple(items) if tag == "t" else items
        if tag in ("T", "S"):
            info = self._open().tensor(body)
            meta = torch.empty(info.global_shape, dtype=info.dtype, device="meta")
            stand_ins[id(meta)] = body
            return meta
        raise CorruptCheckpointError(f"unknown tree node {tag!r} in the step's skeleton")

    @staticmethod
    def _with_aliases(d: dict[str, Any], stand_ins: dict[int, str]) -> dict[str, Any]:
        """A dict's `ALIASES_KEY` (`{tied name: saved name}`) resolved: each tied name becomes
        a key of its own, read from its target's pieces, so the keys are exactly those of the
        tied module's `state_dict()` (as `dcp.save` of that state dict writes them)."""
        aliases = d.get(ALIASES_KEY)
        if not isinstance(aliases, dict):
            return d
        out = {k: v for k, v in d.items() if k != ALIASES_KEY}
        for alias, target in aliases.items():
            saved = out.get(target) if isinstance(target, str) else None
            if isinstance(saved, torch.Tensor) and str(alias) not in out:
                twin = torch.empty_like(saved, device="meta")
                stand_ins[id(twin)] = stand_ins[id(saved)]
                out[str(alias)] = twin
        return out

    def _keys_of(self, value: Any, stand_ins: dict[int, str]) -> Any:
        """A value kept for DCP's bytes, its stand-in tensors replaced by `_TensorKey`s."""
        if isinstance(value, torch.Tensor):
            return _TensorKey(stand_ins[id(value)])
        if isinstance(value, dict):
            return {k: self._keys_of(v, stand_ins) for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [self._keys_of(v, stand_ins) for v in value]
            return tuple(items) if isinstance(value, tuple) else items
        return value

    def _materialize(self, value: Any, regions: StepRegions) -> Any:
        """A plain value for DCP's bytes: tensors inside it (a tuple of tensors) read whole."""
        if isinstance(value, _TensorKey):
            return regions.whole(value.key)
        if isinstance(value, dict):
            return {k: self._materialize(v, regions) for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [self._materialize(v, regions) for v in value]
            return tuple(items) if isinstance(value, tuple) else items
        return value
