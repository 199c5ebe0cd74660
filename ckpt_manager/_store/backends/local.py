"""Local disk (`/path`, `file://`): POSIX atomicity, fsync, `O_DIRECT` for large buffers.

* Atomic writes: a temp file in the target folder (large buffers written with `O_DIRECT`,
  see `direct_write.py`; a staged buffer part by part as it becomes final), fsync, then
  `os.replace` (or `os.link` for an exclusive create, which fails if the name exists), then
  fsync the folder. `put_file` moves a finished file into place the same way (a file on
  another filesystem is copied next to the target first).
* Conditional writes (the lease): the version is the content's SHA-256; read-compare-write
  runs under an `flock` on the object's folder and the new content is published by temp
  file + rename, so readers never see a partial document. Race-free across processes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, Self

from fsspec.implementations.local import LocalFileSystem

from ckpt_manager._store.backends.base import Capabilities
from ckpt_manager._store.backends.direct_write import (
    forget_buffer,
    register_buffer,
    write_at_start,
)
from ckpt_manager._store.backends.fsspec import FsspecBackend, content_version, open_filesystem
from ckpt_manager.errors import StorageError

__all__ = ["LocalBackend"]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBackend(FsspecBackend):
    """A root on this host's filesystem (fsspec's `LocalFileSystem` for reads and listings)."""

    name: ClassVar[str] = "local"
    """Registry name."""
    schemes: ClassVar[tuple[str, ...]] = ("file", "local")
    """Plain paths have the scheme `file` (see `backends.uri_scheme`)."""
    fixed_capabilities: ClassVar[Capabilities | None] = Capabilities(
        local_paths=True,
        remote=False,
        progressive_write=True,
        read_prefetch=0,
        read_concurrency=1,
        race_free_exclusive_create=True,
        race_free_conditional_write=True,
        shared_across_processes=True,
    )
    """POSIX: link, rename and flock decide races; staged buffers written as they fill."""

    @classmethod
    def open(cls, root_uri: str, storage_options: Mapping[str, Any]) -> Self:
        """The backend for a local path or `file://` URI.

        Raises:
            ValueError: the URI does not resolve to the local filesystem.
        """
        fs, root = open_filesystem(root_uri, storage_options)
        if not isinstance(fs, LocalFileSystem):
            raise ValueError(f"cannot open checkpoint root {root_uri!r}: not a local path")
        return cls(fs, root)

    @classmethod
    def probe(cls, root_uri: str, storage_options: Mapping[str, Any], *, timeout_s: float) -> None:
        """The folder exists or can be made, and a probe file can be written and removed."""
        folder = cls.path_of(root_uri)
        try:
            os.makedirs(folder, exist_ok=True)
            probe = os.path.join(folder, f".trainingd-probe-{uuid.uuid4().hex}")
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.unlink(probe)
        except OSError as err:
            reason = err.strerror or type(err).__name__
            raise StorageError(
                err.errno or errno.EIO, f"checkpoint root {folder} is not writable: {reason}"
            ) from None

    @classmethod
    def serves_filesystem(cls, fs: Any) -> bool:
        """fsspec's local filesystem, also a subclass under a protocol of its own."""
        return isinstance(fs, LocalFileSystem)

    @staticmethod
    def path_of(uri: str) -> str:
        """The path a local URI names (`file:///data` -> `/data`; a plain path as given)."""
        for scheme in LocalBackend.schemes:
            uri = uri.removeprefix(f"{scheme}://")
        return uri

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
        """Temp file (each staged part written as it is final), fsync, rename or link."""
        self.write_file(path, memoryview(data), exclusive=exclusive, staged=staged)

    def read_into(self, path: str, start: int, out: memoryview) -> int:
        """`preadv` straight into `out`: a restore reads the page cache into its tensors
        without an intermediate bytes object (whose fresh pages fault at every read) or a
        copy out of one ([Note: a durable restore reads into its tensors] in
        `_load/restore.py`). A filesystem class of its own that reads otherwise (a
        `LocalFileSystem` subclass overriding `cat_file`) is read through its `cat_file`."""
        if type(self.fs).cat_file is not LocalFileSystem.cat_file:
            return super().read_into(path, start, out)
        done = 0
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while done < len(out):
                got = os.preadv(fd, [out[done:]], start + done)
                if got == 0:
                    break  # the file ends here
                done += got
        finally:
            os.close(fd)
        return done

    @staticmethod
    def write_file(
        path: str,
        data: memoryview,
        *,
        exclusive: bool,
        staged: Iterable[int] | None,
        around_rename: Callable[[], contextlib.AbstractContextManager[object]] = (
            contextlib.nullcontext
        ),
    ) -> None:
        """Publish `data` as the file `path`: temp file, fsync, rename (or link) inside
        `around_rename()` (a conditional write's lock and comparison), fsync the folder."""
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
            with around_rename():
                if exclusive:
                    # [Note: link, not replace] os.link is atomic *and* fails if the name
                    # exists; os.replace would silently overwrite a committed manifest.
                    os.link(tmp, path)
                else:
                    os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_dir(folder)

    def put_file(
        self, local_path: str, path: str, *, exclusive: bool, chunk_bytes: int, concurrency: int
    ) -> None:
        """fsync the file and move it into place (`local_path` is consumed)."""
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        with open(local_path, "rb+") as f:
            os.fsync(f.fileno())
        if os.stat(local_path).st_dev != os.stat(folder).st_dev:
            staged = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
            shutil.copyfile(local_path, staged)
            with open(staged, "rb+") as f:
                os.fsync(f.fileno())
            os.unlink(local_path)
            local_path = staged
        try:
            if exclusive:
                os.link(local_path, path)  # see [Note: link, not replace]
                os.unlink(local_path)
            else:
                os.replace(local_path, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                if local_path.startswith(f"{path}.tmp-"):
                    os.unlink(local_path)
        _fsync_dir(folder)

    def move_tree(self, src: str, dst: str) -> None:
        """One `rename` of the folder (atomic), then fsync both parent folders.

        Raises:
            FileNotFoundError: `src` does not exist.
            OSError: `dst` exists, or the rename failed; nothing moved.
        """
        parent = os.path.dirname(dst.rstrip("/"))
        os.makedirs(parent, exist_ok=True)
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "destination exists", dst)
        os.rename(src, dst)
        _fsync_dir(parent)
        _fsync_dir(os.path.dirname(src.rstrip("/")))

    def write_if(self, path: str, data: bytes, *, expected_version: str | None) -> str:
        """Compare and publish: the new content is written and fsynced beside the object
        first; under an `flock` on the object's folder only the comparison and the rename.

        [Note: the lease lock covers a read and a rename] Every process's conditional write
        waits for the folder's lock, so whatever runs under it stops them all while it runs
        and forever if its process is stopped there (SIGSTOP, a frozen cgroup, an fsync hung
        on a failing disk): a holder stopped inside its refresh kept the next run from ever
        taking over its expired lease (`test_lease.py`'s stopped holder, under load, failed
        once in a CI run this way). The temp file's write and fsync, and the folder's fsync,
        now run outside the lock: it covers a read of a small file and a rename.
        """
        folder = os.path.dirname(path)

        @contextlib.contextmanager
        def compared() -> Iterator[None]:
            # The lock is on the folder: the object itself is replaced by rename, and a
            # lock file would be one more name in the root (write_file made the folder).
            lock = os.open(folder, os.O_RDONLY)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self.check_version(path, expected_version)
                yield
            finally:
                os.close(lock)  # releases the lock

        self.write_file(
            path, memoryview(data), exclusive=False, staged=None, around_rename=compared
        )
        return content_version(data)

    def keep_buffer(self, buffer: mmap.mmap) -> bool:
        """Register `buffer` for direct writes through io_uring ([Note: direct writes from
        registered buffers] in `uring.py`): its pages are pinned once, not at every write."""
        return register_buffer(buffer)

    def release_buffer(self, buffer: mmap.mmap) -> None:
        """Unregister `buffer` (its pages are pinned until then)."""
        forget_buffer(buffer)
