"""The token file format: a flat `.bin` array of token ids and its JSON sidecar.

`<name>.bin` holds `num_tokens` ids, little-endian `uint16` (vocabularies up to 65,536) or
`uint32`, nothing else (the nanoGPT / Megatron-style layout, so such files can be used as they
are once a sidecar is written next to them). `<name>.json` is
`{"format": "trainingd-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256,
"num_tokens": N}`. The sidecar is written after the data, so its presence marks a complete
file; `num_tokens` is checked against the `.bin` size when the file is opened.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, NamedTuple

import fsspec
import numpy as np

__all__ = ["DTYPES", "TokenFileInfo", "read_info", "sidecar_path", "write_token_file"]

FORMAT = "trainingd-tokens"
VERSION = 1
DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""Token dtypes a file may use, by the sidecar's name for them."""


class TokenFileInfo(NamedTuple):
    """What a token file's sidecar says."""

    dtype: str
    """`uint16` or `uint32`."""
    vocab_size: int
    """Token ids are below this."""
    num_tokens: int
    """Tokens in the `.bin` file."""

    @property
    def itemsize(self) -> int:
        """Bytes per token."""
        return DTYPES[self.dtype].itemsize


def sidecar_path(bin_path: str) -> str:
    """`<name>.json` for `<name>.bin` (any other name gets `.json` appended)."""
    return (bin_path[: -len(".bin")] if bin_path.endswith(".bin") else bin_path) + ".json"


def _dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_info(bin_path: str, storage_options: dict[str, Any] | None = None) -> TokenFileInfo:
    """The sidecar of the token file `bin_path` (a path or fsspec URI), validated.

    Raises:
        FileNotFoundError: no sidecar next to the file (not a token file, or not complete).
        ValueError: the sidecar is not a trainingd token sidecar, or disagrees with the data.
    """
    side = sidecar_path(bin_path)
    fs, path = fsspec.core.url_to_fs(side, **(storage_options or {}))
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{bin_path}: no sidecar {side}; write token files with `trainingd prepare-data` "
            "(or `daemon.data.write_token_file`)"
        ) from None
    try:
        meta = json.loads(raw)
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} v{VERSION} sidecar")
        info = TokenFileInfo(str(meta["dtype"]), int(meta["vocab_size"]), int(meta["num_tokens"]))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{side}: bad token sidecar ({err})") from None
    if info.dtype not in DTYPES:
        raise ValueError(f"{side}: dtype {info.dtype!r}; use one of {sorted(DTYPES)}")
    if info.vocab_size < 1 or info.vocab_size > np.iinfo(DTYPES[info.dtype]).max + 1:
        raise ValueError(f"{side}: vocab_size {info.vocab_size} does not fit {info.dtype}")
    data_fs, data_path = fsspec.core.url_to_fs(bin_path, **(storage_options or {}))
    size = int(data_fs.size(data_path))
    if size != info.num_tokens * info.itemsize:
        raise ValueError(
            f"{bin_path}: {size} bytes, but its sidecar says {info.num_tokens} {info.dtype} "
            f"tokens ({info.num_tokens * info.itemsize} bytes)"
        )
    return info


def write_token_file(
    bin_path: str,
    chunks: Iterable[np.ndarray[Any, Any]],
    *,
    vocab_size: int,
    storage_options: dict[str, Any] | None = None,
) -> TokenFileInfo:
    """Write token ids (any integer arrays, in order) as `bin_path` and its sidecar.

    The dtype is `uint16` when `vocab_size <= 65536`, else `uint32`. The sidecar is written
    last, so readers never see a partial file as complete.

    Raises:
        ValueError: a token id is negative or not below `vocab_size`.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    dtype = _dtype_for(vocab_size)
    fs, path = fsspec.core.url_to_fs(bin_path, **(storage_options or {}))
    num_tokens = 0
    with fs.open(path, "wb") as out:
        for chunk in chunks:
            ids = np.asarray(chunk)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                low, high = int(ids.min()), int(ids.max())
                raise ValueError(f"token ids must be in [0, {vocab_size}); got {low}..{high}")
            out.write(ids.astype(DTYPES[dtype]).tobytes())
            num_tokens += int(ids.size)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "num_tokens": num_tokens,
    }
    side_fs, side = fsspec.core.url_to_fs(sidecar_path(bin_path), **(storage_options or {}))
    side_fs.pipe_file(side, json.dumps(meta).encode())
    return TokenFileInfo(dtype, vocab_size, num_tokens)
