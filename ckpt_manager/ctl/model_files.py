"""The files that describe the model (`config.json`, ...) recorded in a step, for exports.

A run started from a Hugging Face `save_pretrained` directory records that directory's
`config.json` (and `generation_config.json`) in every step as the top-level plain entry
`MODEL_FILES_KEY` (`{file name: text}`, CONTRACTS.md). `ckptctl restore --format safetensors`
writes them beside the weights: into the `--max-shard-size` directory, or beside a single
file named `model.safetensors` (the layout `from_pretrained(folder)` reads). Names are
checked (a plain file name, no folders) before anything is written.
"""

from __future__ import annotations

import os
from typing import Any

from ckpt_manager._format.manifest import Manifest

__all__ = ["recorded_model_files", "write_local_model_files"]


def recorded_model_files(m: Manifest) -> dict[str, str]:
    """`{name: text}` recorded in the step (empty when the run recorded none)."""
    # Here, not at the top: `_types` imports torch, which this module never needs.
    from ckpt_manager._types import MODEL_FILES_KEY

    tree: Any = m.tree
    if tree[0] != "d":
        return {}
    for key, node in tree[1]:
        if key != MODEL_FILES_KEY or node[0] != "d":
            continue
        return {
            str(name): child[1]
            for name, child in node[1]
            if child[0] == "v" and isinstance(child[1], str) and _plain_name(str(name))
        }
    return {}


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def write_local_model_files(files: dict[str, str], directory: str) -> None:
    """Write each file into local `directory` atomically (temp name, fsync, rename)."""
    for name, text in files.items():
        path = os.path.join(directory, name)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
