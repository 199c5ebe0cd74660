"""The manager on S3-compatible servers (moto, SeaweedFS) and an S3 outage mid-upload."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import s3fs
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, SaveFailedError
from ckpt_manager._config import DEFAULT_S3_SPREAD_PREFIXES
from ckpt_manager._format.layout import MANIFEST_NAME, index_file_name, shard_file_name, step_dir
from ckpt_manager._save.writer import FAULT_ENV
from tests.ckpt_manager.save.test_commit import commit_with_lost_reply
from tests.support.dist import free_port
from tests.support.proxy import ThrottledProxy
from tests.support.s3 import TEST_KEY, TEST_REGION, TEST_SECRET, isolate_aws_environment

pytestmark = pytest.mark.s3


@pytest.mark.parametrize("server", ["s3", "seaweed"])
def test_persistent_writer_multipart_roundtrip(request: pytest.FixtureRequest, server: str) -> None:
    target = request.getfixturevalue(server)
    root = f"{target.uri}/run-{uuid.uuid4().hex[:8]}"
    cfg = CheckpointConfig(
        async_mode=AsyncMode.PERSISTENT,
        upload_chunk_bytes=5 << 20,
        upload_concurrency=4,
        storage_options=target.storage_options,
    )
    big = torch.randn(3 << 20)  # 12 MiB: a parallel multipart upload of 5 MiB parts
    with CheckpointManager(root, cfg, run_id="s3") as mgr:
        mgr.save(1, {"big": big, "n": 1})
        mgr.before_optimizer_step()
        big.mul_(2)
        mgr.save(2, {"big": big, "n": 2})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]
        first = mgr.restore(1)
        assert first is not None
        assert torch.equal(first.state["big"], big / 2)
        assert first.state["n"] == 1
    fs = target.filesystem()
    folder = f"{root.removeprefix('s3://')}/{step_dir(2)}"
    # S3's default spreading: the rank's objects in its sub-prefix, the manifest at the top.
    spread = DEFAULT_S3_SPREAD_PREFIXES
    assert sorted(p.removeprefix(f"{folder}/") for p in fs.find(folder)) == sorted(
        [shard_file_name(0, spread), index_file_name(0, spread), MANIFEST_NAME]
    )
    assert index_file_name(0, spread).startswith("00/")


class _Outage:
    """A dedicated moto server that a test can stop and restart on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server: Any = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def new_bucket(self) -> tuple[str, dict[str, Any]]:
        """A fresh bucket and the storage options to reach it (botocore's default retries)."""
        bucket = f"outage-{uuid.uuid4().hex[:8]}"
        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=TEST_REGION,
            aws_access_key_id=TEST_KEY,
            aws_secret_access_key=TEST_SECRET,
        ).create_bucket(Bucket=bucket)
        client = {"endpoint_url": self.endpoint, "region_name": TEST_REGION}
        return bucket, {"key": TEST_KEY, "secret": TEST_SECRET, "client_kwargs": client}


@pytest.fixture
def outage_server() -> Iterator[_Outage]:
    isolate_aws_environment()
    server = _Outage()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()


def _save_step_2_until_its_writer_stalls(mgr: CheckpointManager) -> None:
    """Commit step 1, start step 2 and return once its writer is in the `stall` fault (the
    partial object is there), so a test can stop the store before the real upload."""
    mgr.save(1, {"t": torch.full((1000,), 1.0)})
    mgr.wait_until_finished()
    mgr.save(2, {"t": torch.full((1000,), 2.0)})
    partial = f"{step_dir(2)}/{shard_file_name(0, DEFAULT_S3_SPREAD_PREFIXES)}.partial"
    deadline = time.monotonic() + 20
    while not mgr.storage.exists(partial):
        assert time.monotonic() < deadline, "the writer never started step 2"
        time.sleep(0.05)


def test_s3_server_stopped_mid_upload(
    outage_server: _Outage, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket, options = outage_server.new_bucket()
    options["config_kwargs"] = {
        "connect_timeout": 1,
        "read_timeout": 2,
        "retries": {"max_attempts": 1},
    }
    monkeypatch.setenv(FAULT_ENV, "stall=2@2")
    # The store stays down longer than the write budget: the writer waits the outage out
    # only within write_timeout_s, then the save fails. The budget also holds step 1's upload,
    # which a loaded machine stretched past 8 s (the suite on 6 workers under load average 20).
    cfg = CheckpointConfig(
        async_mode=AsyncMode.PERSISTENT,
        storage_options=options,
        finalize_timeout_s=30,
        write_timeout_s=15,
    )
    root = f"s3://{bucket}/ckpt"
    with CheckpointManager(root, cfg, run_id="outage") as mgr:
        _save_step_2_until_its_writer_stalls(mgr)
        outage_server.stop()  # the real upload starts after the stall, against a dead server
        with pytest.raises(
            SaveFailedError, match=r"step 2 failed: rank 0: writer (failed|did not finish)"
        ):
            mgr.wait_until_finished()
        outage_server.start()
        assert mgr.all_steps() == [1]
        assert not mgr.storage.exists(f"{step_dir(2)}/{MANIFEST_NAME}")
        result = mgr.restore()
        assert result is not None
        assert result.step == 1
        assert torch.equal(result.state["t"], torch.full((1000,), 1.0))
        mgr.save(3, {"t": torch.full((1000,), 3.0)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 3]


def test_an_outage_with_default_retry_settings_is_waited_out(
    outage_server: _Outage, monkeypatch: pytest.MonkeyPatch
) -> None:
    # [Note: a store outage is waited out, not failed]: botocore's default retries give up
    # within seconds; the writer keeps retrying within write_timeout_s, so a save in flight
    # when the store goes down for a while commits once it is back, and nothing is raised.
    bucket, options = outage_server.new_bucket()  # botocore's default retries and timeouts
    monkeypatch.setenv(FAULT_ENV, "stall=1@2")
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT, storage_options=options)
    root = f"s3://{bucket}/ckpt"
    outage_s = 12.0
    with CheckpointManager(root, cfg, run_id="outage-default") as mgr:
        _save_step_2_until_its_writer_stalls(mgr)
        outage_server.stop()  # the upload starts after the stall, against a dead server
        down_until = time.monotonic() + outage_s
        while time.monotonic() < down_until:
            mgr.maybe_finalize()  # the training loop goes on; nothing is raised
            assert mgr.stats().inflight == 1
            time.sleep(0.2)
        outage_server.start()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]
        result = mgr.restore(2)
        assert result is not None
        assert torch.equal(result.state["t"], torch.full((1000,), 2.0))


