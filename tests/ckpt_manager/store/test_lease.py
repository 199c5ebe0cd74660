"""The lease on a checkpoint root: a live foreign run is refused, takeover, refresh."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import time
from typing import Any

import pytest

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, LeaseHeldError
from ckpt_manager._store.lease import LEASE_NAME
from tests.ckpt_manager._states import wait_until


def test_lease_refuses_live_foreign_run_and_allows_takeover(
    tmp_path: pathlib.Path, log_events: list[dict[str, Any]]
) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(tmp_path), cfg, run_id="first"):
        with pytest.raises(LeaseHeldError, match=r"run 'first' \(host .*pid"):
            CheckpointManager(str(tmp_path), cfg, run_id="second")
        # The same run restarting takes the lease over.
        CheckpointManager(str(tmp_path), cfg, run_id="first").close()
    assert not (tmp_path / LEASE_NAME).exists()
    # A dead holder on this host, and an expired holder elsewhere, are taken over.
    dead = subprocess.Popen(["true"])
    dead.wait()
    for holder in (
        {"host": socket.gethostname(), "pid": dead.pid, "refreshed_unix_s": time.time()},
        {"host": "elsewhere", "pid": 1, "refreshed_unix_s": time.time() - 1000},
    ):
        doc = {"run_id": "old", "acquired_unix_s": 0, "ttl_s": 60, **holder}
        (tmp_path / LEASE_NAME).write_text(json.dumps(doc))
        CheckpointManager(str(tmp_path), cfg, run_id="new").close()
    takeovers = [e for e in log_events if e["event"] == "ckpt_lease_taken_over"]
    assert len(takeovers) == 3


def test_lease_is_refreshed_while_the_run_lives(tmp_path: pathlib.Path) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, lease_ttl_s=1.0)
    with CheckpointManager(str(tmp_path), cfg, run_id="alive"):
        first = json.loads((tmp_path / LEASE_NAME).read_text())
        assert first["run_id"] == "alive"
        assert first["pid"] == os.getpid()

        def refreshed() -> bool:
            try:
                doc = json.loads((tmp_path / LEASE_NAME).read_text())
            except (OSError, ValueError):
                return False
            return bool(doc["refreshed_unix_s"] > first["refreshed_unix_s"])

        wait_until(refreshed, timeout_s=10)
        time.sleep(1.2)  # past one ttl: still live, because it keeps being refreshed
        with pytest.raises(LeaseHeldError, match="alive"):
            CheckpointManager(str(tmp_path), cfg, run_id="intruder")
