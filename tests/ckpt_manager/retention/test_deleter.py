"""Retention through the manager: policies, union, pins, in-flight saves, GC, retries."""

from __future__ import annotations

import os
import pathlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fsspec.asyn import sync

from ckpt_manager import (
    AnyOf,
    AsyncMode,
    CheckpointConfig,
    CheckpointManager,
    KeepBest,
    KeepEvery,
    KeepLast,
    RetentionPolicy,
)
from ckpt_manager._format.layout import MANIFEST_NAME, shard_file_name, step_dir
from ckpt_manager._retention.deleter import Deleter
from ckpt_manager._save.writer import FAULT_ENV
from ckpt_manager._store.pins import pin_step, pinned_steps, unpin_step
from ckpt_manager._store.storage import Storage
from ckpt_manager.errors import StorageError


def _eventually(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _config(policy: RetentionPolicy, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(async_mode=AsyncMode.SYNC, retention=policy, **kw)


def _save_all(root: pathlib.Path, cfg: CheckpointConfig, losses: dict[int, float]) -> list[int]:
    with CheckpointManager(str(root), cfg, run_id="r") as mgr:
        for step, loss in losses.items():
            mgr.save(step, {"t": torch.tensor([float(step)])}, metrics={"loss": loss})
        mgr.wait_until_finished()
        return mgr.all_steps()


def test_keep_last(tmp_path: pathlib.Path) -> None:
    assert _save_all(tmp_path, _config(KeepLast(n=2)), dict.fromkeys(range(1, 6), 1.0)) == [4, 5]


def test_union_of_every_and_last(tmp_path: pathlib.Path) -> None:
    policy = AnyOf(KeepEvery(every=3), KeepLast(n=1))
    assert _save_all(tmp_path, _config(policy), dict.fromkeys(range(1, 8), 1.0)) == [3, 6, 7]


def test_best_n_keeps_best_and_never_the_newest_worst(tmp_path: pathlib.Path) -> None:
    losses = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.8}
    assert _save_all(tmp_path, _config(KeepBest(metric="loss", n=1)), losses) == [2, 4]


def test_pinned_steps_survive(tmp_path: pathlib.Path) -> None:
    storage = Storage(str(tmp_path))
    pin_step(storage, 1)
    pin_step(storage, 2)
    unpin_step(storage, 2)
    assert pinned_steps(storage) == {1}
    assert _save_all(tmp_path, _config(KeepLast(n=1)), dict.fromkeys(range(1, 4), 1.0)) == [1, 3]


def test_restored_step_is_never_deleted(tmp_path: pathlib.Path) -> None:
    _save_all(tmp_path, _config(KeepLast(n=5)), {1: 1.0, 2: 1.0})
    with CheckpointManager(str(tmp_path), _config(KeepLast(n=1)), run_id="r2") as mgr:
        assert mgr.restore(1) is not None
        for step in (3, 4):
            mgr.save(step, {"t": torch.zeros(1)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 4]


def test_no_deletion_while_a_save_is_in_flight(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_ENV, "stall=3@3")
    # Timer passes every 0.1 s, so passes do run while step 3 is in flight: only the
    # deleter's own "a save is in flight" checks keep step 1 (commits alone would not
    # trigger a pass then, which once let this test pass without those checks).
    cfg = CheckpointConfig(
        async_mode=AsyncMode.PERSISTENT,
        max_inflight=2,
        retention=KeepLast(n=1),
        deletion_retry_s=0.1,
    )
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        mgr.save(1, {"t": torch.ones(8)})
        mgr.wait_until_finished()
        mgr.save(2, {"t": torch.ones(8)})
        mgr.save(3, {"t": torch.ones(8)})  # stalls in the writer
        assert mgr.stats().inflight == 2

        def committed_two() -> bool:
            mgr.maybe_finalize()
            return mgr.stats().last_committed_step == 2

        _eventually(committed_two)
        assert mgr.stats().inflight == 1
        time.sleep(0.5)
        assert (tmp_path / step_dir(1)).exists(), "deleted while step 3 was in flight"
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]


def test_leftovers_are_collected_unless_another_rank_may_be_writing_them(
    tmp_path: pathlib.Path,
) -> None:
    _save_all(tmp_path, _config(KeepLast(n=5)), {5: 1.0})

    def orphan(step: int) -> pathlib.Path:
        folder = tmp_path / step_dir(step)
        folder.mkdir()
        (folder / shard_file_name(0)).write_bytes(b"orphan")
        return folder

    # Left by dead attempts before this run opened the root, below and above the newest commit.
    below, above = orphan(1), orphan(9)
    cfg = _config(KeepLast(n=5), uncommitted_grace_s=600)
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        assert not below.exists()
        assert not above.exists()
        mgr.save(10, {"t": torch.zeros(1)})
        mgr.wait_until_finished()
        # Written after the root was opened: at or below this run's newest save, a dead
        # attempt's writer winding down; above it, maybe another rank of this run ahead of
        # the coordinator ([Note: whose leftover]).
        late, ahead = orphan(7), orphan(14)
        hour_ago = time.time() - 3600
        stale_ahead = orphan(15)
        os.utime(stale_ahead / shard_file_name(0), (hour_ago, hour_ago))
        os.utime(stale_ahead, (hour_ago, hour_ago))
        mgr.save(10 + 3, {"t": torch.ones(1)})
        mgr.wait_until_finished()
        _eventually(lambda: not late.exists() and not stale_ahead.exists())
        assert ahead.exists()
        assert mgr.all_steps() == [5, 10, 13]


def test_failed_deletion_is_logged_and_retried(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, log_events: list[dict[str, Any]]
) -> None:
    real = Storage.remove_tree
    failures = []

    def flaky(self: Storage, name: str) -> None:
        if not failures:
            failures.append(name)
            raise StorageError(5, "injected delete failure")
        real(self, name)

    monkeypatch.setattr(Storage, "remove_tree", flaky)
    cfg = _config(KeepLast(n=1), deletion_retry_s=0.2)
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        mgr.save(1, {"t": torch.zeros(1)})
        mgr.save(2, {"t": torch.zeros(1)})
        mgr.save(3, {"t": torch.zeros(1)})
        _eventually(lambda: mgr.all_steps() == [3] and not (tmp_path / step_dir(1)).exists())
    assert failures
    assert any(e["event"] == "ckpt_retention_failed" for e in log_events)


def test_gc_of_uncommitted_leftovers_keeps_a_folder_committed_meanwhile(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = Storage(str(tmp_path))
    folder = step_dir(4)
    st.write(f"{folder}/{shard_file_name(0)}", b"shard")

    def committed_while_aging(self: Storage, name: str) -> float | None:
        # Between the listing and the removal another launch commits step 4 (the folder's
        # age is what the listing saw: past the grace period).
        self.write(f"{folder}/{MANIFEST_NAME}", b'{"another": "commit"}', exclusive=True)
        return 0.0

    monkeypatch.setattr(Storage, "modified_unix_s", committed_while_aging)
    deleter = Deleter(st, None, saving=lambda: False, protected=set, grace_s=0.0, retry_s=3600.0)
    deleter.trigger()
    assert deleter.flush(20.0)
    deleter.close(20.0)
    assert st.read(f"{folder}/{MANIFEST_NAME}") == b'{"another": "commit"}'
    assert st.read(f"{folder}/{shard_file_name(0)}") == b"shard"


@pytest.mark.s3
def test_gc_aborts_incomplete_uploads_past_the_grace_period(seaweed: Any) -> None:
    # A writer killed mid-upload leaves an upload that no folder listing shows; the GC aborts
    # it once it is older than the grace period, never before ([Note: orphaned multipart
    # uploads] in `_store/backends/multipart.py`). SeaweedFS dates uploads (moto says 2010 for all).
    st = Storage(f"{seaweed.uri}/gc-uploads-{uuid.uuid4().hex[:8]}", seaweed.storage_options)
    bucket, root_key, _ = st.backend.fs.split_path(st.root)
    sync(
        st.backend.fs.loop,
        st.backend.fs._call_s3,
        "create_multipart_upload",
        Bucket=bucket,
        Key=f"{root_key}/{step_dir(3)}/{shard_file_name(0)}",
    )

    def num_uploads() -> int:
        out = sync(
            st.backend.fs.loop,
            st.backend.fs._call_s3,
            "list_multipart_uploads",
            Bucket=bucket,
            Prefix=f"{root_key}/",
        )
        return len(out.get("Uploads", []))

    for grace_s, left in ((3600.0, 1), (0.0, 0)):
        deleter = Deleter(
            st, None, saving=lambda: False, protected=set, grace_s=grace_s, retry_s=3600.0
        )
        deleter.trigger()
        assert deleter.flush(20.0)
        deleter.close(20.0)
        assert num_uploads() == left


def test_back_to_back_saves_do_not_starve_retention(tmp_path: pathlib.Path) -> None:
    # A save is always in flight (the memory tier's durable saves follow each other with no
    # gap): retention runs anyway once put off for max_defer_s, the leftover GC never does.
    assert _save_all(
        tmp_path, CheckpointConfig(async_mode=AsyncMode.SYNC), {1: 1.0, 2: 1.0, 3: 1.0}
    )
    leftover = tmp_path / step_dir(9)
    leftover.mkdir()
    (leftover / shard_file_name(0)).write_bytes(b"a save in flight")
    st = Storage(str(tmp_path))
    deleter = Deleter(
        st, KeepLast(n=1), saving=lambda: True, protected=set, grace_s=0.0, retry_s=0.05,
        max_defer_s=0.5,
    )  # fmt: skip
    started = time.monotonic()
    try:
        deleter.arm()
        _eventually(lambda: deleter.num_deleted == 2)
        assert time.monotonic() - started >= 0.5  # put off first
        assert [p.name for p in sorted(tmp_path.glob("step-*"))] == [step_dir(3), step_dir(9)]
    finally:
        deleter.close(5.0)


@pytest.mark.parametrize("pass_before_the_poll", [False, True], ids=["plain", "pass_before_poll"])
def test_retention_learns_this_runs_commits_without_reading_their_manifests(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, pass_before_the_poll: bool
) -> None:
    # [Note: retention learns a commit from the finalizer]: the policy sees what the
    # manifest holds (a tuple metric as a list), and no manifest of this run is parsed, even
    # by a retention pass that runs after a manifest is published and before the training
    # thread reads the commit (`pass_before_the_poll`: forced there; before, told only at
    # that read, such a pass read the manifest; a CI run hit it by chance).
    import ckpt_manager._retention.deleter as deleter_mod
    from ckpt_manager._save import finalize as finalize_mod
    from ckpt_manager._store.steps import read_manifest

    read: list[int] = []

    def counting(storage: Storage, step: int) -> Any:
        manifest = read_manifest(storage, step)
        read.append(step)  # parsed (a step still being saved has none to read yet)
        return manifest

    monkeypatch.setattr(deleter_mod, "read_manifest", counting)
    seen: list[dict[int, Any]] = []

    class Recording:
        def keep(self, steps: Any) -> set[int]:
            seen.append({s.step: (s.committed_unix_s, dict(s.metrics)) for s in steps})
            return {max(s.step for s in steps)}

    cfg = _config(Recording())
    with CheckpointManager(str(tmp_path), cfg, run_id="r") as mgr:
        if pass_before_the_poll:
            assert mgr._deleter is not None
            mgr._deleter._max_defer_s = 0.0  # a pass is not put off for the save in flight
            committed = finalize_mod.Finalizer._committed

            def after_a_pass(self: Any, request: Any, committed_unix_s: float) -> None:
                deleter = mgr._deleter
                assert deleter is not None
                deleter.trigger()
                assert deleter.flush(30)
                committed(self, request, committed_unix_s)

            monkeypatch.setattr(finalize_mod.Finalizer, "_committed", after_a_pass)
        for step in (1, 2, 3):
            mgr.save(step, {"t": torch.tensor([1.0])}, metrics={"loss": 0.5, "pair": (step, 1)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]
    assert read == []
    storage = Storage(str(tmp_path))
    manifest = read_manifest(storage, 3)
    assert seen[-1][3] == (manifest.committed_unix_s, dict(manifest.metrics))
    assert seen[-1][3][1] == {"loss": 0.5, "pair": [3, 1]}
