"""Pins against concurrent deletion: a pin `ckptctl pin` confirmed always keeps its step.

The other party (the pinning operator, or retention) is made to act at the exact moment of a
storage call, through a `Storage` whose calls run a hook first: the interleavings that
production produces by chance, made every time.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, StepNotFoundError
from ckpt_manager._format.layout import MANIFEST_NAME, step_dir
from ckpt_manager._store.pins import pinned_steps
from ckpt_manager._store.steps import committed_steps, delete_step, read_manifest
from ckpt_manager._store.storage import Storage
from ckpt_manager.ctl.prune import pin


class _Interleaved(Storage):
    """A real Storage that first runs `hook` once, when `call(name)` matches."""

    def __init__(self, uri: str, call: str, name: str, hook: Callable[[], Any]) -> None:
        super().__init__(uri)
        self._call, self._name, self._hook = call, name, hook

    def _maybe(self, call: str, name: str) -> None:
        if (call, name) == (self._call, self._name):
            self._call = ""  # once
            self._hook()

    def remove(self, name: str) -> None:
        self._maybe("remove", name)
        super().remove(name)

    def write(self, name: str, data: bytes | bytearray | memoryview, **kw: Any) -> None:
        self._maybe("write", name)
        super().write(name, data, **kw)


def _root(root: pathlib.Path) -> str:
    with CheckpointManager(str(root), CheckpointConfig(async_mode=AsyncMode.SYNC)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    return str(root)


def test_a_pin_confirmed_while_retention_deletes_keeps_the_step(tmp_path: pathlib.Path) -> None:
    uri = _root(tmp_path)
    said: list[str] = []
    # The operator pins step 2 just as retention (having found no pin) removes its manifest.
    deleting = _Interleaved(
        uri, "remove", f"{step_dir(2)}/{MANIFEST_NAME}", lambda: said.extend(pin(Storage(uri), [2]))
    )
    deleted = delete_step(deleting, 2)
    assert said == ["pinned step 2"]
    assert not deleted
    assert committed_steps(Storage(uri)) == [1, 2, 3]
    assert read_manifest(Storage(uri), 2).step == 2
    assert pinned_steps(Storage(uri)) == {2}


def test_pinning_a_step_that_retention_just_deleted_fails_and_leaves_no_pin(
    tmp_path: pathlib.Path,
) -> None:
    uri = _root(tmp_path)
    # Retention deletes step 2 after `pin` checked it was committed, before its pin lands.
    pinning = _Interleaved(
        uri, "write", f"_pins/{step_dir(2)}", lambda: delete_step(Storage(uri), 2)
    )
    with pytest.raises(StepNotFoundError, match="step 2 is not committed"):
        pin(pinning, [2])
    assert committed_steps(Storage(uri)) == [1, 3]
    assert pinned_steps(Storage(uri)) == set()


def test_a_pinned_step_is_never_deleted_and_an_unpinned_one_is(tmp_path: pathlib.Path) -> None:
    uri = _root(tmp_path)
    storage = Storage(uri)
    pin(storage, [1])
    assert not delete_step(storage, 1)
    assert delete_step(storage, 3)
    assert committed_steps(storage) == [1, 2]
