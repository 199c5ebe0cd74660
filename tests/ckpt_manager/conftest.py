"""Fixtures for the checkpoint manager tests: storage backends, a sharded-tensor stand-in."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
import torch

from ckpt_manager._types import SaveReport

# Each `backend_root` fixture and the registered backend (`_store/backends/`) it runs the
# storage contract suite over; every registered backend needs at least one (a test checks).
BACKEND_OF_FIXTURE = {"local": "local", "memory": "fsspec", "moto": "s3", "seaweed": "s3"}
BACKENDS = list(BACKEND_OF_FIXTURE)


@dataclasses.dataclass(frozen=True)
class Shard:
    """A ShardedTensorLike, like `sharding.ShardedTensor` (which these tests must not import)."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    flat_range: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Root:
    """A checkpoint root on some backend."""

    uri: str
    storage_options: dict[str, Any]
    fixture: str = ""
    """The `backend_root` parameter that made it (`local`, `memory`, `moto`, `seaweed`)."""


class Reports:
    """A SaveObserver that keeps every report."""

    def __init__(self) -> None:
        self.reports: list[SaveReport] = []
        self._lock = threading.Lock()

    def on_save_finished(self, report: SaveReport) -> None:
        with self._lock:
            self.reports.append(report)


@pytest.fixture(params=BACKENDS)
def backend_root(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Root]:
    """The same root contract on local disk, memory://, moto S3 and SeaweedFS."""
    name = request.param
    if name == "local":
        yield Root(str(tmp_path / "ckpt"), {}, name)
    elif name == "memory":
        uri = f"memory://ckpt-{uuid.uuid4().hex}"
        yield Root(uri, {}, name)
        import fsspec

        with contextlib.suppress(FileNotFoundError):
            fsspec.filesystem("memory").rm(uri.removeprefix("memory://"), recursive=True)
    elif name == "moto":
        target = request.getfixturevalue("s3")
        yield Root(f"{target.uri}/ckpt", dict(target.storage_options), name)
    else:
        target = request.getfixturevalue("seaweed")
        yield Root(f"{target.uri}/ckpt-{uuid.uuid4().hex[:8]}", dict(target.storage_options), name)


@pytest.fixture
def log_events() -> Iterator[list[dict[str, Any]]]:
    """Structlog events emitted during the test."""
    with structlog.testing.capture_logs() as events:
        yield events
