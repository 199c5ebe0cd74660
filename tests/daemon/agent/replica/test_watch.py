"""The sender wakes on a meta renamed into the tier's directory ([Note: the sender wakes on a
new meta] in `daemon/agent/replica/watch.py`), not on a poll."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.agent.replica import watch
from daemon.agent.replica.sender import ReplicaSender, Ring
from daemon.agent.replica.watch import NewFiles
from tests.daemon.agent.replica.test_replica import RUN, _Node, _snapshot, _wait

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's"),
]


@pytest.fixture
def new_files(tmp_path: Path) -> Iterator[NewFiles]:
    watcher = NewFiles(str(tmp_path))
    assert watcher.watching
    yield watcher
    watcher.close()


def test_a_rename_into_the_directory_ends_a_wait(tmp_path: Path, new_files: NewFiles) -> None:
    (tmp_path / "slot-0.json.tmp").write_text("{}")
    os.replace(tmp_path / "slot-0.json.tmp", tmp_path / "slot-0.json")
    new_files.wait(timeout_s=3600)  # returns: the rename is queued
    # Ignored while files are not watched, and still there for the next wait that does.
    os.replace(tmp_path / "slot-0.json", tmp_path / "slot-1.json")
    new_files.wake()
    new_files.wait(files=False, timeout_s=3600)
    new_files.wait(timeout_s=3600)


def test_wake_ends_a_wait_and_no_watch_means_polling(tmp_path: Path, new_files: NewFiles) -> None:
    new_files.wake()
    new_files.wait(timeout_s=3600)
    gone = NewFiles(str(tmp_path / "missing"))
    try:
        assert not gone.watching
        gone.wait()  # returns after `POLL_S`
    finally:
        gone.close()


def test_the_sender_streams_each_new_snapshot_without_a_timed_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the fallback look an hour away, only the renames of the rank's metas (and the
    # ring's wake) can make the sender send.
    monkeypatch.setattr(watch, "FALLBACK_S", 3600.0)
    a, b = _Node(tmp_path, "a"), _Node(tmp_path, "b")
    _snapshot(a.tier, [1])
    sender = ReplicaSender(str(a.tier), RUN, node=0, stats=a.stats)
    try:
        sender.set_ring(Ring(round=1, target=b.address, ranks=(0,)))
        _wait(lambda: [h.meta.step for h in b.holdings.held(0)] == [1], "step 1's replica")
        _snapshot(a.tier, [2])
        _wait(lambda: 2 in [h.meta.step for h in b.holdings.held(0)], "step 2's replica")
    finally:
        sender.close()
        for node in (a, b):
            node.server.close()
