"""Shared by the single-process manager tests: a sample state, its snapshot, a mutation."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ckpt_manager import RankLocal
from tests.ckpt_manager.conftest import Shard


def wait_until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Poll `cond` every 20 ms until it holds; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def sample_state(seed: int) -> dict[str, Any]:
    """A state with every kind of leaf: tensors, a shard, optimizer state, rank-local, plain."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)},
        "shard": Shard(torch.randn(6, generator=g), (6,), (0,), (0, 6)),
        "opt": {"state": {0: {"step": 1, "exp_avg": torch.randn(5, generator=g)}}},
        "rng": RankLocal({"torch": torch.get_rng_state(), "pos": 3}),
        "meta": ("x", 1.5, None, True),
    }


def snapshot(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Copies of the tensors of `sample_state`, to compare a restore with."""
    return {
        "w": state["model"]["w"].clone(),
        "b": state["model"]["b"].clone(),
        "shard": state["shard"].local.clone(),
        "exp_avg": state["opt"]["state"][0]["exp_avg"].clone(),
    }


def mutate(state: dict[str, Any]) -> None:
    """Change every tensor of `sample_state` in place (so a restore must undo it)."""
    state["model"]["w"].mul_(1.5).add_(0.25)
    state["model"]["b"].neg_()
    state["shard"].local.add_(1)
    state["opt"]["state"][0]["exp_avg"].sub_(0.125)


def assert_restored(state: Any, want: dict[str, torch.Tensor]) -> None:
    """Assert that `state` holds exactly the snapshot `want` and the plain values."""
    assert torch.equal(state["model"]["w"], want["w"])
    assert torch.equal(state["model"]["b"], want["b"])
    assert torch.equal(state["shard"], want["shard"])
    assert torch.equal(state["opt"]["state"][0]["exp_avg"], want["exp_avg"])
    assert state["meta"] == ("x", 1.5, None, True)
    assert state["rng"]["pos"] == 3
