"""Tensor element types by name, without importing torch.

Reading a manifest (`ckptctl list`, `show`, `verify`) validates dtype names and byte counts;
importing torch for that costs seconds, so the names and item sizes live in this table.
`format.dtype_from_name` turns a name into a `torch.dtype` where tensors are made, and a test
pins this table to torch's own dtypes, aliases included (`float` is `float32`).
"""

from __future__ import annotations

__all__ = ["ITEM_SIZES", "item_size"]

ITEM_SIZES: dict[str, int] = {
    "bfloat16": 2,
    "bit": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    "bits8": 1,
    "bool": 1,
    "cdouble": 16,
    "cfloat": 8,
    "chalf": 4,
    "complex128": 16,
    "complex32": 4,
    "complex64": 8,
    "double": 8,
    "float": 4,
    "float16": 2,
    "float32": 4,
    "float4_e2m1fn_x2": 1,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "half": 2,
    "int": 4,
    "int1": 1,
    "int16": 2,
    "int2": 1,
    "int3": 1,
    "int32": 4,
    "int4": 1,
    "int5": 1,
    "int6": 1,
    "int64": 8,
    "int7": 1,
    "int8": 1,
    "long": 8,
    "qint32": 4,
    "qint8": 1,
    "quint2x4": 1,
    "quint4x2": 1,
    "quint8": 1,
    "short": 2,
    "uint1": 1,
    "uint16": 2,
    "uint2": 1,
    "uint3": 1,
    "uint32": 4,
    "uint4": 1,
    "uint5": 1,
    "uint6": 1,
    "uint64": 8,
    "uint7": 1,
    "uint8": 1,
}
"""Bytes per element of every torch dtype name (`str(dtype)` less `torch.`, and aliases)."""


def item_size(name: str) -> int:
    """Bytes per element of the dtype called `name`.

    Raises:
        ValueError: `name` is not a torch dtype name.
    """
    size = ITEM_SIZES.get(name) if isinstance(name, str) else None
    if size is None:
        raise ValueError(f"unknown dtype {name!r}")
    return size
