"""The run's retention policy recorded in the root, and `ckptctl list` reading it."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from ckpt_manager import (
    AnyOf,
    AsyncMode,
    CheckpointConfig,
    CheckpointManager,
    KeepBest,
    KeepEvery,
    KeepInterval,
    KeepLast,
    MetricMode,
    RetentionPolicy,
    StepInfo,
)
from ckpt_manager._retention.record import RETENTION_NAME, read_retention, record_retention
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.cli import main


class _Odd:
    """A custom policy the record cannot describe."""

    def keep(self, steps: Any) -> set[int]:
        return {s.step for s in steps if s.step % 2}


def test_record_roundtrips_builtin_policies(tmp_path: pathlib.Path) -> None:
    storage = Storage(str(tmp_path))
    policy = AnyOf(
        KeepLast(n=3),
        AnyOf(KeepEvery(every=1000), KeepInterval(interval_s=90.0)),
        KeepBest(metric="acc", n=2, mode=MetricMode.MAX),
    )
    record_retention(storage, "run-a", policy)
    labelled = read_retention(storage)
    assert labelled is not None
    assert [label for label, _ in labelled] == [
        "last-3",
        "every-1000",
        "interval-90s",
        "best-2 acc",
    ]
    assert [p for _, p in labelled] == [
        KeepLast(n=3),
        KeepEvery(every=1000),
        KeepInterval(interval_s=90.0),
        KeepBest(metric="acc", n=2, mode=MetricMode.MAX),
    ]
    assert json.loads(storage.read(RETENTION_NAME))["run_id"] == "run-a"
    record_retention(storage, "run-b", None)
    assert not storage.exists(RETENTION_NAME)
    assert read_retention(storage) is None


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"format": "other"}',
        b'{"format": "trainingd-retention", "format_version": 2, "policies": [], "custom": []}',
        b'{"format": "trainingd-retention", "format_version": 1, '
        b'"policies": [{"kind": "keep_last", "n": 0}], "custom": []}',
        b'{"format": "trainingd-retention", "format_version": 1, '
        b'"policies": [{"kind": "keep_all"}], "custom": []}',
    ],
)
def test_damaged_or_unknown_record_reads_as_none(tmp_path: pathlib.Path, body: bytes) -> None:
    storage = Storage(str(tmp_path))
    storage.write(RETENTION_NAME, body)
    assert read_retention(storage) is None


def test_custom_part_hides_policy_reasons(tmp_path: pathlib.Path) -> None:
    storage = Storage(str(tmp_path))
    odd: RetentionPolicy = _Odd()
    record_retention(storage, "run", AnyOf(KeepLast(n=1), odd))
    assert json.loads(storage.read(RETENTION_NAME))["custom"] == ["_Odd"]
    assert read_retention(storage) is None
    assert odd.keep([StepInfo(1, 0.0, {})]) == {1}


def _list_json(root: pathlib.Path, capsys: pytest.CaptureFixture[str], *flags: str) -> Any:
    capsys.readouterr()  # drop the manager's log lines
    assert main(["list", str(root), "--json", *flags]) == 0
    return {row["step"]: row["retained_by"] for row in json.loads(capsys.readouterr().out)}


def test_list_shows_the_recorded_policy_and_flags_override(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = AnyOf(KeepLast(n=2), KeepEvery(every=1000), KeepBest(metric="loss"))
    config = CheckpointConfig(async_mode=AsyncMode.SYNC, retention=policy)
    losses = {1000: 3.0, 1500: 0.5, 2500: 2.0, 3100: 1.5, 3200: 1.0}
    with CheckpointManager(str(tmp_path), config, run_id="recorded") as mgr:
        for step, loss in losses.items():
            mgr.save(step, {"w": torch.zeros(2)}, metrics={"loss": loss})
        mgr.wait_until_finished()
    rows = _list_json(tmp_path, capsys)
    # The manager's deleter may not have run yet: every step present gets its reasons.
    assert rows[3200] == ["latest", "last-2"]
    assert rows[3100] == ["last-2"]
    assert rows[1000] == ["every-1000"]
    if 1500 in rows:
        assert rows[1500] == ["best loss"]
    if 2500 in rows:
        assert rows[2500] == []
    overridden = _list_json(tmp_path, capsys, "--keep-last", "1")
    assert overridden[3200] == ["latest", "last-1"]
    assert overridden[1000] == []
