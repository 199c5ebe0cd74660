"""Start-up checks that need no rank: the S3 options the daemon hands the manager."""

from __future__ import annotations

import pytest

from daemon._config_load import load_config
from daemon._storage import s3_storage_options
from daemon.errors import StartupCheckError


def test_s3_options_come_from_config_then_environment() -> None:
    cfg = load_config({"ckpt_uri": "s3://b/run", "s3_endpoint_url": "http://127.0.0.1:9"}, env={})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:7")
        assert s3_storage_options(cfg) == {
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
            "config_kwargs": {"user_agent_extra": "trainingd-agent"},
        }
        plain = load_config({"ckpt_uri": "s3://b/run"}, env={})
        # Each caller is named in its requests' User-Agent (an access log tells them apart).
        assert s3_storage_options(plain, "rank") == {
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:7"},
            "config_kwargs": {"user_agent_extra": "trainingd-rank"},
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


def test_s3_spread_prefixes_reach_the_manager_on_s3_roots_only() -> None:
    from ckpt_manager._config import DEFAULT_S3_SPREAD_PREFIXES
    from daemon.rank.loop import _checkpoint_config

    s3 = _checkpoint_config(load_config({"ckpt_uri": "s3://b/run"}, env={}))
    assert s3.spread_for("s3://b/run") == DEFAULT_S3_SPREAD_PREFIXES == 16
    custom = load_config({"ckpt_uri": "s3://b/run", "s3_spread_prefixes": 0}, env={})
    assert _checkpoint_config(custom).spread_for("s3://b/run") == 0
    local = load_config({"ckpt_uri": "/data/ckpt", "s3_spread_prefixes": 64}, env={})
    assert _checkpoint_config(local).spread_for("/data/ckpt") == 0
    with pytest.raises(ValueError, match="s3_spread_prefixes=300: use 0"):
        load_config({"ckpt_uri": "s3://b/run", "s3_spread_prefixes": 300}, env={})
