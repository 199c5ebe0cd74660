"""`check_root_writable`: each store's quick start-up probe, against real stores."""

from __future__ import annotations

import pathlib

import pytest

from ckpt_manager import StorageError, check_root_writable
from tests.support.dist import free_port
from tests.support.s3 import S3Target


def test_a_local_root_is_made_and_left_without_the_probe(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "runs" / "7"
    check_root_writable(str(root))
    assert root.is_dir()
    assert list(root.iterdir()) == []
    check_root_writable(f"file://{root}")


def test_a_local_root_under_a_file_is_not_writable(tmp_path: pathlib.Path) -> None:
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    with pytest.raises(StorageError, match=f"checkpoint root {a_file / 'ckpt'} is not writable"):
        check_root_writable(str(a_file / "ckpt"))


def test_a_memory_root_opens() -> None:
    check_root_writable("memory://probe/root")


def test_an_unknown_protocol_is_one_line() -> None:
    with pytest.raises(StorageError, match="cannot open checkpoint root 'nosuch://x'"):
        check_root_writable("nosuch://x")


@pytest.mark.s3
def test_an_s3_root_needs_its_bucket(s3: S3Target) -> None:
    check_root_writable(f"{s3.uri}/run", s3.storage_options)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist; create it"):
        check_root_writable("s3://no-such-bucket/run", s3.storage_options)


def test_an_s3_endpoint_that_does_not_answer_is_named_at_once() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint}}
    with pytest.raises(StorageError, match=f"S3 endpoint '{endpoint}' is unreachable"):
        check_root_writable("s3://bucket/run", options, timeout_s=1.0)
