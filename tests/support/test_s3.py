"""The S3 fixture is tested by a round trip through fsspec/s3fs to the loopback server."""

from __future__ import annotations

import fsspec
import pytest

from tests.support.s3 import S3Target

pytestmark = pytest.mark.s3


def test_round_trip_through_fsspec(s3: S3Target) -> None:
    assert s3.endpoint_url.startswith("http://127.0.0.1:")
    fs, root = fsspec.core.url_to_fs(s3.uri, **s3.storage_options)
    payload = bytes(range(256)) * 1000
    fs.pipe_file(f"{root}/dir/blob.bin", payload)
    assert fs.cat_file(f"{root}/dir/blob.bin") == payload
    assert fs.ls(f"{root}/dir", detail=False) == [f"{root}/dir/blob.bin"]


def test_each_test_gets_an_empty_bucket(s3: S3Target) -> None:
    fs = s3.filesystem()
    assert fs.ls(s3.bucket, detail=False) == []


def test_session_bucket_is_usable(s3_session_bucket: S3Target) -> None:
    with fsspec.open(
        f"{s3_session_bucket.uri}/x.txt", "wb", **s3_session_bucket.storage_options
    ) as f:
        f.write(b"hello")
    with fsspec.open(
        f"{s3_session_bucket.uri}/x.txt", "rb", **s3_session_bucket.storage_options
    ) as f:
        assert f.read() == b"hello"