def test_retried_identical_manifest_put_answered_412_is_a_commit(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The conditional PUT landed, its reply was lost, the retry is answered 412.
    root = f"{s3.uri}/lost-reply-{uuid.uuid4().hex[:8]}"
    commit_with_lost_reply(root, dict(s3.storage_options), monkeypatch)


def _incomplete_uploads(target: Any, prefix: str) -> list[str]:
    """Keys of the incomplete multipart uploads under `prefix`, asked of the server directly."""
    client = boto3.client(
        "s3",
        endpoint_url=target.endpoint_url,
        region_name=TEST_REGION,
        aws_access_key_id=TEST_KEY,
        aws_secret_access_key=TEST_SECRET,
    )
    out = client.list_multipart_uploads(Bucket=target.bucket, Prefix=prefix)
    return [str(u["Key"]) for u in out.get("Uploads", [])]


def test_writer_sigkilled_mid_upload_leaves_no_incomplete_upload(s3: Any) -> None:
    # [Note: orphaned multipart uploads] in `_store/backends/multipart.py`. A slow link (4 MiB/s)
    # keeps the 24 MiB shard's upload in flight for seconds; the writer is killed from
    # outside once the server has its upload, and the failed save must abort it.
    prefix = f"killed-{uuid.uuid4().hex[:8]}"
    with ThrottledProxy(s3.endpoint_url, bytes_per_s=4 << 20) as proxy:
        options = dict(s3.storage_options)
        options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
        cfg = CheckpointConfig(
            async_mode=AsyncMode.PERSISTENT,
            upload_chunk_bytes=5 << 20,
            upload_concurrency=2,
            storage_options=options,
        )
        with CheckpointManager(f"{s3.uri}/{prefix}", cfg, run_id="killed") as mgr:
            mgr.save(1, {"t": torch.full((1000,), 1.0)})
            mgr.wait_until_finished()
            pid = mgr.writer_pid
            assert pid is not None
            mgr.save(2, {"big": torch.randn(6 << 20)})
            deadline = time.monotonic() + 30
            while not _incomplete_uploads(s3, f"{prefix}/{step_dir(2)}/"):
                assert time.monotonic() < deadline, "the writer never started uploading step 2"
                time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(SaveFailedError, match=f"writer process {pid} exited with code -9"):
                mgr.wait_until_finished()
            assert _incomplete_uploads(s3, f"{prefix}/") == []
            assert mgr.all_steps() == [1]
            mgr.save(3, {"t": torch.full((1000,), 3.0)})
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 3]


@pytest.mark.parametrize("server", ["s3", "seaweed"])
def test_startup_aborts_uploads_left_by_a_dead_run(
    request: pytest.FixtureRequest, server: str
) -> None:
    # A run killed whole (no finalizer left to clean up) leaves its writer's upload behind;
    # the next run's coordinator aborts it at start-up, before any writer of its own exists.
    target = request.getfixturevalue(server)
    prefix = f"dead-run-{uuid.uuid4().hex[:8]}"
    client = target.filesystem()
    key = f"{prefix}/{step_dir(7)}/{shard_file_name(0)}"
    from fsspec.asyn import sync

    mpu = sync(
        client.loop, client._call_s3, "create_multipart_upload", Bucket=target.bucket, Key=key
    )
    sync(
        client.loop,
        client._call_s3,
        "upload_part",
        Bucket=target.bucket,
        Key=key,
        UploadId=mpu["UploadId"],
        PartNumber=1,
        Body=b"x" * (5 << 20),
    )
    outside = f"{prefix}-other/{shard_file_name(0)}"  # not under the root: left alone
    other = sync(
        client.loop, client._call_s3, "create_multipart_upload", Bucket=target.bucket, Key=outside
    )
    assert _incomplete_uploads(target, f"{prefix}/") == [key]
    cfg = CheckpointConfig(async_mode=AsyncMode.PERSISTENT, storage_options=target.storage_options)
    with CheckpointManager(f"{target.uri}/{prefix}", cfg, run_id="next") as mgr:
        assert _incomplete_uploads(target, f"{prefix}/") == []
        assert mgr.all_steps() == []
    assert _incomplete_uploads(target, f"{prefix}-other/") == [outside]
    sync(
        client.loop,
        client._call_s3,
        "abort_multipart_upload",
        Bucket=target.bucket,
        Key=outside,
        UploadId=other["UploadId"],
    )
