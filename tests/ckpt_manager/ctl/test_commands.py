"""Every `ckptctl` command on local disk and on S3 (moto), on a real 2-rank ZeRO-3 run.

Each test gets a private copy of the run's root (`_zero3_run.copy_root`), damaged the
same way: step 1's manifest truncated (corrupt), one byte of a step-3 shard flipped (corrupt
only when verified), and an uncommitted leftover folder for step 5.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from typing import Any, NamedTuple

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, KeepLast
from ckpt_manager._config import DEFAULT_S3_SPREAD_PREFIXES
from ckpt_manager._format.layout import MANIFEST_NAME, index_file_name, shard_file_name, step_dir
from ckpt_manager._store.lease import LEASE_NAME
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.cli import main
from tests.ckpt_manager.ctl._zero3_run import Run, copy_root, zero3_run
from tests.support.s3 import MotoS3

pytestmark = [pytest.mark.slow, pytest.mark.s3]


class Root(NamedTuple):
    uri: str
    global_args: list[str]
    storage: Storage
    run: Run
    spread: int
    """The run's sub-prefixes: S3's default spreading on the S3 copy, none on local disk."""


class Result(NamedTuple):
    rc: int
    out: str
    err: str


@pytest.fixture(params=["local", "s3"])
def root(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    moto_server: MotoS3,
    tmp_path: Any,
) -> Root:
    run = zero3_run(tmp_path_factory.getbasetemp(), moto_server)
    uri = copy_root(run, request.param, tmp_path)
    local = request.param == "local"
    options = {} if local else dict(run.bucket.storage_options)
    storage = Storage(uri, options)
    manifest = f"{step_dir(1)}/{MANIFEST_NAME}"
    storage.write(manifest, storage.read(manifest)[:100])
    spread = 0 if local else DEFAULT_S3_SPREAD_PREFIXES
    shard = f"{step_dir(3)}/{shard_file_name(1, spread)}"
    data = bytearray(storage.read(shard))
    data[-3] ^= 0xFF
    storage.write(shard, bytes(data))
    storage.write(f"{step_dir(5)}/{shard_file_name(0)}", b"partial")
    args = [] if local else ["--endpoint-url", run.bucket.endpoint_url]
    return Root(uri, args, storage, run, spread)


def ctl(root: Root, capsys: pytest.CaptureFixture[str], *argv: str) -> Result:
    capsys.readouterr()
    rc = main([argv[0], root.uri, *argv[1:], *root.global_args])
    captured = capsys.readouterr()
    return Result(rc, captured.out, captured.err)


def test_list_json_has_stable_keys_states_and_reasons(
    root: Root, capsys: pytest.CaptureFixture[str]
) -> None:
    res = ctl(
        root, capsys, "list", "--json", "--keep-last", "2", "--keep-best", "1", "--metric", "loss"
    )
    assert res.rc == 0, res.err
    rows = {r["step"]: r for r in json.loads(res.out)}
    assert {s: r["state"] for s, r in rows.items()} == {
        1: "corrupt",
        2: "committed",
        3: "committed",
        4: "committed",
    }
    for row in rows.values():
        assert list(row)[:7] == [
            "step",
            "state",
            "committed_at",
            "committed_unix_s",
            "age_s",
            "bytes",
            "num_files",
        ]
        assert {"world_size", "strategy", "metrics", "retained_by", "pinned", "error"} <= set(row)
    four = rows[4]
    assert four["world_size"] == 2
    assert four["strategy"] == "sharded-flat"
    assert four["metrics"]["tokens"] == 256
    stored = [shard_file_name(r, root.spread) for r in (0, 1)]
    stored += [index_file_name(r, root.spread) for r in (0, 1)]
    assert four["bytes"] == sum(root.storage.size(f"{step_dir(4)}/{n}") for n in stored)
    assert "latest" in four["retained_by"]
    assert "last-2" in four["retained_by"]
    assert rows[3]["retained_by"][:1] == ["last-2"]
    assert "invalid manifest" in rows[1]["error"]
    losses = {s: rows[s]["metrics"]["loss"] for s in (2, 3, 4)}
    best = min(losses, key=lambda s: (losses[s], -s))
    assert "best loss" in rows[best]["retained_by"]
    assert rows[2]["retained_by"] == (["best loss"] if best == 2 else [])


def test_list_table_all_uncommitted_and_lease_header(
    root: Root, capsys: pytest.CaptureFixture[str]
) -> None:
    lease = {
        "run_id": "run-42",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "acquired_unix_s": time.time() - 3600,
        "refreshed_unix_s": time.time(),
        "ttl_s": 120,
    }
    root.storage.write(LEASE_NAME, json.dumps(lease).encode())
    plain = ctl(root, capsys, "list")
    assert plain.rc == 0, plain.err
    assert plain.out.splitlines()[0].startswith(f"lease: run run-42 on host {socket.gethostname()}")
    assert "uncommitted" not in plain.out
    everything = ctl(root, capsys, "list", "--all", "--verify")
    lines = {int(line.split()[0]): line for line in everything.out.splitlines()[2:]}
    assert set(lines) == {1, 2, 3, 4, 5}
    assert lines[5].split()[1] == "uncommitted"
    assert lines[3].split()[1] == "corrupt"
    assert "checksum" in lines[3]
    assert lines[4].split()[1] == "committed"
    assert lines[4].rstrip().endswith("latest")


def test_show_human_and_json(root: Root, capsys: pytest.CaptureFixture[str]) -> None:
    res = ctl(root, capsys, "show", "latest")
    assert res.rc == 0, res.err
    assert res.out.startswith(f"step 4 of {root.uri}")
    assert "rank-00001.bin" in res.out
    assert "model/tok_emb.weight" in res.out
    assert "float32  64x16" in res.out
    assert "rank-local state: 2 ranks" in res.out
    doc = json.loads(ctl(root, capsys, "show", "2", "--json").out)
    assert doc["step"] == 2
    assert doc["manifest"]["world_size"] == 2
    assert doc["manifest"]["tensors"]["model/tok_emb.weight"]["global_shape"] == [64, 16]


def test_verify_lists_bad_files_and_exits_1(root: Root, capsys: pytest.CaptureFixture[str]) -> None:
    good = ctl(root, capsys, "verify")
    assert good.rc == 0, good.out
    assert good.out.startswith("step 4: ok (4 files")  # 2 shard files, 2 rank indexes
    bad = ctl(root, capsys, "verify", "3")
    assert bad.rc == 1
    assert "step 3: CORRUPT, 1 bad:" in bad.out
    name = shard_file_name(1, root.spread)
    assert f"{name}: file {name} checksum" in bad.out
    every = ctl(root, capsys, "verify", "--all", "--json")
    assert every.rc == 1
    status = {c["step"]: c["status"] for c in json.loads(every.out)}
    assert status == {1: "corrupt", 2: "ok", 3: "corrupt", 4: "ok", 5: "uncommitted"}


def test_verify_reports_a_manifest_whose_content_changed(
    root: Root, capsys: pytest.CaptureFixture[str]
) -> None:
    # Bit rot in a tensor's holder ranks: every file is intact, the manifest points elsewhere.
    manifest = f"{step_dir(2)}/{MANIFEST_NAME}"
    data = root.storage.read(manifest)
    match = re.search(rb'"ranks":\[\[0,(\d+)', data)
    assert match is not None
    at = match.end(1) - 1
    root.storage.write(manifest, data[:at] + b"3" + data[at + 1 :])
    bad = ctl(root, capsys, "verify", "2")  # a verdict on the step, not an error before it
    assert bad.rc == 1
    assert bad.err == ""
    assert bad.out.startswith("step 2: CORRUPT, 1 bad:")
    assert "manifest.json: invalid manifest of step 2: manifest checksum" in bad.out
    assert "does not match its content" in bad.out
    assert "outside world size 2" in bad.out  # what the field checks find, too
    every = ctl(root, capsys, "verify", "--all", "--json")
    assert every.rc == 1
    checks = {c["step"]: c for c in json.loads(every.out)}
    assert checks[2]["status"] == "corrupt"
    assert checks[2]["problems"][0].startswith("manifest.json: invalid manifest of step 2:")
    assert checks[4]["status"] == "ok"


def test_restore_refuses_a_damaged_step(
    root: Root, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    res = ctl(root, capsys, "restore", "3", "--to", str(tmp_path / "x.pt"))
    assert res.rc == 1
    assert len(res.err.strip().splitlines()) == 1
    assert "checksum" in res.err
    assert not (tmp_path / "x.pt").exists()


def test_errors_are_one_line_with_nearest_steps(
    root: Root, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = ctl(root, capsys, "show", "7")
    assert missing.rc == 1
    assert missing.err.strip().endswith("no committed step 7; nearest committed: 2, 3, 4")
    uncommitted = ctl(root, capsys, "show", "5")
    assert "its folder exists but it is not committed" in uncommitted.err
    corrupt = ctl(root, capsys, "show", "1")
    assert corrupt.rc == 1
    assert len(corrupt.err.strip().splitlines()) == 1
    assert "invalid manifest" in corrupt.err
    assert "Traceback" not in corrupt.err
    debug = ctl(root, capsys, "show", "1", "--debug")
    assert "Traceback" in debug.err


def test_prune_dry_run_then_apply_with_pin(root: Root, capsys: pytest.CaptureFixture[str]) -> None:
    dry = ctl(root, capsys, "prune", "--keep-last", "1", "--dry-run", "--json")
    assert dry.rc == 0, dry.err
    plan = json.loads(dry.out)
    assert plan["delete"] == [2, 3]
    assert {s["step"] for s in plan["skipped"]} == {1, 5}
    assert root.storage.exists(f"{step_dir(2)}/{MANIFEST_NAME}")
    assert ctl(root, capsys, "pin", "2").rc == 0
    done = ctl(root, capsys, "prune", "--keep-last", "1")
    assert done.rc == 0, done.err
    assert "deleting step 3" in done.out
    assert not root.storage.exists(step_dir(3))
    rows = {r["step"]: r for r in json.loads(ctl(root, capsys, "list", "--json", "--all").out)}
    assert set(rows) == {1, 2, 4, 5}  # corrupt and uncommitted steps are left alone
    assert rows[2]["retained_by"] == ["pinned"]
    assert rows[2]["pinned"] is True
    # Best-by-max of a metric that favours an old step still keeps the newest.
    kept = json.loads(
        ctl(
            root,
            capsys,
            "prune",
            "--keep-best",
            "1",
            "--metric",
            "tokens",
            "--mode",
            "min",
            "--dry-run",
            "--json",
        ).out
    )
    assert 4 not in kept["delete"]
    assert ctl(root, capsys, "unpin", "2").out.strip() == "unpinned step 2"


def test_pin_is_honoured_by_the_manager(root: Root, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl(root, capsys, "pin", "2").rc == 0
    assert ctl(root, capsys, "pin", "9").rc == 1  # not committed: nothing pinned
    config = CheckpointConfig(
        async_mode=AsyncMode.SYNC,
        retention=KeepLast(n=1),
        storage_options=root.storage.storage_options,
    )
    with CheckpointManager(root.uri, config, run_id="later") as mgr:
        mgr.save(6, {"x": torch.zeros(2)})
        mgr.wait_until_finished()  # the commit wakes the manager's retention
        assert mgr._deleter is not None
        assert mgr._deleter.flush(60)
    rows = {r["step"]: r["state"] for r in json.loads(ctl(root, capsys, "list", "--json").out)}
    assert rows == {1: "corrupt", 2: "committed", 6: "committed"}


def test_prune_refuses_a_root_held_by_a_live_run(
    root: Root, capsys: pytest.CaptureFixture[str]
) -> None:
    lease = {
        "run_id": "live",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "acquired_unix_s": time.time(),
        "refreshed_unix_s": time.time(),
        "ttl_s": 600,
    }
    root.storage.write(LEASE_NAME, json.dumps(lease).encode())
    res = ctl(root, capsys, "prune", "--keep-last", "1")
    assert res.rc == 1
    assert "held by live run live" in res.err
    assert root.storage.exists(f"{step_dir(2)}/{MANIFEST_NAME}")
