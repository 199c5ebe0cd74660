"""The files that describe a `--init-from` model (`config.json`, ...), recorded with each step.

A `save_pretrained` directory holds, beside the weights, the JSON files `from_pretrained` needs
to build the model. A run started from such a directory (`--init-from` or `JobSpec.init_from`,
resumed or not) reads them once and saves them in every checkpoint as the top-level entry
`ckpt_manager.MODEL_FILES_KEY` (`{file name: text}`, CONTRACTS.md), so `ckptctl restore
--format safetensors` writes them beside the exported weights and `from_pretrained(export)`
needs no hand work. For a single `.safetensors` source the files are looked for in its folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec

from daemon.errors import JobError

__all__ = ["MODEL_FILES_KEY", "MODEL_FILE_NAMES", "read_model_files"]

MODEL_FILES_KEY = "__model_files__"
"""Top-level key of the recorded files in a saved state (the same string as
`ckpt_manager._types.MODEL_FILES_KEY`; a test pins them together)."""

MODEL_FILE_NAMES = ("config.json", "generation_config.json")
"""Files copied from a source directory when present (`config.json` is the one that matters)."""

_MAX_BYTES = 1 << 20  # a config is a few KiB; anything larger is not one


def read_model_files(uri: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, str]:
    """`{name: text}` of the `MODEL_FILE_NAMES` found beside the source's weights (may be empty).

    Raises:
        JobError: a file exists but cannot be read, is too large or is not UTF-8 JSON text.
    """
    import json

    fs, root = fsspec.core.url_to_fs(uri, **dict(storage_options or {}))
    root = root.rstrip("/")
    try:
        folder = root if fs.isdir(root) else root.rsplit("/", 1)[0] if "/" in root else "."
        out: dict[str, str] = {}
        for name in MODEL_FILE_NAMES:
            path = f"{folder}/{name}"
            if not fs.isfile(path):
                continue
            if fs.size(path) > _MAX_BYTES:
                raise JobError(f"init_from={uri!r}: {name} is over {_MAX_BYTES} bytes")
            text = fs.cat_file(path).decode()
            json.loads(text)  # a broken file fails here, not in a later from_pretrained
            out[name] = text
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise JobError(f"init_from={uri!r}: cannot read its model files: {err}") from err
    return out
