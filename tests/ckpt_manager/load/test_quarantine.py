"""A corrupt newest step never blocks the run: it is quarantined and its step saved again.

Faults from outside, on 2 real gloo ranks: a run saves steps 2, 4, 6; the newest step is
damaged (a byte flipped in a shard, a rank index deleted, the manifest truncated); the run
restarts and must restore step 4, move step 6 aside under `_quarantine/` with a record of
why, save step 6 again and go on to step 8, ending bitwise where an uninterrupted run ends.
`ckptctl list` then shows the quarantine and `ckptctl prune --corrupt` removes it. One case
restarts on another world size (the reshard path), one on S3 (moto).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager._config import DEFAULT_S3_SPREAD_PREFIXES
from ckpt_manager._format.layout import MANIFEST_NAME, index_file_name, shard_file_name, step_dir
from ckpt_manager._store.quarantine import QUARANTINE_DIR, RECORD_NAME
from ckpt_manager._store.root_catalog import read_catalog
from ckpt_manager._store.steps import committed_steps, read_manifest, verify_files
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.cli import main
from tests.ckpt_manager.conftest import Shard
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow

NUMEL = 40
SAVE_EVERY = 2


def _initial() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, NUMEL, dtype=torch.float32)


def _train_step(w: torch.Tensor, step: int) -> None:
    """One deterministic update (elementwise, so any sharding gives the same bits)."""
    w.mul_(0.75).add_(torch.sin(torch.arange(w.numel(), dtype=torch.float32) + step))


def _reference(num_steps: int) -> torch.Tensor:
    w = _initial()
    for step in range(1, num_steps + 1):
        _train_step(w, step)
    return w


def _state(rank: int, world: int, full: torch.Tensor, step: int) -> dict[str, Any]:
    per = -(-NUMEL // world)
    lo, hi = min(NUMEL, rank * per), min(NUMEL, (rank + 1) * per)
    return {"w": Shard(full[lo:hi].clone(), (NUMEL,), (0,), (lo, hi)), "step": step}


def _run(
    rank: int, world: int, uri: str, options: dict[str, Any], max_steps: int
) -> tuple[int | None, torch.Tensor]:
    """Restore the newest step that verifies (if any), train to `max_steps` saving every
    `SAVE_EVERY` steps; returns the restored step and the full final weights."""
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, storage_options=options)
    full, start = _initial(), 0
    with CheckpointManager(uri, cfg, run_id="quarantine-test") as mgr:
        template = _state(rank, world, full, 0)
        restored = mgr.restore(into=template)
        if restored is not None:
            start = restored.state["step"]
            # Every rank rebuilds the whole tensor from the template's resharded local part.
            parts: list[Any] = [None] * world
            torch.distributed.all_gather_object(parts, template["w"].local)
            full = torch.cat(parts)
        for step in range(start + 1, max_steps + 1):
            _train_step(full, step)
            if step % SAVE_EVERY == 0:
                mgr.save(step, _state(rank, world, full, step))
                mgr.maybe_finalize()
        mgr.wait_until_finished()
    return (restored.step if restored is not None else None), full


def _damage(storage: Storage, kind: str, step: int, spread: int) -> None:
    folder = step_dir(step)
    if kind == "flip":
        name = f"{folder}/{shard_file_name(0, spread)}"
        data = bytearray(storage.read(name))
        data[len(data) // 2] ^= 0xFF
        storage.write(name, bytes(data))
    elif kind == "index":
        storage.remove(f"{folder}/{index_file_name(1, spread)}")
    elif kind == "manifest":
        name = f"{folder}/{MANIFEST_NAME}"
        storage.write(name, storage.read(name)[:100])
    else:
        raise AssertionError(kind)


def _ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _check_restart(
    uri: str,
    options: dict[str, Any],
    kind: str,
    restart_world: int,
    ctl_args: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    storage = Storage(uri, options)
    spread = DEFAULT_S3_SPREAD_PREFIXES if options else 0
    run_on_ranks(_run, 2, uri, options, 6)
    assert committed_steps(storage) == [2, 4, 6]
    _damage(storage, kind, 6, spread)
    # Before the restart `verify` ends with a verdict on the damaged step, never a read error.
    rc, out, err = _ctl(capsys, "verify", uri, *ctl_args)
    assert rc == 1, err
    assert err == ""
    if kind == "index":
        assert out.splitlines() == [
            "step 6: CORRUPT, 1 bad:",
            f"  missing {index_file_name(1, spread)}",
        ]

    results = run_on_ranks(_run, restart_world, uri, options, 8)

    for restored, final in results:
        assert restored == 4
        assert torch.equal(final, _reference(8))  # bitwise: as if never interrupted
    assert committed_steps(storage) == [2, 4, 6, 8]
    resaved = read_manifest(storage, 6)
    verify_files(storage, resaved, sorted(resaved.files), check_crc=True)
    assert resaved.world_size == restart_world
    (name,) = storage.list_names(QUARANTINE_DIR)
    assert name.startswith(f"{step_dir(6)}-")
    record = json.loads(storage.read(f"{QUARANTINE_DIR}/{name}/{RECORD_NAME}"))
    assert record["step"] == 6
    assert record["run_id"] == "quarantine-test"
    expected_object = {
        "flip": shard_file_name(0, spread),
        "index": index_file_name(1, spread),
        "manifest": MANIFEST_NAME,
    }[kind]
    assert record["object"] == expected_object, record
    # The evidence is kept as found: the damaged objects sit in the quarantine folder.
    kept = storage.list_names(f"{QUARANTINE_DIR}/{name}")
    assert MANIFEST_NAME in kept
    assert RECORD_NAME in kept
    assert [q.step for q in read_catalog(storage).quarantined.values()] == [6]
    assert 6 in read_catalog(storage).entries  # the re-saved step, committed

    rc, out, err = _ctl(capsys, "list", uri, "--json", *ctl_args)
    assert rc == 0, err
    rows = json.loads(out)
    states = [(r["step"], r["state"]) for r in rows]
    assert states == [
        (2, "committed"),
        (4, "committed"),
        (6, "quarantined"),
        (6, "committed"),
        (8, "committed"),
    ]
    quarantined = next(r for r in rows if r["state"] == "quarantined")
    assert quarantined["location"] == f"{QUARANTINE_DIR}/{name}"
    assert expected_object in quarantined["error"]
    assert quarantined["retained_by"] == []
    assert "latest" in rows[-1]["retained_by"]

    rc, out, err = _ctl(capsys, "prune", uri, "--corrupt", "--dry-run", *ctl_args)
    assert rc == 0, err
    assert f"would delete quarantined step 6 ({QUARANTINE_DIR}/{name})" in out
    assert storage.list_names(QUARANTINE_DIR) == [name]
    rc, out, err = _ctl(capsys, "prune", uri, "--corrupt", *ctl_args)
    assert rc == 0, err
    assert storage.list_names(QUARANTINE_DIR) == []
    assert read_catalog(storage).quarantined == {}
    assert committed_steps(storage) == [2, 4, 6, 8]


@pytest.mark.parametrize(
    ("kind", "restart_world"),
    [("flip", 2), ("index", 2), ("manifest", 2), ("flip", 1)],
    ids=["shard-byte-flipped", "index-deleted", "manifest-truncated", "other-world-size"],
)
def test_corrupt_newest_step_is_quarantined_and_saved_again(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], kind: str, restart_world: int
) -> None:
    _check_restart(str(tmp_path / "ckpt"), {}, kind, restart_world, [], capsys)


@pytest.mark.s3
def test_corrupt_newest_step_is_quarantined_on_s3(
    s3: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = f"{s3.uri}/quarantine"
    args = ["--endpoint-url", s3.endpoint_url]
    _check_restart(uri, dict(s3.storage_options), "index", 2, args, capsys)
