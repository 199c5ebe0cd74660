"""S3 options: the one place s3fs keyword arguments are built (daemon and ckptctl)."""

from __future__ import annotations

import pytest

from ckpt_manager import S3Options


def test_only_s3_uris_get_options() -> None:
    opts = S3Options(endpoint_url="https://s3.local:9000", region="eu-west-1", profile="p")
    assert opts.fsspec_options("/data/ckpt") == {}
    assert opts.fsspec_options("memory://x") == {}
    want = {
        "client_kwargs": {"endpoint_url": "https://s3.local:9000", "region_name": "eu-west-1"},
        "profile": "p",
    }
    assert opts.fsspec_options("s3://b/p") == want
    assert opts.fsspec_options("s3a://b/p") == want
    assert S3Options(anon=True).fsspec_options("s3://b") == {"anon": True}
    assert S3Options().fsspec_options("s3://b") == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"endpoint_url": "127.0.0.1:9000"}, "needs a scheme"),
        ({"endpoint_url": "ftp://h"}, "needs a scheme"),
        ({"anon": True, "profile": "p"}, "exclude each other"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        S3Options(**kwargs)  # type: ignore[arg-type]


def test_endpoint_from_argument_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    assert S3Options.with_environment_endpoint().endpoint_url is None
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    assert S3Options.with_environment_endpoint().endpoint_url == "http://127.0.0.1:1"
    assert S3Options.with_environment_endpoint("http://h:2").endpoint_url == "http://h:2"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "h:3")
    with pytest.raises(ValueError, match="needs a scheme"):
        S3Options.with_environment_endpoint()
