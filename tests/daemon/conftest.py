"""Fixtures shared by the daemon's end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.daemon._daemon_proc import DaemonProc


@pytest.fixture
def procs() -> Iterator[list[DaemonProc]]:
    """Daemons a test started (append them); whatever is left of them is killed after."""
    started: list[DaemonProc] = []
    yield started
    for d in started:
        d.cleanup()
