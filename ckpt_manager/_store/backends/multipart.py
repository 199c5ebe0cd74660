"""S3 uploads straight from a buffer, and the clean-up of incomplete multipart uploads.

[Note: uploads never copy the buffer] A shard lives in the writer's shared-memory staging
slab; copying it to `bytes` before the upload would cost one more shard of memory per rank.
So every request body here is a `BufferReader`: a read-only, seekable file-like view over a
slice of the buffer whose `read(n)` copies at most `n` bytes (botocore and aiohttp read a
body in 64 KiB-1 MiB pieces to checksum, sign and send it, and seek back on a retry).
botocore does not accept a `memoryview` as a body, and s3fs's `pipe_file` slices `bytes`
per part, so neither is used for buffers; nor is s3fs's retry loop for these requests
([Note: a body is re-sent from its start]).

A buffer that fits in one part is one PUT; a larger one is a multipart upload of parts of
`chunk_bytes` (raised to S3's 5 MiB minimum, and further if the object would need more than
10,000 parts), at most `concurrency` parts in flight, completed at the end, so the object
is whole or absent. Any failure aborts the upload (best effort, logged) before the error
propagates; `exclusive` writes send `If-None-Match: *` with the PUT or the completion.

[Note: orphaned multipart uploads] A writer killed mid-upload (SIGKILL on a timeout or a
peer's failure) cannot abort its own upload; its parts stay billed and invisible to
listings. `list_uploads`/`abort_upload` let the holders of the lease clean up: the finalizer
aborts the uploads under a failed step's folder once every writer is stopped (through
`steps.remove_uncommitted_step`), the coordinator aborts every upload under the root at
start-up (no writer of the run exists yet), and the deleter's GC aborts those older than
the uncommitted grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
from collections.abc import Callable
from typing import Any, NamedTuple

from ckpt_manager._store.backends.lazy_log import LazyLogger

__all__ = [
    "MAX_PARTS",
    "MIN_PART_BYTES",
    "BufferReader",
    "IncompleteUpload",
    "abort_upload",
    "list_uploads",
    "part_size",
    "upload_buffer",
]

MIN_PART_BYTES = 5 << 20
"""S3's smallest part (all but the last)."""
MAX_PARTS = 10_000
"""S3's most parts in one upload."""
MAX_PART_BYTES = 5 << 30
"""S3's largest part (and largest single PUT)."""


_log = LazyLogger("ckpt_manager.multipart")  # [Note: the writer starts without structlog]


class IncompleteUpload(NamedTuple):
    """A multipart upload that was started and neither completed nor aborted."""

    key: str
    """Object key (without the bucket)."""
    upload_id: str
    """The upload's id."""
    initiated_unix_s: float | None
    """When it was started, by the server's clock (None if the server does not say)."""


class BufferReader(io.RawIOBase):
    """A read-only, seekable file over `view[start:end]` that never copies more than asked."""

    def __init__(self, view: memoryview, start: int = 0, end: int | None = None) -> None:
        """Wrap bytes `[start, end)` of `view` (a byte-format, contiguous memoryview)."""
        super().__init__()
        end = len(view) if end is None else end
        self._view: memoryview | None = view[start:end]
        self._pos = 0
        self._len = end - start

    def __len__(self) -> int:
        return self._len

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def _slice(self, size: int | None) -> memoryview:
        if self._view is None:
            raise ValueError("I/O operation on closed BufferReader")
        stop = self._len if size is None or size < 0 else min(self._len, self._pos + size)
        start = min(self._pos, stop)
        self._pos = max(self._pos, stop)
        return self._view[start:stop]

    def read(self, size: int | None = -1) -> bytes:
        return bytes(self._slice(size))

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        chunk = self._slice(len(target))
        target[: len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        # aiohttp closes a body after sending it; botocore may re-send it on a retry, so
        # only the owner (`upload_buffer`) lets go of the buffer, through `release()`.
        pass

    def release(self) -> None:
        """Drop the view of the buffer (reads fail afterwards)."""
        self._view = None
        super().close()


def part_size(total_bytes: int, chunk_bytes: int) -> int:
    """The part size for a `total_bytes` upload: `chunk_bytes`, at least 5 MiB, at most
    5 GiB, and large enough that no more than 10,000 parts are needed."""
    needed = -(-total_bytes // MAX_PARTS)
    return min(MAX_PART_BYTES, max(chunk_bytes, MIN_PART_BYTES, needed))


def upload_buffer(
    fs: Any,
    bucket: str,
    key: str,
    data: bytes | bytearray | memoryview,
    *,
    exclusive: bool,
    chunk_bytes: int,
    concurrency: int,
    on_part: Callable[[int], None] | None = None,
) -> None:
    """Upload `data` as one object without copying it whole (runs on s3fs's event loop).

    Args:
        fs: an `s3fs.S3FileSystem`.
        bucket: the bucket.
        key: the object key.
        data: the bytes (any contiguous buffer: `bytes`, a slab's `memoryview`, ...).
        exclusive: send `If-None-Match: *` (the object must not exist).
        chunk_bytes: wanted part size (see `part_size`).
        concurrency: parts in flight at most.
        on_part: called with each finished part's number (1-based), for progress.

    Raises:
        Exception: what s3fs/botocore raised (translated by `Storage`); a multipart upload
            was aborted first.
    """
    from fsspec.asyn import sync

    view = memoryview(data).cast("B")
    try:
        sync(
            fs.loop,
            _upload,
            fs,
            bucket,
            key,
            view,
            exclusive,
            part_size(len(view), chunk_bytes),
            max(1, concurrency),
            on_part,
        )
    finally:
        view.release()


async def _upload(
    fs: Any,
    bucket: str,
    key: str,
    view: memoryview,
    exclusive: bool,
    part_bytes: int,
    concurrency: int,
    on_part: Callable[[int], None] | None,
) -> None:
    match = {"IfNoneMatch": "*"} if exclusive else {}
    if len(view) <= part_bytes:
        body = BufferReader(view)
        try:
            await _send_body(fs, "put_object", body, Bucket=bucket, Key=key, **match)
        finally:
            body.release()
        return
    mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    upload_id = mpu["UploadId"]
    try:
        etags = await _upload_parts(
            fs, bucket, key, upload_id, view, part_bytes, concurrency, on_part
        )
        parts = [{"PartNumber": n, "ETag": etag} for n, etag in sorted(etags.items())]
        await fs._call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
            **match,
        )
    except BaseException as err:
        await _abort_quietly(fs, bucket, key, upload_id, err)
        raise


async def _upload_parts(
    fs: Any,
    bucket: str,
    key: str,
    upload_id: str,
    view: memoryview,
    part_bytes: int,
    concurrency: int,
    on_part: Callable[[int], None] | None,
) -> dict[int, str]:
    starts = iter(enumerate(range(0, len(view), part_bytes), start=1))
    etags: dict[int, str] = {}

    async def worker() -> None:
        for number, start in starts:  # a shared iterator: each part is taken once
            body = BufferReader(view, start, min(len(view), start + part_bytes))
            try:
                out = await _send_body(
                    fs,
                    "upload_part",
                    body,
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                )
            finally:
                body.release()
            etags[number] = out["ETag"]
            if on_part is not None:
                on_part(number)

    num_parts = -(-len(view) // part_bytes)
    tasks = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, num_parts))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        # No part may still be in flight when the upload is aborted (S3 would keep it).
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return etags


