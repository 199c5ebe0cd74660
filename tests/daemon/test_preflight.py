"""Start-up checks that need no rank: the S3 options the daemon hands the manager."""

from __future__ import annotations

import pytest

from daemon._config_load import load_config
from daemon._preflight import s3_storage_options
from daemon.errors import StartupCheckError


def test_s3_options_come_from_config_then_environment() -> None:
    cfg = load_config({"ckpt_uri": "s3://b/run", "s3_endpoint_url": "http://127.0.0.1:9"}, env={})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:7")
        assert s3_storage_options(cfg) == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
        plain = load_config({"ckpt_uri": "s3://b/run"}, env={})
        assert s3_storage_options(plain) == {
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:7"}
        }
        local = load_config({"ckpt_uri": "/data/ckpt"}, env={})
        assert s3_storage_options(local) == {}


def test_an_environment_endpoint_without_scheme_is_a_startup_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:9000")
    cfg = load_config({"ckpt_uri": "s3://b/run"}, env={})
    with pytest.raises(StartupCheckError, match=r"AWS_ENDPOINT_URL: .*needs a scheme"):
        s3_storage_options(cfg)
