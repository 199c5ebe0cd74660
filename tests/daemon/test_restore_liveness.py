"""A long restore stays live while it reads; a restore stuck on storage fails `/healthz`.

A real daemon restores a real checkpoint from `slowfile://` (`tests/support/slow_fs.py`): a local
root whose checkpoint reads sleep, or wait while a pause file exists. The heartbeat timeout is
three seconds, so a restore of several times that would fail liveness if ranks beat only on
phase changes (they beat on every read: [Note: ranks beat while restoring] in
`daemon/rank/loop.py`).

`/healthz` names the node phase only (`loading` covers the model build as well as the restore),
so the test reads which phase the rank itself is in from its snapshot file, and judges
`/healthz` over the restore alone: the build makes no reads and is not what is tested here.
Both cases are two phases of one restore (one daemon start): first stuck, then slow.
"""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime
from pathlib import Path

import pytest

from daemon.rundir.snapshot import read_snapshot, snapshot_path
from tests.daemon._daemon_proc import DaemonProc, wait_for
from tests.support import slow_fs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

_HEARTBEAT_TIMEOUT_S = 3.0
_SETTLE_S = 1.0
"""Polls this soon after the reads resume are not judged: the supervisor may still hold its
previous snapshot (it reads every 0.25 s), with a heartbeat as old as the pause."""
_SEED_STEPS = 2
_ARGS = [
    "--nproc-per-node", "1", "--threads-per-rank", "1", "--batch-size", "4",
    "--warmup-steps", "1", "--async-mode", "sync", "--run-id", "restore-liveness",
    "--job", "tests.daemon._slow_fs_job:build", "--publish-interval-s", "0.2",
    "--heartbeat-timeout-s", str(_HEARTBEAT_TIMEOUT_S),
]  # fmt: skip


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint root holding a committed step `_SEED_STEPS` of the default job."""
    workdir = tmp_path_factory.mktemp("seed")
    root = workdir / "ckpt"
    d = DaemonProc(workdir, [*_ARGS, "--max-steps", str(_SEED_STEPS), "--ckpt-uri", _uri(root)])
    try:
        assert d.wait(180) == 0, d.logs()
    finally:
        d.cleanup()
    return root


def _uri(root: Path) -> str:
    return f"{slow_fs.PROTOCOL}://{root}"


def _resume(tmp_path: Path, seeded: Path, env: dict[str, str]) -> DaemonProc:
    root = tmp_path / "ckpt"
    shutil.copytree(seeded, root)
    args = [*_ARGS, "--max-steps", str(_SEED_STEPS + 1), "--ckpt-uri", _uri(root)]
    return DaemonProc(tmp_path, [*args, "--run-dir", str(tmp_path / "run")], env)


def _rank_phase(tmp_path: Path) -> str:
    snapshot = read_snapshot(snapshot_path(tmp_path / "run", 0))
    return "" if snapshot is None else str(snapshot["phase"])


def _health(d: DaemonProc) -> tuple[int, str]:
    try:
        code, body = d.get("/healthz")
    except OSError:
        return 0, ""
    return code, str(json.loads(body).get("state", "")) if body.startswith("{") else ""


def _unix_s(event: dict[str, object]) -> float:
    """A log event's timestamp (ISO 8601, UTC) as Unix seconds."""
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def test_a_restore_stuck_on_storage_fails_healthz_and_a_long_one_stays_healthy_while_it_reads(
    tmp_path: Path, seeded: Path, procs: list[DaemonProc]
) -> None:
    # One daemon, two phases of one restore: its reads first hang on the pause file (stuck on
    # storage), then, resumed, take 80 ms each: ~150 pieces and a checksum pass, several
    # heartbeat timeouts of reading.
    pause = tmp_path / "pause"
    pause.touch()
    env = {slow_fs.PAUSE_FILE_ENV: str(pause), slow_fs.READ_DELAY_ENV: "0.08"}
    d = _resume(tmp_path, seeded, env)
    procs.append(d)
    # The rank's own phase says the hang is in the restore, not in the build.
    wait_for(
        lambda: _health(d) == (503, "loading") and _rank_phase(tmp_path) == "restoring",
        120,
        "/healthz 503 while the read hangs",
    )
    assert not d.find("restored")

    pause.unlink()
    resumed = time.monotonic()
    resumed_unix_s = time.time()
    judged: list[int] = []
    deadline = resumed + 180
    while not d.find("restored") and time.monotonic() < deadline and d.exit_code() is None:
        before = _rank_phase(tmp_path)
        code, _ = _health(d)
        # Polls right after the reads resumed are not judged: the last heartbeat is as old as
        # the pause until the first resumed read beats and the supervisor reads it.
        if before == _rank_phase(tmp_path) == "restoring" and (
            time.monotonic() - resumed > _SETTLE_S
        ):
            judged.append(code)
        time.sleep(0.1)
    (restored,) = d.find("restored")
    # The guard that makes this test mean something: reading after the pause outlasted the
    # timeout.
    assert _unix_s(restored) - resumed_unix_s > 2 * _HEARTBEAT_TIMEOUT_S, restored
    assert len(judged) > 10, judged
    assert set(judged) == {200}, judged
    assert d.wait(120) == 0, d.logs()
