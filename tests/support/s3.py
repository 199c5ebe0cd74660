"""A real S3 endpoint on loopback for tests: moto's threaded server.

The server binds 127.0.0.1 on a free port (never moto's `0.0.0.0:5000` default) and is shared
by the whole test session; each test gets a freshly reset server and its own bucket.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.request
from typing import Any

__all__ = ["MotoS3", "S3Target"]

TEST_REGION = "us-east-1"
TEST_KEY = "testing-key"
TEST_SECRET = "testing-secret"


@dataclasses.dataclass(frozen=True)
class S3Target:
    """A bucket on a loopback S3 server, ready for fsspec/s3fs."""

    endpoint_url: str
    """`http://127.0.0.1:<port>`."""
    bucket: str
    """Bucket name, created empty."""

    @property
    def uri(self) -> str:
        """`s3://<bucket>`."""
        return f"s3://{self.bucket}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for `fsspec.filesystem("s3", ...)` / `s3fs.S3FileSystem`."""
        return {
            "key": TEST_KEY,
            "secret": TEST_SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": TEST_REGION},
        }

    def filesystem(self) -> Any:
        """A fresh (uncached) `s3fs.S3FileSystem` for this endpoint."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)


def isolate_aws_environment() -> None:
    """Point AWS clients at dummy credentials so nothing reaches a real account."""
    os.environ["AWS_ACCESS_KEY_ID"] = TEST_KEY
    os.environ["AWS_SECRET_ACCESS_KEY"] = TEST_SECRET
    os.environ["AWS_DEFAULT_REGION"] = TEST_REGION
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(var, None)


class MotoS3:
    """moto's S3 server in a background thread, on 127.0.0.1 and a free port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint_url = ""
        self._bucket_seq = 0

    def start(self) -> MotoS3:
        """Start serving; returns self."""
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint_url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        """Stop serving."""
        self._server.stop()

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def new_bucket(self, prefix: str = "test") -> S3Target:
        """Create an empty bucket and return it as a target."""
        import s3fs
        from fsspec.asyn import sync

        self._bucket_seq += 1
        target = S3Target(self.endpoint_url, f"{prefix}-{self._bucket_seq}")
        fs = target.filesystem()
        # A bare CreateBucket: s3fs.mkdir sends a LocationConstraint that us-east-1 rejects.
        sync(fs.loop, fs._call_s3, "create_bucket", Bucket=target.bucket)
        s3fs.S3FileSystem.clear_instance_cache()
        return target
