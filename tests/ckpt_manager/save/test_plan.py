"""The shard-file plan is reused while the state keeps its keys, dtypes, shapes and
placements, and planned afresh on any change: a save after a shape change restores bitwise."""

from __future__ import annotations

import pathlib

import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager._format.tree import LeafKind, TensorLeaf, flatten
from ckpt_manager._save.plan import PlanCache, leaves_to_write


def _leaves(state: dict[str, object]) -> list[TensorLeaf]:
    return leaves_to_write(flatten(state), 0)


def test_the_plan_is_reused_until_a_key_dtype_shape_or_file_changes() -> None:
    cache = PlanCache()
    first = cache.plan(_leaves({"w": torch.zeros(4, 3), "b": torch.ones(3)}), "f")
    # New tensors with new values but the same signature: the same plan objects.
    again = cache.plan(_leaves({"w": torch.randn(4, 3), "b": torch.randn(3)}), "f")
    assert again is first
    assert cache.num_planned == 1
    changes = [
        ({"w": torch.zeros(3, 4), "b": torch.ones(3)}, "f"),  # shape (same numel)
        ({"w": torch.zeros(3, 4, dtype=torch.float64), "b": torch.ones(3)}, "f"),  # dtype
        ({"v": torch.zeros(3, 4, dtype=torch.float64), "b": torch.ones(3)}, "f"),  # key
        ({"v": torch.zeros(3, 4, dtype=torch.float64), "b": torch.ones(3)}, "g"),  # file
    ]
    for number, (state, name) in enumerate(changes, start=2):
        layout, records = cache.plan(_leaves(state), name)
        assert cache.num_planned == number
        by_key = {r.key: r for r in records}
        assert all(r.piece.file == name for r in records)
        assert [s.key for s in layout.slots] == [r.key for r in records]
    assert by_key["v"].dtype == "float64"
    assert by_key["v"].kind == str(LeafKind.REPLICATED)


def test_a_save_after_a_shape_change_restores_bitwise(tmp_path: pathlib.Path) -> None:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    gen = torch.Generator().manual_seed(0)
    before = {"w": torch.randn(10, generator=gen), "b": torch.randn(2, 3, generator=gen)}
    after = {
        "w": torch.randn(12, generator=gen),  # grown
        "b": torch.randn(3, 2, generator=gen).double(),  # reshaped, another dtype
    }
    with CheckpointManager(str(tmp_path), cfg) as mgr:
        mgr.save(1, before)
        mgr.save(2, after)
        for step, expected in ((1, before), (2, after)):
            restored = mgr.restore(step)
            assert restored is not None
            for key, tensor in expected.items():
                got = restored.state[key]
                assert got.dtype == tensor.dtype
                assert got.shape == tensor.shape
                assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))
