"""All URL and path logic: one `Storage` per checkpoint root, over any fsspec filesystem.

`Storage(root_uri, options)` resolves the root with `fsspec.core.url_to_fs` (local paths,
`file://`, `s3://bucket/prefix`, `memory://`, any registered protocol) and exposes a handful of
operations on names relative to the root. Object-store quirks live here and nowhere else:

* Atomic writes. Local disk: a temp file in the target folder (large buffers written with
  `O_DIRECT`, see `_store/direct_write.py`), fsync, then `os.replace`
  (or `os.link` for an exclusive create, which fails if the name exists), then fsync the
  folder. Object stores: one PUT, or a parallel multipart upload completed at the end, so
  an object is either whole or absent; on S3 both send the caller's buffer without copying
  it, and a failed multipart upload is aborted (`_store/multipart.py`). `put_file`
  publishes a finished local file the same way: moved into place on local disk, streamed
  from disk (parallel multipart) elsewhere.
* Exclusive create (the commit marker). Local: `os.link`. S3: `If-None-Match: *` on the PUT
  or on the completion of the multipart upload. Other fsspec backends: their
  `mode="create"`, which is check-then-write (not race-free); the lease keeps two runs from
  committing to one root.
* Conditional writes (the lease): `read_with_version` returns an object with a version
  token and `write_if` replaces it only if it is still at that version (or creates it only
  if absent), else `VersionMismatchError`. S3: the ETag, `If-Match` / `If-None-Match: *` on
  one `PutObject` (the server decides, race-free). Local disk: the version is the content's
  SHA-256; read-compare-write runs under an `flock` on the object's folder and the new
  content is published by temp file + rename, so readers never see a partial document.
  `memory://`: the same under a process-wide mutex. Other fsspec backends: check-then-write
  (not race-free; documented in CONTRACTS.md).
* Listings are never served from fsspec's cache (another process wrote the objects).
* Incomplete multipart uploads (a writer killed mid-upload) are listed and aborted by
  `abort_uploads`.
* Every backend error leaves as a `StorageError` subclass (see `errors.py`).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import os
import posixpath
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import fsspec
import fsspec.asyn
import fsspec.core
from fsspec.implementations.local import LocalFileSystem

from ckpt_manager._format.names import validate_relative_name
from ckpt_manager._store.backend_errors import (
    is_conditional_conflict,
    is_precondition_failed,
    storage_error,
    translated,
)
from ckpt_manager._store.direct_write import write_at_start
from ckpt_manager._store.multipart import abort_upload, list_uploads, upload_buffer
from ckpt_manager.errors import (
    CheckpointError,
    ObjectExistsError,
    VersionMismatchError,
)

__all__ = ["Storage"]

_OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
_PROCESS_LOCAL_PROTOCOLS = frozenset({"memory"})
_CONDITIONAL_LOCK = threading.Lock()  # conditional writes on stores without a server check


def _content_version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _as_unix_s(value: Any) -> float | None:
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return value.timestamp()
    if isinstance(value, int | float):
        return float(value)
    return None


class Storage:
    """A checkpoint root on some filesystem, addressed by names relative to it."""

    def __init__(self, root_uri: str, storage_options: Mapping[str, Any] | None = None) -> None:
        """Resolve the root.

        Args:
            root_uri: local path, `file://...`, `s3://bucket/prefix`, `memory://...`, ...
            storage_options: fsspec options (e.g. `client_kwargs={"endpoint_url": ...}`).

        Raises:
            ValueError: the URI cannot be resolved to a filesystem.
        """
        self.root_uri = root_uri
        """The root as given."""
        self.storage_options = dict(storage_options or {})
        """fsspec options, as given."""
        try:
            fs, root = fsspec.core.url_to_fs(root_uri, **self.storage_options)
        except (ValueError, ImportError) as err:
            raise ValueError(f"cannot open checkpoint root {root_uri!r}: {err}") from err
        self.fs: Any = fs
        """The fsspec filesystem."""
        self.root: str = root.rstrip("/") or "/"
        """The root as the filesystem's own path."""
        protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
        self.protocol: str = str(protocols[0])
        """Primary protocol name (`file`, `s3`, `memory` ...)."""
        self.is_local = isinstance(fs, LocalFileSystem)
        """True for the local filesystem (POSIX atomicity tricks apply)."""
        self.is_object_store = bool(set(map(str, protocols)) & _OBJECT_STORE_PROTOCOLS)
        """True for S3-like stores (no rename, multipart uploads)."""
        self.shared_across_processes = not (set(map(str, protocols)) & _PROCESS_LOCAL_PROTOCOLS)
        """False for `memory://`: another process cannot see what this one writes."""

    def __repr__(self) -> str:
        return f"Storage({self.root_uri!r})"

    def path(self, name: str = "") -> str:
        """Filesystem path of a relative name (validated); the root for `""`."""
        if not name:
            return self.root
        return posixpath.join(self.root, validate_relative_name(name))

    def write(
        self,
        name: str,
        data: bytes | bytearray | memoryview,
        *,
        exclusive: bool = False,
        chunk_bytes: int = 64 << 20,
        concurrency: int = 8,
        staged: Iterable[int] | None = None,
    ) -> None:
        """Write one object atomically (whole or absent).

        Args:
            name: relative name; parent folders are created on local disk.
            data: the bytes.
            exclusive: fail with `ObjectExistsError` if the object exists (commit marker).
            chunk_bytes: multipart part size on object stores.
            concurrency: parts uploaded in parallel on object stores.
            staged: `data` is still being filled: increasing counts of its leading bytes
                that are final, ending with `len(data)` (see `_direct_write`). Local disk
                writes each part as it becomes final; other stores wait for the last count.

        Raises:
            ObjectExistsError: `exclusive` and the object exists.
            StorageError: the write failed; nothing was published under `name`.
        """
        path = self.path(name)
        with translated("write", path):
            if self.is_local:
                self._write_local(path, memoryview(data), exclusive=exclusive, staged=staged)
                return
            for _ in staged or ():  # object stores upload finished bytes only
                pass
            if self.protocol in ("s3", "s3a"):
                self._write_s3(path, data, exclusive, chunk_bytes, concurrency)
            else:
                self.fs.pipe_file(path, bytes(data), mode="create" if exclusive else "overwrite")

    def _write_s3(
        self,
        path: str,
        data: bytes | bytearray | memoryview,
        exclusive: bool,
        chunk_bytes: int,
        concurrency: int,
    ) -> None:
        # [Note: uploads never copy the buffer] in `_store/multipart.py`.
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
            # read back] in `_save/commit.py`).
            if exclusive and is_precondition_failed(err):
                raise FileExistsError(str(err)) from err
            raise
        finally:
            self._invalidate(path)

    def abort_uploads(self, name: str = "", *, older_than_s: float = 0.0) -> int:
        """Abort incomplete multipart uploads under a folder (S3 only; elsewhere 0).

        See [Note: orphaned multipart uploads] in `_store/multipart.py`: a writer killed
        mid-upload leaves its upload behind. Call this only where no live writer may still be
        uploading there, or with an `older_than_s` no live upload can reach.

        Args:
            name: relative folder (`""`: the whole root).
            older_than_s: only uploads started at least this long ago (by the server's clock
                against ours; an upload of unknown age counts as old).

        Returns:
            How many uploads were aborted.

        Raises:
            StorageError: the listing or an abort failed.
        """
        if self.protocol not in ("s3", "s3a"):
            return 0
        path = self.path(name)
        bucket, key, _ = self.fs.split_path(path)
        prefix = f"{key.rstrip('/')}/" if key else ""
        with translated("abort uploads under", path):
            now = time.time()
            num_aborted = 0
            for upload in list_uploads(self.fs, bucket, prefix):
                started = upload.initiated_unix_s
                if older_than_s > 0 and started is not None and now - started < older_than_s:
                    continue
                abort_upload(self.fs, bucket, upload)
                num_aborted += 1
            return num_aborted

    def put_file(
        self,
        local_path: str,
        name: str,
        *,
        exclusive: bool = False,
        chunk_bytes: int = 64 << 20,
        concurrency: int = 8,
    ) -> None:
        """Publish a finished local file as `name`, atomically (whole or absent).

        Local disk: the file is fsynced and moved into place (`local_path` is consumed; a
        file on another filesystem is copied next to the target first). Object stores: the
        file is streamed from disk, as a parallel multipart upload when it is large, never
        held in memory whole.

        Args:
            local_path: the finished file.
            name: relative destination name; parent folders are created on local disk.
            exclusive: fail with `ObjectExistsError` if `name` exists.
            chunk_bytes: multipart part size on object stores.
            concurrency: parts uploaded in parallel on object stores.

        Raises:
            ObjectExistsError: `exclusive` and the destination exists.
            StorageError: the move or upload failed; nothing was published under `name`.
        """
        dest = self.path(name)
        with translated("write", dest):
            if self.is_local:
                self._put_local(local_path, dest, exclusive=exclusive)
                return
            if exclusive and self.exists(name):
                raise ObjectExistsError(errno.EEXIST, f"write {dest}: already exists")
            if self.protocol in ("s3", "s3a"):
                self.fs.put_file(
                    local_path, dest, chunksize=chunk_bytes, max_concurrency=concurrency
                )
            else:
                self.fs.put_file(local_path, dest)

    @staticmethod
    def _put_local(local_path: str, dest: str, *, exclusive: bool) -> None:
        folder = os.path.dirname(dest)
        os.makedirs(folder, exist_ok=True)
        with open(local_path, "rb+") as f:
            os.fsync(f.fileno())
        if os.stat(local_path).st_dev != os.stat(folder).st_dev:
            staged = f"{dest}.tmp-{uuid.uuid4().hex[:12]}"
            shutil.copyfile(local_path, staged)
            with open(staged, "rb+") as f:
                os.fsync(f.fileno())
            os.unlink(local_path)
            local_path = staged
        try:
            if exclusive:
                os.link(local_path, dest)  # see [Note: link, not replace]
                os.unlink(local_path)
            else:
                os.replace(local_path, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                if local_path.startswith(f"{dest}.tmp-"):
                    os.unlink(local_path)
        _fsync_dir(folder)

    @staticmethod
    def _write_local(
        path: str, data: memoryview, *, exclusive: bool, staged: Iterable[int] | None
    ) -> None:
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                write_at_start(fd, tmp, data, staged)
                os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                # [Note: link, not replace] os.link is atomic *and* fails if the name exists;
                # os.replace would silently overwrite a committed manifest.
                os.link(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_dir(folder)

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """Read an object, or bytes `[start, end)` of it."""
        path = self.path(name)
        with translated("read", path):
            return bytes(self.fs.cat_file(path, start=start, end=end))

    def read_with_version(self, name: str) -> tuple[bytes, str]:
        """Read a whole object and the version token `write_if` compares against.

        Raises:
            ObjectNotFoundError: the object does not exist.
            StorageError: the read failed.
        """
        path = self.path(name)
        with translated("read", path):
            if self.protocol in ("s3", "s3a"):
                bucket, key, _ = self.fs.split_path(path)

                async def get() -> tuple[bytes, str]:
                    reply = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
                    body = reply["Body"]
                    try:
                        data = await body.read()
                    finally:
                        body.close()
                    return bytes(data), str(reply["ETag"])

                return fsspec.asyn.sync(self.fs.loop, get)
            data = bytes(self.fs.cat_file(path))
            return data, _content_version(data)

    def write_if(self, name: str, data: bytes, *, expected_version: str | None) -> str:
        """Write a small object only if it is still at `expected_version` (compare-and-swap).

        A version identifies content (an S3 ETag is its MD5; locally its SHA-256): writing
        the very bytes already there keeps the version, so callers that need every write to
        count put a counter or token in the document (the lease does).

        Args:
            name: relative name.
            data: the whole new content.
            expected_version: the version `read_with_version` returned, or None to create
                the object only if it does not exist.

        Returns:
            The new version.

        Raises:
            VersionMismatchError: the object is at another version (or exists when None was
                expected, or is gone): another writer got there first; nothing was written.
            StorageError: the write failed.
        """
        path = self.path(name)
        with translated("conditional write", path):
            if self.protocol in ("s3", "s3a"):
                return self._write_if_s3(path, data, expected_version)
            if self.is_local:
                folder = os.path.dirname(path)
                os.makedirs(folder, exist_ok=True)
                # The lock is on the folder: the object itself is replaced by rename, and a
                # lock file would be one more name in the root.
                lock = os.open(folder, os.O_RDONLY)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    self._check_version(path, expected_version)
                    self._write_local(path, memoryview(data), exclusive=False, staged=None)
                finally:
                    os.close(lock)  # releases the lock
                return _content_version(data)
            with _CONDITIONAL_LOCK:
                self._check_version(path, expected_version)
                self.fs.pipe_file(path, bytes(data))
            return _content_version(data)

    def _check_version(self, path: str, expected_version: str | None) -> None:
        try:
            current: str | None = _content_version(bytes(self.fs.cat_file(path)))
        except FileNotFoundError:
            current = None
        if current != expected_version:
            raise VersionMismatchError(
                errno.EAGAIN,
                f"conditional write {path}: expected "
                f"{'no object' if expected_version is None else 'version ' + expected_version}, "
                f"found {'no object' if current is None else 'version ' + current}",
            )

    def _write_if_s3(self, path: str, data: bytes, expected_version: str | None) -> str:
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
            self._invalidate(path)
        return str(reply["ETag"])

    def read_many(self, names: list[str]) -> list[bytes | CheckpointError]:
        """Read whole objects; on async filesystems (S3) as concurrent requests in one batch.

        Returns, in order, each object's bytes or the `StorageError` (`ObjectNotFoundError`
        for a missing object) its read failed with, so one bad name never hides the others.
        """
        paths = [self.path(n) for n in names]
        if not paths:
            return []
        with translated("read", paths[0]):
            results = self.fs.cat_ranges(paths, None, None, on_error="return")
        return [
            storage_error("read", path, r) if isinstance(r, Exception) else bytes(r)
            for path, r in zip(paths, results, strict=True)
        ]

    def size(self, name: str) -> int:
        """Size in bytes of an object."""
        path = self.path(name)
        with translated("stat", path):
            self._invalidate(path)
            return int(self.fs.size(path))

    def exists(self, name: str) -> bool:
        """Whether an object or folder exists."""
        path = self.path(name)
        with translated("stat", path):
            self._invalidate(path)
            return bool(self.fs.exists(path))

    def list_names(self, name: str = "") -> list[str]:
        """Names of the direct children of a folder (empty if it does not exist), sorted."""
        path = self.path(name)
        with translated("list", path):
            self._invalidate(path)
            try:
                if self.protocol in ("s3", "s3a"):
                    # s3fs's `ls` lists the parent folder when a folder comes back empty (to
                    # tell a file from a folder): for `_pins/` that is the whole root, ~10
                    # pages at 10k steps. The folder's own listing is all a caller needs.
                    found = fsspec.asyn.sync(self.fs.loop, self.fs._lsdir, path, refresh=True)
                    entries = [str(e["name"]) for e in found]
                else:
                    entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
        base = path.rstrip("/")
        out = {posixpath.basename(str(e).rstrip("/")) for e in entries}
        out.discard(posixpath.basename(base))
        return sorted(n for n in out if n)

    def modified_unix_s(self, name: str) -> float | None:
        """Last modification time of an object, or of the newest object anywhere in a folder."""
        path = self.path(name)
        with translated("stat", path):
            self._invalidate(path)
            try:
                info = self.fs.info(path)
            except FileNotFoundError:
                return None
            found = self._time_of(info)
            if info.get("type") != "directory":
                return found
            # Recursive: a spread step keeps its files one level down, where neither an
            # object store's folder (no time of its own) nor a local folder's mtime (set when
            # a sub-folder is made, not when a file in it is written) sees them.
            times = [self._time_of(e) for e in self.fs.find(path, detail=True).values()]
            known = [t for t in times if t is not None]
            if found is not None:
                known.append(found)
            return max(known) if known else None

    @staticmethod
    def _time_of(info: Mapping[str, Any]) -> float | None:
        for key in ("mtime", "LastModified", "last_modified", "created"):
            value = _as_unix_s(info.get(key))
            if value is not None:
                return value
        return None

    def remove(self, name: str) -> None:
        """Delete one object; a missing object is fine."""
        path = self.path(name)
        with translated("delete", path), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def remove_tree(self, name: str) -> None:
        """Delete a folder and everything under it; a missing folder is fine."""
        path = self.path(name)
        is_s3 = self.protocol in ("s3", "s3a")
        with translated("delete", path):
            self._invalidate(path)
            folders = [path]
            with contextlib.suppress(FileNotFoundError):
                if is_s3:
                    found = self.fs.find(path, withdirs=True, detail=True)
                    folders += [p for p, i in found.items() if i.get("type") == "directory"]
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=True)
            if is_s3:
                # Stores with a real namespace (SeaweedFS's filer) keep emptied folders listed
                # until their `folder/` keys are deleted too, deepest first.
                for folder in sorted(set(folders), key=lambda p: p.count("/"), reverse=True):
                    bucket, key, _ = self.fs.split_path(folder)
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")
            self._invalidate(path)

    def _invalidate(self, path: str) -> None:
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate(path)
