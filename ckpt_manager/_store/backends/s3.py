"""S3 and S3-compatible stores (`s3://`, `s3a://`; AWS, moto, SeaweedFS, MinIO) over s3fs.

* Atomic writes: one PUT, or a parallel multipart upload completed at the end, so an object
  is either whole or absent; both send the caller's buffer without copying it, and a failed
  multipart upload is aborted (`multipart.py`). `put_file` streams a finished local file from
  disk (s3fs's parallel multipart upload), never holding it in memory whole.
* Exclusive create (the commit marker): `If-None-Match: *` on the PUT or on the completion
  of the multipart upload (the server decides, race-free). `put_file` checks, then uploads.
* Conditional writes (the lease): the version is the ETag; `If-Match` /
  `If-None-Match: *` on one `PutObject` (the server decides, race-free).
* Incomplete multipart uploads (a writer killed mid-upload) are listed and aborted by
  `abort_uploads`.
* Listings use s3fs's folder listing only, and deleting a tree also deletes the folder keys
  that stores with a real namespace (SeaweedFS) keep.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import time
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import fsspec.asyn

from ckpt_manager._store.backend_errors import is_conditional_conflict, is_precondition_failed
from ckpt_manager._store.backends.base import Capabilities
from ckpt_manager._store.backends.fsspec import (
    REMOTE_READ_CONCURRENCY,
    REMOTE_READ_PREFETCH,
    FsspecBackend,
    drain,
    protocols_of,
)
from ckpt_manager._store.backends.multipart import abort_upload, list_uploads, upload_buffer
from ckpt_manager.errors import ObjectExistsError, StorageError, VersionMismatchError

__all__ = ["S3Backend"]


class S3Backend(FsspecBackend):
    """A root in an S3 bucket (`fs` is an `s3fs.S3FileSystem`)."""

    name: ClassVar[str] = "s3"
    """Registry name."""
    schemes: ClassVar[tuple[str, ...]] = ("s3", "s3a")
    """URI schemes served by s3fs (storage options: s3fs's, see `_store/options.py`)."""
    fixed_capabilities: ClassVar[Capabilities | None] = Capabilities(
        local_paths=False,
        remote=True,
        progressive_write=False,
        read_prefetch=REMOTE_READ_PREFETCH,
        read_concurrency=REMOTE_READ_CONCURRENCY,
        race_free_exclusive_create=True,
        race_free_conditional_write=True,
        shared_across_processes=True,
    )
    """Race-free conditions decided by the server; remote, so prefetched and retried."""

    @classmethod
    def probe(cls, root_uri: str, storage_options: Mapping[str, Any], *, timeout_s: float) -> None:
        """The endpoint accepts a TCP connection and the bucket exists, each asked once
        with `timeout_s` (botocore's own defaults retry for minutes)."""
        client_kwargs = dict(storage_options.get("client_kwargs") or {})
        endpoint = str(client_kwargs.get("endpoint_url") or "")
        if endpoint:
            parts = urllib.parse.urlsplit(endpoint)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                with socket.create_connection((parts.hostname, port), timeout=timeout_s):
                    pass
            except OSError as err:
                reason = err.strerror or type(err).__name__
                raise StorageError(
                    err.errno or errno.EHOSTUNREACH,
                    f"S3 endpoint {endpoint!r} is unreachable ({reason}); check the address or "
                    "start the object store",
                ) from None
        quick = {
            **storage_options,
            "skip_instance_cache": True,
            "config_kwargs": {
                **dict(storage_options.get("config_kwargs") or {}),
                "connect_timeout": timeout_s,
                "read_timeout": max(timeout_s, 10.0),
                "retries": {"max_attempts": 1},
            },
        }
        backend = cls.open(root_uri, quick)
        bucket = backend.root.split("/", 1)[0]
        try:
            exists = bool(backend.fs.exists(bucket))
        except Exception as err:  # botocore raises many unrelated types; report any as one
            raise StorageError(errno.EIO, f"cannot reach the bucket {bucket!r}: {err}") from None
        if not exists:
            raise StorageError(errno.ENOENT, f"bucket {bucket!r} does not exist; create it")

    @classmethod
    def serves_filesystem(cls, fs: Any) -> bool:
        """s3fs (whose protocols are `s3` and `s3a`)."""
        return bool(protocols_of(fs) & set(cls.schemes))

    def write(
        self,
        path: str,
        data: bytes | bytearray | memoryview,
        *,
        exclusive: bool,
        chunk_bytes: int,
        concurrency: int,
        staged: Iterable[int] | None,
    ) -> None:
        """One PUT or a multipart upload straight from `data`, after its last staged count."""
        drain(staged)  # object stores upload finished bytes only
        # [Note: uploads never copy the buffer] in `multipart.py`.
        bucket, key, _ = self.fs.split_path(path)
        try:
            upload_buffer(
                self.fs,
                bucket,
                key,
                data,
                exclusive=exclusive,
                chunk_bytes=chunk_bytes,
                concurrency=concurrency,
            )
        except FileExistsError:
            raise
        except Exception as err:
            # s3fs turns a 412 to `If-None-Match` into FileExistsError only when the reply
            # names the condition; servers that omit it (SeaweedFS) come back as a plain
            # EINVAL, and an untranslated botocore error is possible too: every 412 on an
            # exclusive write means "the object exists" (see [Note: an existing manifest is
            # read back] in `_store/publish.py`).
            if exclusive and is_precondition_failed(err):
                raise FileExistsError(str(err)) from err
            raise
        finally:
            self.invalidate(path)

    def put_file(
        self, local_path: str, path: str, *, exclusive: bool, chunk_bytes: int, concurrency: int
    ) -> None:
        """s3fs's streamed (multipart) upload; an exclusive one checks first."""
        if exclusive and self.exists(path):
            raise ObjectExistsError(errno.EEXIST, f"write {path}: already exists")
        self._upload_file(local_path, path, chunk_bytes, concurrency)

    def _upload_file(self, local_path: str, path: str, chunk_bytes: int, concurrency: int) -> None:
        self.fs.put_file(local_path, path, chunksize=chunk_bytes, max_concurrency=concurrency)

    def read_with_version(self, path: str) -> tuple[bytes, str]:
        """One GET: the body and its ETag."""
        bucket, key, _ = self.fs.split_path(path)

        async def get() -> tuple[bytes, str]:
            reply = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            body = reply["Body"]
            try:
                data = await body.read()
            finally:
                body.close()
            return bytes(data), str(reply["ETag"])

        result: tuple[bytes, str] = fsspec.asyn.sync(self.fs.loop, get)
        return result

    def write_if(self, path: str, data: bytes, *, expected_version: str | None) -> str:
        """One `PutObject` with `If-Match` (or `If-None-Match: *`); returns the new ETag."""
        bucket, key, _ = self.fs.split_path(path)
        condition = (
            {"IfNoneMatch": "*"} if expected_version is None else {"IfMatch": expected_version}
        )
        try:
            reply = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except Exception as err:
            if is_conditional_conflict(err):
                raise VersionMismatchError(
                    errno.EAGAIN,
                    f"conditional write {path}: not at the expected version "
                    f"({'absent' if expected_version is None else expected_version}): {err}",
                ) from err
            raise
        finally:
            self.invalidate(path)
        return str(reply["ETag"])

    def _child_paths(self, path: str) -> list[str]:
        # s3fs's `ls` lists the parent folder when a folder comes back empty (to tell a file
        # from a folder): for `_pins/` that is the whole root, ~10 pages at 10k steps. The
        # folder's own listing is all a caller needs.
        found = fsspec.asyn.sync(self.fs.loop, self.fs._lsdir, path, refresh=True)
        return [str(e["name"]) for e in found]

    def remove_tree(self, path: str) -> None:
        """Delete every key under the folder, then its folder keys, deepest first."""
        self.invalidate(path)
        folders = [path]
        with contextlib.suppress(FileNotFoundError):
            found = self.fs.find(path, withdirs=True, detail=True)
            folders += [p for p, i in found.items() if i.get("type") == "directory"]
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        # Stores with a real namespace (SeaweedFS's filer) keep emptied folders listed
        # until their `folder/` keys are deleted too, deepest first.
        for folder in sorted(set(folders), key=lambda p: p.count("/"), reverse=True):
            bucket, key, _ = self.fs.split_path(folder)
            with contextlib.suppress(FileNotFoundError):
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")
        self.invalidate(path)

    def abort_uploads(self, path: str, *, older_than_s: float) -> int:
        """List the folder's incomplete multipart uploads and abort the old enough ones.

        See [Note: orphaned multipart uploads] in `multipart.py`.
        """
        bucket, key, _ = self.fs.split_path(path)
        prefix = f"{key.rstrip('/')}/" if key else ""
        now = time.time()
        num_aborted = 0
        for upload in list_uploads(self.fs, bucket, prefix):
            started = upload.initiated_unix_s
            if older_than_s > 0 and started is not None and now - started < older_than_s:
                continue
            abort_upload(self.fs, bucket, upload)
            num_aborted += 1
        return num_aborted
