"""Start-up checks that need no rank: the S3 options the daemon hands the manager, the lease
check of a node joining its job."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

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


_JOB = {"nnodes": "2", "node_rank": 1, "rdzv_endpoint": "127.0.0.1:9"}  # node 1 of 2


def _lease_of_a_coordinator_on_another_host(root: Path, run_id: str) -> None:
    """The lease document a live coordinator of `run_id` on another host left (not released,
    refreshed just now, a ttl of 10 minutes): nothing here can prove it dead."""
    root.mkdir(parents=True)
    now = time.time()
    doc = {
        "run_id": run_id, "owner": "0" * 32, "host": "another-host", "boot_id": "another-boot",
        "pid_ns": "pid:[1]", "pid": 1, "acquired_unix_s": now, "refreshed_unix_s": now,
        "refresh_count": 1, "ttl_s": 600.0, "released": False,
    }  # fmt: skip
    (root / "_LEASE.json").write_text(json.dumps(doc))


def _returns_within(call: Callable[[], None], timeout_s: float) -> bool:
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout_s)


def test_a_node_joining_its_multi_node_job_passes_the_jobs_own_lease_at_once(
    tmp_path: Path,
) -> None:
    # A fresh daemon replacing a lost node of a fixed 2-node job: the lease is the job's own
    # (its coordinator on another host, not refreshing while the ranks restart). Watching it
    # for half its ttl (300 s here) would hold the replacement back for nothing.
    from daemon.agent.preflight import _check_lease

    root = tmp_path / "ckpt"
    cfg = load_config(_JOB | {"ckpt_uri": str(root), "run_id": "the-job"}, env={})
    _lease_of_a_coordinator_on_another_host(root, "the-job")
    assert _returns_within(lambda: _check_lease(cfg), 60)
    # Another run's lease is still watched (and fails the start once it moves).
    other = load_config(_JOB | {"ckpt_uri": str(root), "run_id": "another-job"}, env={})
    assert not _returns_within(lambda: _check_lease(other), 2)
