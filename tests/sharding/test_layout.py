"""Units, buckets, alignment and shards."""

from __future__ import annotations

import pytest
import torch

from daemon import GPT, Block, GPTConfig
from sharding._layout import build_layout, detect_unit_classes


def _gpt(tie: bool = True) -> GPT:
    return GPT(GPTConfig(d_model=32, num_heads=2, seq_len=16, num_layers=3, tie_embeddings=tie))


def test_repeated_block_class_is_detected() -> None:
    assert detect_unit_classes(_gpt()) == (Block,)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shards_tile_every_parameter_once(world: int, dtype: torch.dtype) -> None:
    model = _gpt(tie=False)
    units, buckets, modules = build_layout(
        model, (Block,), world_size=world, compute_dtype=dtype, bucket_size_bytes=10_000
    )
    assert [u.name for u in units] == ["blocks.0", "blocks.1", "blocks.2", ""]
    assert modules[-1] is None
    names = {n for b in buckets for s in b.slots for n in s.names}
    assert names == {n for n, _ in model.named_parameters()}
    align = 64 // torch.empty((), dtype=dtype).element_size()
    for bucket in buckets:
        assert bucket.padded_numel % (world * align) == 0
        starts = [bucket.shard_range(r) for r in range(world)]
        assert starts[0][0] == 0
        assert starts[-1][1] == bucket.padded_numel
        covered = sum(s.numel for s in bucket.slots) + sum(b - a for a, b in bucket.gaps())
        assert covered == bucket.padded_numel
        for slot in bucket.slots:
            assert slot.offset % align == 0
    # A unit is never split; the root (embeddings, final norm, head) is split by size.
    for unit in units[:-1]:
        assert len(unit.buckets) == 1
    assert len(units[-1].buckets) > 1


def test_tied_parameter_keeps_both_names() -> None:
    _, buckets, _ = build_layout(
        _gpt(tie=True),
        (Block,),
        world_size=2,
        compute_dtype=torch.float32,
        bucket_size_bytes=1 << 30,
    )
    names = [s.names for b in buckets for s in b.slots]
    assert ("tok_emb.weight", "head.weight") in names
