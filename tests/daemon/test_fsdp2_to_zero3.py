"""An FSDP2 (`fully_shard`) checkpoint written through our manager loads into our ZeRO-3 engine.

This lives here because it composes both engines (`sharding` and `ckpt_manager` never import
each other): FSDP2's DTensor state dict is saved as box pieces; the engine's
`sharded_state_dict()` (flat pieces, same parameter names, same AdamW state keys) is the
restore template. Two real gloo ranks, spawned.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.ckpt_manager.test_dtensor import fsdp2_model
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow


def fsdp2_then_zero3(rank: int, world: int, root: str) -> None:
    """Save FSDP2 model + AdamW after one step; restore into a fresh ZeRO-3 engine; compare."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = fsdp2_model(world, seed=0)
    torch.manual_seed(100)
    model(torch.randn(4, 4)).pow(2).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(root, cfg, run_id="fsdp2") as mgr:
        mgr.save(1, {"model": msd, "optimizer": osd})
    full_model = {k: v.full_tensor() for k, v in msd.items()}
    full_state = {
        name: {k: v.full_tensor() if k != "step" else v for k, v in per.items()}
        for name, per in osd["state"].items()
    }

    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Linear(7, 3))
    engine = FullyShardedDataParallel(
        module,
        ShardingConfig(
            strategy=Strategy.OPTIM_GRADS_PARAMS,
            unit_modules=(torch.nn.Linear,),
            param_dtype=torch.float32,
        ),
    )
    zero3_opt = engine.make_optimizer(torch.optim.AdamW, lr=1e-2)
    engine(torch.randn(2, 4)).sum().backward()  # AdamW state exists: a full template
    zero3_opt.step()
    zero3_opt.zero_grad()
    ours = zero3_opt.sharded_state_dict()
    template = {"model": engine.sharded_state_dict(), "optimizer": {"state": ours["state"]}}
    with CheckpointManager(root, cfg, run_id="zero3") as mgr:
        result = mgr.restore(step=1, into=template)
    assert result is not None
    engine.load_sharded_state_dict(result.state["model"])
    zero3_opt.load_sharded_state_dict(
        {"state": result.state["optimizer"]["state"], "param_groups": ours["param_groups"]}
    )

    full = engine.full_state_dict()
    if rank == 0:
        assert full.keys() == full_model.keys()
        for name, value in full_model.items():
            assert torch.equal(full[name], value), name
    for name, per in zero3_opt.sharded_state_dict()["state"].items():
        for key, piece in per.items():
            expected = full_state[name][key]
            if key == "step":
                assert torch.equal(piece, expected), (name, key)
                continue
            start, end = piece.flat_range
            assert torch.equal(piece.local, expected.reshape(-1)[start:end]), (name, key)


def test_fsdp2_checkpoint_restores_bitwise_into_zero3(tmp_path: Any) -> None:
    run_on_ranks(fsdp2_then_zero3, 2, str(tmp_path / "ckpt"), timeout_s=240)
