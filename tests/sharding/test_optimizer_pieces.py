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


def _model_and_optimizer(strategy: Strategy, chunk_numel: int) -> tuple[Any, Any]:
    """The test GPT wrapped under `strategy` with its AdamW (two parameter groups), the
    optimizer's chunks `chunk_numel` elements long (small: most parameters span several)."""
    from sharding import _optimizer

    _optimizer.CHUNK_NUMEL = chunk_numel
    setup = Setup(strategy=strategy, groups=True)
    model = wrap(make_model(setup), setup)
    opt = model.make_optimizer(
        torch.optim.AdamW, param_groups(model, setup), lr=1e-3, weight_decay=0.1
    )
    return model, opt


def _pieces_and_reference(
    rank: int, world: int, strategies: list[Strategy], chunk_numel: int, replace: str
) -> list[dict[str, Any]]:
    out = []
    for strategy in strategies:
        model, opt = _model_and_optimizer(strategy, chunk_numel)
        for step in range(2):
            _step(model, opt, step, rank, world)
        if replace == "load":
            # A load replaces the torch state: its pieces must be views again at once.
            opt.load_sharded_state_dict(opt.sharded_state_dict())
        elif replace == "clear":
            # torch makes new state at the next step: moved into one storage again.
            opt.optimizer.state.clear()
            _step(model, opt, 2, rank, world)
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


@pytest.mark.parametrize(
    ("chunk_numel", "replace"), [(1 << 18, ""), (100, ""), (100, "load"), (100, "clear")]
)
def test_optimizer_pieces_are_views_equal_to_the_concatenated_state(
    chunk_numel: int, replace: str
) -> None:
    per_rank = run_on_ranks(
        _pieces_and_reference, 2, STRATEGIES, chunk_numel, replace, timeout_s=240
    )
    for rank, results in enumerate(per_rank):
        for strategy, result in zip(STRATEGIES, results, strict=True):
            where = (rank, strategy, chunk_numel, replace)
            assert result["mismatched"] == [], where
            assert result["views"] > 0, where
            # No piece is copied, whether it lies in one chunk or spans several.
            assert result["copies"] == 0, (where, result)
            if chunk_numel == 100:
                assert result["spanning"] > 0, (where, result)


def _pieces_made_once(rank: int, world: int, strategies: list[Strategy]) -> list[dict[str, Any]]:
    import gc
    import io
    import weakref

    out = []
    for strategy in strategies:
        model, opt = _model_and_optimizer(strategy, 100)  # most parameters span chunks
        _step(model, opt, 0, rank, world)
        first, first_model = opt.sharded_state_dict(), model.sharded_state_dict()
        _step(model, opt, 1, rank, world)
        second, second_model = opt.sharded_state_dict(), model.sharded_state_dict()
        names = list(first["state"])
        same = all(
            first["state"][n][k] is second["state"][n][k]
            for n in names
            for k in ("exp_avg", "exp_avg_sq")
        )
        same_model = all(first_model[n] is second_model[n] for n in names)
        # The kept pieces are views: they show the state after the second step.
        current = [
            torch.equal(second["state"][n]["exp_avg"].local, want["exp_avg"].local)
            for n, want in _fresh_pieces(opt).items()
        ]
        # The kept pieces are not attached to torch's state: it pickles as plain tensors and
        # loads with weights_only (no class of ours in it).
        buf = io.BytesIO()
        torch.save(opt.optimizer.state_dict(), buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
        # Adam's step is a value at the call, not a view: the first call's says 1.
        steps = (float(first["state"][names[0]]["step"]), float(second["state"][names[0]]["step"]))
        # A load replaces the state: new pieces that show the loaded values, the old go.
        old = weakref.ref(first["state"][names[0]]["exp_avg"])
        saved = {
            "state": {
                n: {k: _scaled(v) for k, v in entry.items()} for n, entry in second["state"].items()
            },
            "param_groups": second["param_groups"],
        }
        del first, second, first_model, second_model
        opt.load_sharded_state_dict(saved)
        del saved
        gc.collect()
        third = opt.sharded_state_dict()
        loaded = all(
            torch.equal(third["state"][n]["exp_avg"].local, want["exp_avg"].local)
            for n, want in _fresh_pieces(opt).items()
        )
        out.append(
            {
                "same": same,
                "same_model": same_model,
                "current": all(current),
                "steps": steps,
                "old_freed": old() is None,
                "loaded": loaded,
            }
        )
    return out


def _scaled(value: Any) -> Any:
    """A saved piece with different values (a copy, so the load reads new numbers)."""
    if hasattr(value, "local") and value.local.numel() > 0:
        return type(value)(
            local=value.local * 2 + 1,
            global_shape=value.global_shape,
            global_offset=value.global_offset,
            flat_range=value.flat_range,
        )
    return value


def _fresh_pieces(opt: Any) -> dict[str, dict[str, Any]]:
    """The optimizer's pieces sliced out of its concatenated state (no cache involved)."""
    out = {}
    for pos, bucket in enumerate(opt.buckets):
        flat = opt.bucket_state(pos)
        for slot in bucket.layout.slots:
            out[slot.names[0]] = {"exp_avg": shard_of(bucket, slot, flat["exp_avg"])}
    return out


def test_saved_pieces_are_made_once_and_follow_a_load() -> None:
    per_rank = run_on_ranks(_pieces_made_once, 2, STRATEGIES, timeout_s=240)
    for rank, results in enumerate(per_rank):
        for strategy, result in zip(STRATEGIES, results, strict=True):
            assert result == {
                "same": True,
                "same_model": True,
                "current": True,
                "steps": (1.0, 2.0),
                "old_freed": True,
                "loaded": True,
            }, (rank, strategy)
