"""FSDP2 interop: DTensor state saved through our manager, restored by FSDP2, DCP and ZeRO-3.

An FSDP2 (`fully_shard`) model and AdamW saved on 2 ranks restore bitwise on 3 ranks into
FSDP2 DTensor templates (and through torch DCP's `dcp.load` with our `Reader`), and on the 2
saving ranks into our engine's ZeRO-3 (`sharded_state_dict()` flat pieces, same parameter
names, same AdamW state keys). Also: replicas along a replicated mesh dimension write once,
and a 2-D mesh restores at another world size.

It lives in tests/daemon because it composes both engines (`sharding` and `ckpt_manager` never
import each other), and one spawn of the saving ranks serves both restores. Real gloo ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.ckpt_manager.conftest import Reports
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow

_CFG = CheckpointConfig(async_mode=AsyncMode.SYNC)
_EXTRA = torch.arange(30, dtype=torch.float64).reshape(5, 6)


def fsdp2_model(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny two-layer model under `fully_shard` (7 and 3 rows: uneven shards) + AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Linear(7, 3))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(tree: Any) -> Any:
    """Every DTensor gathered to its full tensor (collective), for comparison."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.full_tensor()
    if isinstance(tree, dict):
        return {k: _full(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_full(v) for v in tree)
    return tree


def _extras(world: int, fill: torch.Tensor) -> dict[str, Any]:
    """DTensors on other layouts: replicated, a dim-1 shard, and a (replicate, shard) 2-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    mesh_2d = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    return {
        "replicated": distribute_tensor(fill.clone(), mesh, [Replicate()]),
        "cols": distribute_tensor(fill.clone(), mesh, [Shard(1)]),
        "hsdp": distribute_tensor(fill.clone(), mesh_2d, [Replicate(), Shard(0)]),
    }


def save_fsdp2(rank: int, world: int, root: str) -> dict[str, Any]:
    """Train one step, save model + optimizer + extras (step 1), then replicas only (step 2)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor, Partial

    model, opt = fsdp2_model(world, seed=0)
    torch.manual_seed(100)
    model(torch.randn(4, 4)).pow(2).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    extras = _extras(world, _EXTRA)
    reports = Reports()
    with CheckpointManager(root, _CFG, run_id="fsdp2", observer=reports) as mgr:
        mgr.save(1, {"model": msd, "optimizer": osd, "extras": extras})
        mgr.save(2, {"replicated": extras["replicated"], "hsdp": extras["hsdp"]})
        mesh = extras["replicated"].device_mesh
        partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
        with pytest.raises(ValueError, match=r"'pending': DTensor placement Partial"):
            mgr.save(3, {"pending": partial})  # a pending reduction is not a saved value
    _restore_into_zero3(root, msd, osd)
    return {
        "full": _full({"model": msd, "optimizer": osd, "extras": extras}),
        "bytes": {r.step: r.num_bytes for r in reports.reports},
    }


def _restore_into_zero3(root: str, msd: dict[str, Any], osd: dict[str, Any]) -> None:
    """Restore step 1 into a fresh ZeRO-3 engine on these ranks; compare with FSDP2's state."""
    rank = torch.distributed.get_rank()
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
    with CheckpointManager(root, _CFG, run_id="zero3") as mgr:
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


def restore_fsdp2(rank: int, world: int, root: str) -> dict[str, Any]:
    """Fresh model (other seed) on `world` ranks; restore step 1 into its DTensor templates."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = fsdp2_model(world, seed=1)
    msd, osd = get_state_dict(model, opt)  # initialises AdamW's state: a full template
    extras = _extras(world, torch.zeros_like(_EXTRA))
    template = {"model": msd, "optimizer": osd, "extras": extras}
    with CheckpointManager(root, _CFG, run_id="fsdp2") as mgr:
        result = mgr.restore(step=1, into=template)
    assert result is not None
    state = result.state
    assert state["extras"]["cols"] is template["extras"]["cols"]  # filled in place
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    after_load = get_state_dict(model, opt)

    # The same step through torch DCP's own load, with our StorageReader.
    import torch.distributed.checkpoint as dcp

    from ckpt_manager.dcp import Reader

    dcp_model, dcp_opt = fsdp2_model(world, seed=2)
    dcp_msd, dcp_osd = get_state_dict(dcp_model, dcp_opt)
    dcp_extras = _extras(world, torch.zeros_like(_EXTRA))
    by_dcp = {"model": dcp_msd, "optimizer": dcp_osd, "extras": dcp_extras}
    dcp.load(by_dcp, storage_reader=Reader(root, step=1))
    return {
        "restored": _full(state),
        "loaded": _full({"model": after_load[0]}),
        "dcp": _full(by_dcp),
    }


def _assert_bitwise(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype, path
        assert a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_bitwise(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def test_fsdp2_state_saved_on_2_ranks_restores_bitwise_on_3_and_into_zero3(tmp_path: Any) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_on_ranks(save_fsdp2, 2, root, timeout_s=240)
    full = saved[0]["full"]
    assert torch.equal(full["extras"]["hsdp"], _EXTRA)
    # Replicas write once: at step 2 (replicated DTensors only) rank 1 writes empty pieces
    # (a header), rank 0 the data of both tensors.
    data_bytes = 2 * _EXTRA.numel() * _EXTRA.element_size()
    assert saved[0]["bytes"][2] - saved[1]["bytes"][2] >= data_bytes
    restored = run_on_ranks(restore_fsdp2, 3, root, timeout_s=240)
    for out in restored:
        _assert_bitwise(full, out["restored"])
        _assert_bitwise(full["model"], out["loaded"]["model"])
        _assert_bitwise(full, out["dcp"])
