"""Where every parameter lives: FSDP units, buckets, padded flat offsets and rank shards.

Pure bookkeeping, no storage. Units are found by a pre-order walk (outermost unit wins); the
parameters outside every unit form the root unit (index `len(units)`). Each unit's parameters
are grouped by `(compute dtype, requires_grad)`, one bucket per group (the compute dtype comes
from the mixed-precision policy, `_precision.py`); root groups are split once a
bucket reaches `bucket_size_bytes`. Inside a bucket each parameter starts on a 64-byte
boundary (the alignment of a standalone tensor, so kernels see the same addresses and give
bitwise the same results as on unwrapped parameters) and the bucket is padded so that every
rank owns one contiguous, equally long, aligned shard.

[Note: parameters tied across units] A parameter that modules of two units hold (e.g. one
projection shared by every block) belongs to neither: it lives in the root unit, the common
ancestor of any two units (units are outermost instances, so a module containing two of
them is in no unit). The root unit is gathered for the whole forward and backward, so the
parameter is usable inside every unit's forward; autograd sums its gradients from every
use into one `.grad`, which the root unit reduces at the end of backward, once.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = ["BucketLayout", "ParamSlot", "UnitLayout", "build_layout", "detect_unit_classes"]

_ALIGN_BYTES = 64


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its bucket."""

    names: tuple[str, ...]
    """Every fully qualified name of the parameter (tied weights have several)."""
    shape: torch.Size
    """Shape of the parameter."""
    offset: int
    """First element in the bucket."""
    dtype: torch.dtype
    """Dtype of the parameter when it was wrapped (restored by `full_state_dict`)."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.shape.numel()


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """One flat, padded buffer shared by a group of parameters."""

    index: int
    """Position in the engine's bucket list."""
    unit: int
    """Owning unit (`num_units` for the root unit)."""
    requires_grad: bool
    """Whether the parameters are trained."""
    slots: tuple[ParamSlot, ...]
    """Parameters in buffer order."""
    padded_numel: int
    """Buffer length: a multiple of `world_size` * alignment."""
    world_size: int
    """Number of shards."""
    compute_dtype: torch.dtype = torch.float32
    """Dtype of the bucket's compute weights (one per bucket)."""

    @property
    def shard_numel(self) -> int:
        """Elements per rank."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Bucket elements `[start, end)` owned by `rank`."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def gaps(self) -> list[tuple[int, int]]:
        """Bucket ranges `[start, end)` that belong to no parameter (alignment and padding)."""
        out, pos = [], 0
        for slot in self.slots:
            if slot.offset > pos:
                out.append((pos, slot.offset))
            pos = slot.offset + slot.numel
        if pos < self.padded_numel:
            out.append((pos, self.padded_numel))
        return out


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """One FSDP unit: a module whose parameters are gathered and reduced together."""

    index: int
    """Position in the unit list; the root unit comes last."""
    name: str
    """Qualified module name (`""` for the root unit)."""
    buckets: tuple[int, ...]
    """Indices of the unit's buckets."""


def detect_unit_classes(module: nn.Module) -> tuple[type[nn.Module], ...]:
    """Outermost repeated blocks: non-`torch.nn` classes with >= 2 instances holding parameters."""
    named: dict[type[nn.Module], list[str]] = {}
    for name, sub in module.named_modules():
        cls = type(sub)
        if sub is module or cls.__module__.startswith("torch."):
            continue
        if any(True for _ in sub.parameters()):
            named.setdefault(cls, []).append(name)
    repeated = {cls: names for cls, names in named.items() if len(names) >= 2}
    outer = [n for names in repeated.values() for n in names]

    def nested(name: str) -> bool:
        return any(name.startswith(o + ".") for o in outer)

    return tuple(cls for cls, names in repeated.items() if not all(map(nested, names)))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align(numel: int, dtype: torch.dtype) -> int:
    step = max(1, _ALIGN_BYTES // _itemsize(dtype))
    return -(-numel // step) * step


def build_layout(
    module: nn.Module,
    unit_classes: tuple[type[nn.Module], ...],
    *,
    world_size: int,
    compute_dtype: torch.dtype,
    bucket_size_bytes: int,
    param_dtypes: dict[int, torch.dtype] | None = None,
) -> tuple[list[UnitLayout], list[BucketLayout], list[nn.Module | None]]:
    """Assign every parameter of `module` to a unit, a bucket and an offset.

    Args:
        module: the model.
        unit_classes: module classes whose outermost instances become units.
        world_size: number of shards.
        compute_dtype: compute dtype of every parameter not in `param_dtypes`.
        bucket_size_bytes: largest root bucket (compute bytes).
        param_dtypes: compute dtype per parameter `id` (the mixed-precision policy's).

    Returns:
        `(units, buckets, unit_modules)`; `unit_modules[i]` is unit i's module (`None` for the
        root unit, which is last).

    A parameter reachable from two units (or a unit and the root) lives in the root unit:
    [Note: parameters tied across units].
    """
    unit_names: list[str] = []
    unit_mods: list[nn.Module] = []
    for name, sub in module.named_modules():
        if sub is module or not isinstance(sub, unit_classes):
            continue
        if any(name.startswith(prefix + ".") for prefix in unit_names):
            continue
        unit_names.append(name)
        unit_mods.append(sub)
    root = len(unit_mods)

    owner: dict[int, int] = {}
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    order: list[int] = []
    for full_name, param in module.named_parameters(remove_duplicate=False):
        unit = next(
            (i for i, p in enumerate(unit_names) if full_name.startswith(p + ".")),
            root,
        )
        key = id(param)
        if key in owner and owner[key] != unit:
            # Tied across units: [Note: parameters tied across units].
            owner[key] = root
        if key not in owner:
            owner[key], names[key], params[key] = unit, [], param
            order.append(key)
        names[key].append(full_name)

    buckets: list[BucketLayout] = []
    units: list[UnitLayout] = []
    dtypes = param_dtypes or {}
    for unit in range(root + 1):
        groups: dict[tuple[torch.dtype, bool], list[list[int]]] = {}
        for key in order:
            if owner[key] != unit:
                continue
            p = params[key]
            dtype = dtypes.get(key, compute_dtype)
            runs = groups.setdefault((dtype, p.requires_grad), [[]])
            size = sum(params[k].numel() for k in runs[-1]) * _itemsize(dtype)
            if unit == root and runs[-1] and size >= bucket_size_bytes:
                runs.append([])
            runs[-1].append(key)
        mine: list[int] = []
        for (dtype, requires_grad), runs in groups.items():
            align_unit = max(1, _ALIGN_BYTES // _itemsize(dtype))
            for run in runs:
                slots, pos = [], 0
                for key in run:
                    p = params[key]
                    slots.append(ParamSlot(tuple(names[key]), p.shape, pos, p.dtype))
                    pos = _align(pos + p.numel(), dtype)
                quantum = world_size * align_unit
                padded = max(quantum, -(-pos // quantum) * quantum)
                mine.append(len(buckets))
                buckets.append(
                    BucketLayout(
                        len(buckets),
                        unit,
                        requires_grad,
                        tuple(slots),
                        padded,
                        world_size,
                        dtype,
                    )
                )
        units.append(UnitLayout(unit, unit_names[unit] if unit < root else "", tuple(mine)))
    modules: list[nn.Module | None] = [*unit_mods, None]
    return units, buckets, modules
