"""A quick start-up check that a checkpoint root can take a checkpoint.

A tool that is about to start work whose first save is minutes away (`trainingd run`) asks
here first, so a typo in the root, a read-only folder, an object store that is down or a
missing bucket ends the start with one line instead of a failed save later. What "can take a
checkpoint" means depends on the store, so each backend answers for itself
(`StorageBackend.probe`): local disk writes and removes a probe file, S3 connects to the
endpoint and looks the bucket up, each once with a short timeout.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Any

from ckpt_manager._store.backends import backend_for
from ckpt_manager.errors import StorageError

__all__ = ["check_root_writable"]

DEFAULT_PROBE_TIMEOUT_S = 3.0
"""How long each network step of a probe may take (connecting, one request)."""


def check_root_writable(
    root_uri: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
) -> None:
    """Check quickly that `root_uri` can take a checkpoint (its store's own probe).

    Args:
        root_uri: the checkpoint root (local path, `file://`, `s3://bucket/prefix`, any fsspec
            URL).
        storage_options: fsspec options, as the manager will open the root with.
        timeout_s: the limit of each network step (connect, one request).

    Raises:
        StorageError: one line naming what is wrong and what to do about it.
    """
    try:
        backend_for(root_uri).probe(root_uri, dict(storage_options or {}), timeout_s=timeout_s)
    except ValueError as err:
        raise StorageError(errno.EINVAL, str(err)) from None