async def _send_body(fs: Any, method: str, body: BufferReader, **kwargs: Any) -> Any:
    """A request with a `BufferReader` body, retried by botocore only.

    [Note: a body is re-sent from its start] s3fs's `_call_s3` retries a failed call itself,
    passing the same body again wherever the failed attempt left it (mid-part after a dropped
    connection): the retry would send a short part under the full length, or nothing. So
    body-carrying calls go to the client directly, with the options `_call_s3` would add
    (`s3_additional_kwargs`, requester-pays), and rely on botocore's retries, which rewind
    the body before every attempt (`AWSPreparedRequest.reset_stream`). Errors are translated
    as `_call_s3` would (`s3fs.errors.translate_boto_error`).
    """
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    await fs.set_session()
    client = await fs.get_s3(kwargs.get("Bucket"))
    call = getattr(client, method)
    try:
        return await call(**fs._get_s3_method_kwargs(call, Body=body, **kwargs))
    except ClientError as err:
        raise translate_boto_error(err) from err


async def _abort_quietly(
    fs: Any, bucket: str, key: str, upload_id: str, cause: BaseException
) -> None:
    try:
        await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
    except Exception as err:  # the stale-upload sweep gets it later
        _log.warning(
            "ckpt_multipart_abort_failed",
            key=key,
            upload_id=upload_id,
            cause=f"{type(cause).__name__}: {cause}",
            error=f"{type(err).__name__}: {err}",
        )


def list_uploads(fs: Any, bucket: str, prefix: str) -> list[IncompleteUpload]:
    """Every incomplete multipart upload in `bucket` whose key starts with `prefix`.

    Raises:
        Exception: what s3fs/botocore raised (translated by `Storage`).
    """
    from fsspec.asyn import sync

    found: list[IncompleteUpload] = []
    markers: dict[str, str] = {}
    while True:
        out = sync(
            fs.loop, fs._call_s3, "list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers
        )
        for upload in out.get("Uploads") or []:
            if str(upload["Key"]).startswith(prefix):  # servers that ignore Prefix
                found.append(
                    IncompleteUpload(
                        str(upload["Key"]),
                        str(upload["UploadId"]),
                        _unix_s(upload.get("Initiated")),
                    )
                )
        if not out.get("IsTruncated"):
            return found
        markers = {
            "KeyMarker": str(out.get("NextKeyMarker") or ""),
            "UploadIdMarker": str(out.get("NextUploadIdMarker") or ""),
        }
        if not markers["KeyMarker"]:
            return found


def abort_upload(fs: Any, bucket: str, upload: IncompleteUpload) -> None:
    """Abort one incomplete upload (an upload that is already gone is fine).

    Raises:
        Exception: what s3fs/botocore raised (translated by `Storage`).
    """
    from fsspec.asyn import sync

    with contextlib.suppress(FileNotFoundError):  # NoSuchUpload: completed or aborted
        sync(
            fs.loop,
            fs._call_s3,
            "abort_multipart_upload",
            Bucket=bucket,
            Key=upload.key,
            UploadId=upload.upload_id,
        )


def _unix_s(value: Any) -> float | None:
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return value.timestamp()
    return None
