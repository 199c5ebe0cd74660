"""Start a run from Hugging Face-style safetensors weights (`--init-from`, `JobSpec.init_from`).

The source is a directory with `model.safetensors.index.json` (shards named in its
`weight_map`), a directory with one `model.safetensors`, or a single `.safetensors` file, on
local disk or any fsspec URL (`s3://` with the checkpoint root's endpoint). Only headers are
read to check it; each rank then reads, per parameter, the byte range of its own shard
(safetensors data is row-major and contiguous, so a flat range of elements is one range of
bytes) and buffers whole.

Names: the file's names, passed through the job's `init_key_map` when it has one, must be the
model's `state_dict()` names (so a `save_pretrained` directory fits as it is: non-persistent
buffers such as the rotary `inv_freq` are neither expected nor read; the module rebuilds
them). A tied parameter (one tensor under several names) needs only one of its names in the
file. Any difference (missing or unexpected names, shapes, dtypes) is one
line listing the first few, raised before any rank trains: as a start-up check in the daemon
(exit 2) for `--init-from`, on the ranks for a source named only by the job.

Precedence: a run that resumes from a committed checkpoint ignores the source (the checkpoint
is newer); `--init-from` overrides `JobSpec.init_from`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import fsspec
import torch
from torch import nn

from daemon.errors import JobError

__all__ = [
    "INDEX_NAME",
    "InitSource",
    "SafetensorsSource",
    "TensorEntry",
    "check_source",
    "expected_tensors",
    "load_into",
    "mismatch",
    "storage_options_for",
]

INDEX_NAME = "model.safetensors.index.json"
"""The index of a sharded Hugging Face checkpoint."""
_SINGLE_NAME = "model.safetensors"
_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
_MAX_LISTED = 5  # differences named in the one-line error

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class TensorEntry(NamedTuple):
    """Where one tensor lies in a safetensors file."""

    file: str
    """Path of its file (inside the source's filesystem)."""
    dtype: torch.dtype
    """Element type."""
    shape: tuple[int, ...]
    """Shape."""
    start: int
    """Absolute byte offset of its first element in the file."""


class SafetensorsSource:
    """The tensors of a safetensors source, by name, read in byte ranges.

    Args:
        uri: a directory (with `model.safetensors.index.json` or one `model.safetensors`) or
            a `.safetensors` file; local path or fsspec URL.
        storage_options: fsspec options (e.g. an S3 endpoint).

    Raises:
        JobError: the source is missing or not safetensors (the message says which file).
    """

    def __init__(self, uri: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.uri = uri
        try:
            self._fs, root = fsspec.core.url_to_fs(uri, **dict(storage_options or {}))
            files = self._files(root.rstrip("/"))
            self.entries: dict[str, TensorEntry] = {}
            for path in files:
                self.entries.update(self._header(path))
        except OSError as err:
            raise JobError(f"init_from={uri!r}: cannot read it: {err}") from err

    def _files(self, root: str) -> list[str]:
        if self._fs.isfile(root):
            return [root]
        if not self._fs.isdir(root):
            raise JobError(f"init_from={self.uri!r}: no such file or directory")
        index = f"{root}/{INDEX_NAME}"
        if self._fs.isfile(index):
            doc = json.loads(self._fs.cat_file(index))
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(weight_map, dict):
                raise JobError(f"init_from={self.uri!r}: {INDEX_NAME} has no weight_map")
            names = sorted({str(v) for v in weight_map.values()})
            for name in names:
                if "/" in name or name.startswith("."):
                    raise JobError(f"init_from={self.uri!r}: {INDEX_NAME} names file {name!r}")
            return [f"{root}/{name}" for name in names]
        if self._fs.isfile(f"{root}/{_SINGLE_NAME}"):
            return [f"{root}/{_SINGLE_NAME}"]
        raise JobError(
            f"init_from={self.uri!r}: the directory has neither {INDEX_NAME} nor {_SINGLE_NAME}"
        )

    def _header(self, path: str) -> dict[str, TensorEntry]:
        head = self._fs.cat_file(path, start=0, end=8)
        if len(head) != 8:
            raise JobError(f"init_from={self.uri!r}: {path} is not a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_HEADER_BYTES:
            raise JobError(f"init_from={self.uri!r}: {path} has a {size}-byte header")
        try:
            doc = json.loads(self._fs.cat_file(path, start=8, end=8 + size))
        except ValueError as err:
            raise JobError(f"init_from={self.uri!r}: {path} has a broken header") from err
        out = {}
        for name, rec in doc.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(rec.get("dtype"))
            if dtype is None:
                raise JobError(f"init_from={self.uri!r}: {name!r} has dtype {rec.get('dtype')!r}")
            shape = tuple(int(d) for d in rec["shape"])
            begin, end = (int(o) for o in rec["data_offsets"])
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise JobError(f"init_from={self.uri!r}: {name!r} has inconsistent offsets")
            out[str(name)] = TensorEntry(path, dtype, shape, 8 + size + begin)
        return out

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements `[start, end)` of the row-major flattened tensor `name` (1-D, its dtype).

        Raises:
            JobError: the file is shorter than its header says.
        """
        entry = self.entries[name]
        if end <= start:
            return torch.empty(0, dtype=entry.dtype)
        lo = entry.start + start * entry.dtype.itemsize
        hi = entry.start + end * entry.dtype.itemsize
        data = self._fs.cat_file(entry.file, start=lo, end=hi)
        if len(data) != hi - lo:
            raise JobError(f"init_from={self.uri!r}: {entry.file} is truncated at {name!r}")
        return torch.frombuffer(bytearray(data), dtype=entry.dtype)


class _Expected(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    tied: tuple[str, ...]  # every name of the same tensor (one is enough in the file)


def expected_tensors(module: nn.Module) -> dict[str, _Expected]:
    """The model's `state_dict()` names, shapes and dtypes, tied names grouped."""
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    out: dict[str, _Expected] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        names = tuple(groups.get(id(value), [name]))
        out[name] = _Expected(tuple(value.shape), value.dtype, names)
    return out


def _renamed(source: SafetensorsSource, key_map: Callable[[str], str] | None) -> dict[str, str]:
    """`{model name: file name}` through the job's `init_key_map`."""
    out: dict[str, str] = {}
    for file_name in source.entries:
        model_name = key_map(file_name) if key_map is not None else file_name
        if model_name in out:
            raise JobError(
                f"init_from={source.uri!r}: init_key_map maps both {out[model_name]!r} and "
                f"{file_name!r} to {model_name!r}"
            )
        out[model_name] = file_name
    return out


def mismatch(
    model: nn.Module | Mapping[str, _Expected],
    source: SafetensorsSource,
    key_map: Callable[[str], str] | None,
) -> str | None:
    """One line naming the first differences between the model and the source, or None.

    Args:
        model: the unsharded module, or its `expected_tensors()` taken earlier.
        source: the safetensors source.
        key_map: the job's `init_key_map`, or None.
    """
    expected = expected_tensors(model) if isinstance(model, nn.Module) else model
    names = _renamed(source, key_map)
    problems: list[str] = []
    for name, want in expected.items():
        found = next((names[n] for n in want.tied if n in names), None)
        if found is None:
            problems.append(f"missing {name!r}")
            continue
        entry = source.entries[found]
        if entry.shape != want.shape:
            problems.append(
                f"{name!r} has shape {entry.shape} in the file, {want.shape} in the model"
            )
        elif entry.dtype != want.dtype:
            problems.append(f"{name!r} is {entry.dtype} in the file, {want.dtype} in the model")
    problems += [f"unexpected {names[n]!r}" for n in names if n not in expected]
    if not problems:
        return None
    more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
    return (
        f"init_from={source.uri!r} does not fit the model: "
        f"{'; '.join(problems[:_MAX_LISTED])}{more}"
    )


class InitSource(NamedTuple):
    """A checked source, ready to load once the model is sharded."""

    source: SafetensorsSource
    """The safetensors tensors."""
    key_map: Callable[[str], str] | None
    """The job's `init_key_map`."""
    expected: dict[str, _Expected]
    """The model's tensors, taken before sharding (tied names grouped)."""


def storage_options_for(uri: str, s3_endpoint_url: str) -> dict[str, Any]:
    """fsspec options for the source: an `s3://` source uses the checkpoint root's endpoint."""
    from ckpt_manager import S3Options

    return S3Options.with_environment_endpoint(s3_endpoint_url or None).fsspec_options(uri)


def check_source(
    model: nn.Module | Mapping[str, _Expected],
    uri: str,
    key_map: Callable[[str], str] | None,
    storage_options: Mapping[str, Any] | None = None,
) -> InitSource:
    """Open the source and check it against the unsharded module (or its `expected_tensors`).

    Raises:
        JobError: the source cannot be read or does not fit (one line, first differences).
    """
    expected = expected_tensors(model) if isinstance(model, nn.Module) else dict(model)
    source = SafetensorsSource(uri, storage_options)
    problem = mismatch(expected, source, key_map)
    if problem is not None:
        raise JobError(problem)
    return InitSource(source, key_map, expected)


def load_into(model: Any, init: InitSource) -> int:
    """Fill the sharded model's weights from the source: this rank reads its pieces only.

    Args:
        model: the sharding engine's model (`sharded_state_dict()` / `load_sharded_state_dict()`).
        init: the checked source.

    Returns:
        Bytes this rank read.

    Raises:
        JobError: a piece that is not in the flat form the engine emits, or a name the
            source lacks.
    """
    from sharding import ShardedTensor

    source = init.source
    names = _renamed(source, init.key_map)
    groups = init.expected
    loaded: dict[str, Any] = {}
    num_bytes = 0
    for name, value in model.sharded_state_dict().items():
        if not isinstance(value, ShardedTensor | torch.Tensor):
            continue  # the aliases entry: ties come from the module
        tied = groups[name].tied if name in groups else (name,)
        file_name = next((names[n] for n in tied if n in names), None)
        if file_name is None:  # the model changed since `check_source` took `expected`
            raise JobError(f"init_from={source.uri!r}: the model's {name!r} is not in it")
        if isinstance(value, ShardedTensor):
            if value.flat_range is None:
                raise JobError(f"init_from: {name!r} is not a flat piece of its parameter")
            start, end = value.flat_range
            data = source.read(file_name, start, end).to(value.local.dtype)
            loaded[name] = ShardedTensor(
                data, value.global_shape, value.global_offset, (start, end)
            )
        else:
            whole = source.read(file_name, 0, value.numel())
            data = whole.reshape(value.shape).to(value.dtype)
            loaded[name] = data
        num_bytes += data.numel() * source.entries[file_name].dtype.itemsize
    model.load_sharded_state_dict(loaded)
    return num_bytes
