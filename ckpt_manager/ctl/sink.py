"""Where `ckptctl restore` puts a file it produces: local disk or any fsspec URL (S3).

A file is written to a local temporary first and published whole by `Storage.put_file`: on
local disk by fsync and
`os.replace` next to the destination (atomic), elsewhere by a streamed upload (s3fs: a
multipart upload completed at the end, so the object appears whole or not at all). The
temporary never holds more than the one file being produced.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator

from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.common import StorageFlags, open_root
from ckpt_manager.ctl.errors import UsageError

__all__ = ["OutputFile", "split_uri"]


def split_uri(uri: str) -> tuple[str, str]:
    """`s3://b/dir/model.pt` -> (`s3://b/dir`, `model.pt`); `model.pt` -> (`.`, `model.pt`)."""
    trimmed = uri.rstrip("/")
    scheme, sep, rest = trimmed.partition("://")
    if not sep:
        scheme, rest = "", trimmed
    if "/" not in rest:
        if sep:
            raise UsageError(f"--to {uri}: name a file inside the bucket, e.g. {uri}/model.pt")
        return ".", rest
    parent, name = rest.rsplit("/", 1)
    parent = parent or "/"
    return (f"{scheme}://{parent}" if sep else parent), name


class OutputFile:
    """A destination file; `local_path()` gives a temp path to write, `publish()` moves it."""

    def __init__(self, uri: str, flags: StorageFlags, *, overwrite: bool) -> None:
        """Resolve the destination.

        Raises:
            UsageError: bad URI, or the file exists and `overwrite` is False.
        """
        parent, self.name = split_uri(uri)
        self.uri = uri
        """The destination as given."""
        self.storage: Storage = open_root(parent, flags, must_exist=False)
        """The destination's folder."""
        if not overwrite and self.storage.exists(self.name):
            raise UsageError(f"--to {uri}: the file exists; pass --force to overwrite it")
        if self.storage.capabilities.local_paths:
            os.makedirs(self.storage.path(), exist_ok=True)

    @contextlib.contextmanager
    def writing(self) -> Iterator[str]:
        """A local path to write the whole file to; published when the block exits cleanly."""
        if self.storage.capabilities.local_paths:
            tmp = f"{self.storage.path(self.name)}.tmp-{uuid.uuid4().hex[:12]}"
        else:
            fd, tmp = tempfile.mkstemp(prefix="ckptctl-", suffix=f"-{self.name}")
            os.close(fd)
        try:
            yield tmp
            self.storage.put_file(tmp, self.name)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
