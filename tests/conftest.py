"""Session-wide fixtures shared by every package's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.s3 import MotoS3, S3Target, isolate_aws_environment


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
