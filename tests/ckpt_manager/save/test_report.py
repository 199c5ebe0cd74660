"""A rank's contribution: the cached skeleton gives what `prepare_rank` gives, and is built
afresh whenever the layout changes ([Note: the report skeleton is reused while the layout is
unchanged]); the report survives its wire form."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager._format.manifest import Manifest
from ckpt_manager._format.tree import flatten
from ckpt_manager._save.commit import TopTensors, build_top_manifest
from ckpt_manager._save.plan import PlanCache, leaves_to_write
from ckpt_manager._save.report import (
    ReportCache,
    decode_report,
    encode_report,
    encode_report_body,
    prepare_rank,
    report_tensor_list,
)


class _Shard:
    """A flat shard of a 1-D tensor of `numel` elements split over `world` ranks."""

    def __init__(self, numel: int, rank: int, world: int) -> None:
        per = -(-numel // world)
        start, end = min(numel, rank * per), min(numel, (rank + 1) * per)
        self.local = torch.arange(start, end, dtype=torch.float32)
        self.global_shape = (numel,)
        self.global_offset = (0,)
        self.flat_range = (start, end)


def _prepare(
    cache: ReportCache, plans: PlanCache, state: Any, step: int, rank: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(cached, fresh) contributions of `state` at `step`."""
    flat = flatten(state)
    leaves = leaves_to_write(flat, rank)
    name = f"rank{rank}.bin"
    _, records = plans.plan(leaves, name)
    args: dict[str, Any] = {
        "step": step,
        "rank": rank,
        "flat": flat,
        "records": records,
        "file_name": name,
        "metrics": {"loss": float(step)},
    }
    return cache.prepare(**args), prepare_rank(**args)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_skeleton_is_reused_and_equals_a_fresh_build(rank: int) -> None:
    cache, plans = ReportCache(), PlanCache()
    for step in (1, 2, 300):
        state = {"w": torch.randn(4, 3), "s": _Shard(10, rank, 2), "step": step}
        cached, fresh = _prepare(cache, plans, state, step, rank)
        assert cached == fresh  # the index JSON byte for byte, the tree with this step's value
        assert json.loads(cached["index_json"])["step"] == step
    assert cache.num_built == 1


@pytest.mark.parametrize(
    "change",
    [
        {"w": torch.zeros(3, 4), "s": _Shard(10, 0, 2)},  # a shape (same numel)
        {"w": torch.zeros(4, 3, dtype=torch.float64), "s": _Shard(10, 0, 2)},  # a dtype
        {"v": torch.zeros(4, 3), "s": _Shard(10, 0, 2)},  # a key
        {"w": torch.zeros(4, 3), "s": _Shard(10, 0, 4)},  # resharded: another flat range
        {"w": torch.zeros(4, 3), "s": _Shard(12, 0, 2)},  # another global shape
    ],
)
def test_a_layout_change_builds_the_skeleton_afresh(change: dict[str, Any]) -> None:
    cache, plans = ReportCache(), PlanCache()
    _prepare(cache, plans, {"w": torch.zeros(4, 3), "s": _Shard(10, 0, 2)}, 1)
    cached, fresh = _prepare(cache, plans, change, 2)
    assert cached == fresh
    assert cache.num_built == 2


def test_the_report_body_is_reused_only_for_the_same_tensor_list() -> None:
    cache, plans = ReportCache(), PlanCache()
    bodies = []
    for step in (1, 2):
        cached, _ = _prepare(cache, plans, {"w": torch.zeros(2), "step": step}, step)
        bodies.append(encode_report_body(cached))
        report = decode_report(encode_report(cached, bodies[-1]))
        assert report.tree == cached["tree"]  # this save's tree (its step value), not the first's
        assert report.metrics == {"loss": float(step)}
        assert report.tensors == cached["tensors"]
    other, _ = _prepare(cache, plans, {"w": torch.zeros(3), "step": 3}, 3)
    assert other["tensors"] != cached["tensors"]
    assert (
        decode_report(encode_report(other, encode_report_body(other))).tensors == other["tensors"]
    )


def test_a_manager_saving_a_changed_layout_restores_it(tmp_path: pathlib.Path) -> None:
    # The skeleton cache sits in the manager: a save after a layout change must describe the
    # new layout (a stale index would place the pieces wrongly, and restore would fail).
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    states = [
        {"a": torch.arange(6.0), "b": torch.ones(2, 2), "step": 1},
        {"a": torch.arange(6.0) + 1, "b": torch.ones(2, 2) * 2, "step": 2},  # same layout
        {"a": torch.arange(8.0), "b": torch.ones(2, 2).double(), "step": 3},  # changed
    ]
    with CheckpointManager(str(tmp_path), cfg) as mgr:
        for step, state in enumerate(states, start=1):
            mgr.save(step, state)
        for step, state in enumerate(states, start=1):
            restored = mgr.restore(step)
            assert restored is not None
            assert restored.state["step"] == step
            for key in ("a", "b"):
                assert torch.equal(restored.state[key], state[key]), (step, key)


def _framed(contribution: dict[str, Any]) -> bytes:
    return encode_report(contribution, encode_report_body(contribution))


def test_the_top_manifests_records_are_reused_only_for_the_same_tensor_lists() -> None:
    # [Note: the top manifest's tensor records are reused]: equal pickled lists from every
    # rank give the records merged last time, encoded to the same manifest bytes.
    caches, plans = [ReportCache(), ReportCache()], [PlanCache(), PlanCache()]

    def payloads(state_of: Any, step: int) -> list[bytes]:
        return [
            _framed(_prepare(caches[r], plans[r], state_of(r), step, rank=r)[0]) for r in (0, 1)
        ]

    top = TopTensors()

    def manifest(framed: list[bytes], step: int) -> tuple[Manifest, Manifest]:
        lists = [report_tensor_list(p) for p in framed]
        cached = top.cached(lists)
        full = [decode_report(p) for p in framed]
        if cached is None:
            cached = top.merge(lists, full)
        args: dict[str, Any] = {
            "step": step,
            "run_id": "r",
            "created_unix_s": 1.0,
            "committed_unix_s": 2.0,
        }
        lean = [decode_report(p, tensors=False) for p in framed]
        return (
            build_top_manifest(reports=lean, tensors=cached, **args),
            build_top_manifest(reports=full, **args),
        )

    def state(numel: int) -> Any:
        return lambda r: {"w": torch.zeros(3), "s": _Shard(numel, r, 2), "step": 0}

    for step, numel in ((1, 10), (2, 10), (3, 12)):  # the same layout twice, then another
        reused, fresh = manifest(payloads(state(numel), step), step)
        assert reused.to_json() == fresh.to_json()
        assert dict(reused.tensors) == fresh.tensors
        assert reused.tensors["s"]["global_shape"] == [numel]
    assert top.num_merged == 2
