"""S3 uploads straight from a slab: multipart round trips, aborts, the stale-upload sweep, and
no copy of the whole buffer (see [Note: uploads never copy the buffer] in `multipart.py`)."""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fsspec.asyn import sync

from ckpt_manager._store.backends.multipart import (
    MAX_PARTS,
    MIN_PART_BYTES,
    BufferReader,
    part_size,
)
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import ObjectExistsError
from tests.support.proxy import ThrottledProxy

pytestmark = pytest.mark.s3

MIB = 1 << 20
REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[4])


@pytest.fixture
def slab() -> Iterator[memoryview]:
    """12 MiB of random bytes in shared memory, like the writer's staging slab."""
    size = 12 * MIB + 12345
    fd = os.memfd_create("test-slab")
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    mm[:] = os.urandom(size)
    view = memoryview(mm)
    try:
        yield view
    finally:
        view.release()
        mm.close()


def _uploads(storage: Storage) -> list[dict[str, Any]]:
    bucket, key, _ = storage.backend.fs.split_path(storage.root)
    out = sync(
        storage.backend.fs.loop,
        storage.backend.fs._call_s3,
        "list_multipart_uploads",
        Bucket=bucket,
        Prefix=key,
    )
    return list(out.get("Uploads", []))


def _storage(request: pytest.FixtureRequest, server: str) -> Storage:
    target = request.getfixturevalue(server)
    return Storage(f"{target.uri}/mp-{uuid.uuid4().hex[:8]}", target.storage_options)


def test_part_size_respects_s3_limits() -> None:
    assert part_size(100 * MIB, 8 * MIB) == 8 * MIB
    assert part_size(100 * MIB, 1 * MIB) == MIN_PART_BYTES
    huge = 2 * MAX_PARTS * 8 * MIB  # would need 20,000 parts of 8 MiB
    assert part_size(huge, 8 * MIB) == 16 * MIB
    assert -(-huge // part_size(huge, 8 * MIB)) <= MAX_PARTS


def test_buffer_reader_reads_at_most_what_is_asked() -> None:
    data = bytes(range(256)) * 4
    reader = BufferReader(memoryview(data), 10, 110)
    assert len(reader) == 100
    assert reader.read(7) == data[10:17]
    assert reader.tell() == 7
    target = bytearray(5)
    assert reader.readinto(target) == 5
    assert bytes(target) == data[17:22]
    assert reader.read() == data[22:110]
    assert reader.read(3) == b""
    reader.seek(0)
    assert reader.read(200) == data[10:110]
    reader.seek(-4, os.SEEK_END)
    assert reader.read() == data[106:110]
    reader.release()
    with pytest.raises(ValueError, match="closed"):
        reader.read(1)


@pytest.mark.parametrize("server", ["s3", "seaweed"])
def test_slab_write_uploads_multipart_and_reads_back(
    request: pytest.FixtureRequest, server: str, slab: memoryview
) -> None:
    storage = _storage(request, server)
    storage.write("step-1/shard.bin", slab, chunk_bytes=5 * MIB, concurrency=2)
    assert storage.read("step-1/shard.bin") == bytes(slab)
    info = storage.backend.fs.info(storage.path("step-1/shard.bin"))
    assert str(info["ETag"]).strip('"').endswith("-3")  # a multipart object of 3 parts
    storage.write("step-1/small.bin", slab[:1000], chunk_bytes=5 * MIB)  # one PUT
    assert storage.read("step-1/small.bin") == bytes(slab[:1000])
    assert _uploads(storage) == []


def test_failed_multipart_upload_is_aborted(s3: Any, slab: memoryview) -> None:
    storage = Storage(f"{s3.uri}/failed", s3.storage_options)
    storage.write("step-1/shard.bin", slab, chunk_bytes=5 * MIB)
    # The exclusive completion is refused (412): the upload must not stay behind.
    with pytest.raises(ObjectExistsError):
        storage.write("step-1/shard.bin", slab, chunk_bytes=5 * MIB, exclusive=True)
    assert _uploads(storage) == []
    assert storage.read("step-1/shard.bin") == bytes(slab)


def test_abort_uploads_keeps_young_ones_and_other_folders(seaweed: Any) -> None:
    # SeaweedFS reports when each upload started (moto reports a fixed date in 2010).
    storage = Storage(f"{seaweed.uri}/sweep-{uuid.uuid4().hex[:8]}", seaweed.storage_options)
    bucket, root_key, _ = storage.backend.fs.split_path(storage.root)
    for key in ("step-1/a.bin", "step-10/a.bin", "step-2/a.bin"):
        sync(
            storage.backend.fs.loop,
            storage.backend.fs._call_s3,
            "create_multipart_upload",
            Bucket=bucket,
            Key=f"{root_key}/{key}",
        )
    assert storage.abort_uploads(older_than_s=3600) == 0  # all younger than an hour
    assert storage.abort_uploads("step-1") == 1  # not step-10: a folder, not a key prefix
    assert sorted(u["Key"] for u in _uploads(storage)) == [
        f"{root_key}/step-10/a.bin",
        f"{root_key}/step-2/a.bin",
    ]
    assert storage.abort_uploads() == 2
    assert _uploads(storage) == []


def test_abort_uploads_is_a_no_op_off_s3(tmp_path: Any) -> None:
    assert Storage(str(tmp_path)).abort_uploads() == 0


def test_upload_never_copies_the_whole_buffer(s3: Any) -> None:
    # Traced in a fresh process, away from the moto server that runs in this one: a 64 MiB
    # slab goes out in 8 MiB parts, two in flight, and the heap never holds a copy of it.
    script = textwrap.dedent(
        """
        import json, mmap, os, sys, tracemalloc
        from ckpt_manager._store.storage import Storage

        root, options = sys.argv[1], json.loads(sys.argv[2])
        storage = Storage(root, options)
        storage.write("warm-up", b"x")  # client set-up is not part of the upload
        size = 64 << 20
        fd = os.memfd_create("slab")
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        mm[:] = os.urandom(1 << 20) * 64
        view = memoryview(mm)
        tracemalloc.start()
        storage.write("step-1/shard.bin", view, chunk_bytes=8 << 20, concurrency=2)
        print(json.dumps({"peak": tracemalloc.get_traced_memory()[1]}))
        """
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            f"{s3.uri}/traced",
            json.dumps(s3.storage_options),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak"]
    assert peak < 16 * MIB, f"peak traced heap {peak / MIB:.1f} MiB during a 64 MiB upload"
    storage = Storage(f"{s3.uri}/traced", s3.storage_options)
    assert storage.size("step-1/shard.bin") == 64 * MIB


def test_a_part_cut_mid_body_is_resent_whole(s3: Any, slab: memoryview) -> None:
    # [Note: a body is re-sent from its start]: the first connection is dropped 3 MiB into a
    # part; the retried part must carry all its bytes again, not the rest of the first try
    # (botocore's retry rewinds the BufferReader; a short part would fail the read-back).
    with ThrottledProxy(s3.endpoint_url, cut_once_after_bytes=3 * MIB) as proxy:
        options = dict(s3.storage_options)
        options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
        options["skip_instance_cache"] = True
        storage = Storage(f"{s3.uri}/cut", options)
        storage.write("step-1/shard.bin", slab, chunk_bytes=5 * MIB, concurrency=1)
        assert proxy.num_cut == 1
    direct = Storage(f"{s3.uri}/cut", s3.storage_options)
    assert direct.read("step-1/shard.bin") == bytes(slab)
    assert _uploads(direct) == []
