"""A rank SIGKILLed while the checkpoint storage is down resumes from the memory tier.

Issue 29 ("Tests and measurements"): the real `trainingd run` on 2 local ranks, memory tier on
(`memory_every 1`), durable root on moto's S3 server on 127.0.0.1. The ranks are held after a
known step, the S3 server is stopped, one rank is SIGKILLed: the restarted group must restore
from memory (nothing to read from storage, which is down), train on while the server is still
down, and finish once it is back (the last durable save commits).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.daemon._daemon_proc import CKPTCTL, GATED_JOB, DaemonProc, Gate, wait_for
from tests.support.dist import free_port
from tests.support.s3 import TEST_KEY, TEST_REGION, TEST_SECRET, isolate_aws_environment

pytestmark = [pytest.mark.slow, pytest.mark.s3, pytest.mark.timeout(120)]

_BATCH_SIZE = 4
_HELD_AFTER = 6
_MAX_STEPS = 12


class _StoppableS3:
    """moto's S3 server on a fixed loopback port that can be stopped and started again (its
    objects live in this process, so they outlast a stop)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server: object = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()  # type: ignore[attr-defined]
            self._server = None


@pytest.fixture
def stoppable_s3() -> Iterator[_StoppableS3]:
    isolate_aws_environment()
    server = _StoppableS3()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _committed_on_s3(endpoint: str, uri: str) -> list[int]:
    """Committed steps under `uri`, as `ckptctl list --json` reads them (server up)."""
    out = subprocess.run(
        [str(CKPTCTL), "list", uri, "--endpoint-url", endpoint, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(out.stdout)
    rows = rows.get("steps", rows) if isinstance(rows, dict) else rows
    return sorted(int(r["step"]) for r in rows if r.get("state", "committed") == "committed")


def test_rank_killed_with_storage_down_resumes_from_memory(
    tmp_path: Path, procs: list[DaemonProc], stoppable_s3: _StoppableS3
) -> None:
    bucket = "memory-tier"
    boto3.client(
        "s3",
        endpoint_url=stoppable_s3.endpoint,
        region_name=TEST_REGION,
        aws_access_key_id=TEST_KEY,
        aws_secret_access_key=TEST_SECRET,
    ).create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/run"
    args = [
        "--nproc-per-node", "2", "--batch-size", str(_BATCH_SIZE), "--warmup-steps", "2",
        *GATED_JOB, "--strategy", "no_shard", "--max-steps", str(_MAX_STEPS),
        "--ckpt-every", "4", "--memory-every", "1", "--publish-interval-s", "0.2",
        "--ckpt-uri", uri, "--s3-endpoint-url", stoppable_s3.endpoint,
    ]  # fmt: skip
    # Held after step 6: step 4 is committed on S3 by then (the server is up until here), and
    # step 6 is in the memory tier (its copy may still be finishing: 5 or 6 is restored).
    gate = Gate(tmp_path / "gate", after_steps=_HELD_AFTER, batch_size=_BATCH_SIZE)
    d = DaemonProc(tmp_path, args, gate.env)
    procs.append(d)
    gate.wait_until_held(2, d, timeout_s=90)
    stoppable_s3.stop()
    victim = wait_for(d.rank_pids, 30, "rank processes")[0]
    os.kill(victim, signal.SIGKILL)

    # The restarted group (not held) restores from memory with the storage down ...
    def restored_or_failed() -> list[dict[str, Any]]:
        failed = [e for e in d.find("rank_failed") if int(e.get("restart", 0)) >= 1]
        restored = d.find("restored")
        return failed or (restored if len(restored) == 2 else [])

    outcome = wait_for(restored_or_failed, 45, "the restarted ranks' restore")
    errors = [x.get("exc_value") for x in outcome[0].get("exception", [])]
    assert {e["event"] for e in outcome} == {"restored"}, f"{outcome[0]['event']}: {errors}"
    restored = outcome
    assert {e["source"] for e in restored} == {"memory"}, d.logs()
    assert {int(e["ckpt_step"]) for e in restored} <= {_HELD_AFTER - 1, _HELD_AFTER}, restored
    assert {int(e["restart"]) for e in restored} == {1}
    # ... and trains past the step-8 save while the server is still down.
    wait_for(lambda: d.max_value("trainingd_train_step") >= 9, 30, "training with S3 down")
    assert d.exit_code() is None, d.logs()

    stoppable_s3.start()
    assert d.wait(60) == 0, d.logs()
    assert _committed_on_s3(stoppable_s3.endpoint, uri)[-1] == _MAX_STEPS
