"""The staging copy's byte copy: streaming stores where the C helper is built, else `memmove`.

[Note: the staging copy streams past the cache] (in `_streaming_copy.c`) says why: the slab is
not read back soon, so its lines are written without first reading them into the cache and
without evicting the training's. The helper is an optional C extension (pyproject's
`ext-modules`): where no compiler built it, or off x86-64, the copy is libc's `memmove` and
`STAGING_COPY` says so (the manager logs it at its start, `ckpt_staging_copy`).

Both copies keep the source in cache, so the checksum that follows a chunk reads the source
([Note: the checksum rides on the staging copy] in `staging.py`).
"""

from __future__ import annotations

import ctypes
import enum
import importlib
from collections.abc import Callable
from types import ModuleType

__all__ = ["STAGING_COPY", "ByteCopy", "CopyKind", "byte_copy", "streaming_available"]


def _load_helper() -> ModuleType | None:
    try:
        return importlib.import_module("ckpt_manager._save._streaming_copy")
    except ImportError:  # installed without a C compiler: memmove it is
        return None


_helper = _load_helper()

ByteCopy = Callable[[int, int, int], object]
"""Copy `(dst_address, src_address, nbytes)`; the ranges do not overlap."""


class CopyKind(enum.Enum):
    """How the staging copy moves a chunk's bytes."""

    STREAMING = "streaming"
    """The C helper's non-temporal stores (x86-64)."""
    MEMMOVE = "memmove"
    """libc's `memmove` through ctypes (ordinary stores below glibc's threshold)."""


def streaming_available() -> bool:
    """Whether the C helper is built here and streams its stores (x86-64)."""
    return _helper is not None and bool(_helper.NON_TEMPORAL)


def byte_copy(kind: CopyKind) -> ByteCopy:
    """The copy function of `kind`; both release the GIL while they copy.

    Raises:
        ValueError: `kind` is STREAMING where the helper is not built (or cannot stream).
    """
    if kind is CopyKind.MEMMOVE:
        return ctypes.memmove
    if not streaming_available():
        raise ValueError(
            "the streaming staging copy is not available here: the C helper "
            "ckpt_manager._save._streaming_copy was not built (no C compiler at install) "
            "or this machine is not x86-64; use CopyKind.MEMMOVE"
        )
    assert _helper is not None
    copy: ByteCopy = _helper.copy
    return copy


STAGING_COPY = CopyKind.STREAMING if streaming_available() else CopyKind.MEMMOVE
"""What the staging copy uses in this process."""
