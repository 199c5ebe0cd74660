"""The optimizer's sharded state dict: views of its state, equal to the concatenated form.

[Note: optimizer pieces are views] in `sharding/_optimizer.py`: a piece inside one optimizer
chunk is a view of the torch state tensor, and so is a piece spanning chunks once the bucket's
state lies in one storage ([Note: a bucket's optimizer state in one storage]: after the first
step and after a load). The pieces must equal what slicing the bucket's concatenated state
(`bucket_state`, the former path) gives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sharding import Strategy
from sharding._state_dict import piece_bounds, shard_of
from tests.sharding._ckpt_ranks import _step
from tests.sharding._helpers import Setup, make_model, param_groups, wrap
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow


def _pieces_and_reference(
    rank: int, world: int, strategies: list[Strategy], chunk_numel: int, reload: bool
) -> list[dict[str, Any]]:
    from sharding import _optimizer

    _optimizer.CHUNK_NUMEL = chunk_numel  # small: most parameters span several chunks
    out = []
    for strategy in strategies:
        setup = Setup(strategy=strategy, groups=True)
        model = wrap(make_model(setup), setup)
        opt = model.make_optimizer(
            torch.optim.AdamW, param_groups(model, setup), lr=1e-3, weight_decay=0.1
        )
        for step in range(2):
            _step(model, opt, step, rank, world)
        if reload:
            # A load replaces the torch state: its pieces must be views again at once.
            opt.load_sharded_state_dict(opt.sharded_state_dict())
        state = opt.sharded_state_dict()["state"]
        storages = {
            s[key].untyped_storage().data_ptr()
            for s in opt.optimizer.state.values()
            for key in ("exp_avg", "exp_avg_sq")
        }
        mismatched, views, copies, spanning = [], 0, 0, 0
        for pos, bucket in enumerate(opt.buckets):
            flat = opt.bucket_state(pos)
            assert flat is not None
            chunks = opt.bucket_chunks(pos)
            assert chunks is not None
            starts = {start for start, _, _ in chunks}
            # Chunks are in main-weight coordinates: a shard's start from the bucket's.
            sharded = bucket.main_weight.numel() != bucket.layout.padded_numel
            base = bucket.start if sharded else 0
            for slot in bucket.layout.slots:
                got = state[slot.names[0]]
                assert list(got) == list(flat)
                for key, value in flat.items():
                    if value.dim() == 0:
                        if not torch.equal(got[key], value):
                            mismatched.append((slot.names[0], key))
                        continue
                    want = shard_of(bucket, slot, value)
                    piece = got[key]
                    same = (
                        torch.equal(piece.local, want.local)
                        and piece.flat_range == want.flat_range
                        and piece.global_shape == want.global_shape
                        and piece.global_offset == want.global_offset
                    )
                    if not same:
                        mismatched.append((slot.names[0], key))
                    if piece.local.numel() == 0:
                        continue
                    lo, hi = piece_bounds(bucket, slot)
                    spanning += any(lo - base < start < hi - base for start in starts)
                    if piece.local.untyped_storage().data_ptr() in storages:
                        views += 1
                    else:
                        copies += 1
        out.append(
            {"mismatched": mismatched, "views": views, "copies": copies, "spanning": spanning}
        )
    return out


STRATEGIES = [Strategy.NO_SHARD, Strategy.OPTIM, Strategy.OPTIM_GRADS_PARAMS]


@pytest.mark.parametrize(("chunk_numel", "reload"), [(1 << 18, False), (100, False), (100, True)])
def test_optimizer_pieces_are_views_equal_to_the_concatenated_state(
    chunk_numel: int, reload: bool
) -> None:
    per_rank = run_on_ranks(
        _pieces_and_reference, 2, STRATEGIES, chunk_numel, reload, timeout_s=240
    )
    for rank, results in enumerate(per_rank):
        for strategy, result in zip(STRATEGIES, results, strict=True):
            where = (rank, strategy, chunk_numel, reload)
            assert result["mismatched"] == [], where
            assert result["views"] > 0, where
            # No piece is copied, whether it lies in one chunk or spans several.
            assert result["copies"] == 0, (where, result)
            if chunk_numel == 100:
                assert result["spanning"] > 0, (where, result)
