"""Token datasets: flat token files on local disk or any fsspec URI, and their mixture.

A token file is the nanoGPT/Megatron-style flat array of token ids (`<name>.bin`, uint16 or
uint32, little-endian) with a JSON sidecar `<name>.json` that says its dtype, vocabulary size
and token count. The sidecar is written last, so a file without one is not a token file yet.

Module plan:
    token_file.py  the format: `TokenFileInfo` (the sidecar), `write_token_file`, `read_info`.
    reader.py      `BlockCache`: range reads of a remote or local file through a bounded LRU
                   of aligned blocks (S3 reads only what a sample needs, memory stays bounded).
    dataset.py     `TokenDataset`: samples of `seq_len + 1` tokens over one or many files, a
                   weighted mixture of sources; a `daemon.jobs.job.Dataset`.
    prepare.py     `trainingd prepare-data` / `python -m daemon.data.prepare`: text files to a
                   token file (bytes, or a local `tokenizers` tokenizer file).

This package imports only the daemon's shared modules (`tests/daemon/test_layering.py`).
Its names load on first use (PEP 562), so `trainingd --help` (which imports `prepare.py` for
its flags) imports neither numpy nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daemon.data.dataset import TokenDataset
    from daemon.data.token_file import TokenFileInfo, read_info, write_token_file

__all__ = ["TokenDataset", "TokenFileInfo", "read_info", "write_token_file"]

_LAZY = {
    "TokenDataset": "daemon.data.dataset",
    "TokenFileInfo": "daemon.data.token_file",
    "read_info": "daemon.data.token_file",
    "write_token_file": "daemon.data.token_file",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'daemon.data' has no attribute {name!r}")
