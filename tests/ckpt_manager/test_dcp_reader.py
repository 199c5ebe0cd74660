"""`ckpt_manager.dcp.Reader`: plain `dcp.load` reads our committed steps (local and moto S3).

In process, without a process group (`no_dist=True`); the multi-rank DTensor case runs in
`test_dtensor.py`'s restore ranks.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ckpt_manager import (
    AsyncMode,
    CheckpointConfig,
    CheckpointManager,
    RankLocal,
)
from ckpt_manager.dcp import Reader
from tests.ckpt_manager.conftest import Shard

# dcp.load without a process group says it assumes one process: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(5, 7, generator=g)
    return {
        "model": {
            # A flat piece (our engine's form) covering the whole: DCP asks for boxes of it.
            "w": Shard(weight.reshape(-1).clone(), (5, 7), (0, 0), (0, 35)),
            "b": torch.randn(7, generator=g, dtype=torch.float64),
            "blocks": [torch.randn(2, 3, generator=g), torch.arange(4, dtype=torch.int32)],
        },
        "optimizer": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 7, generator=g)}},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": ["w"]}],
        },
        "step": seed,
        "rng": RankLocal({"seed": torch.tensor([seed])}),
    }


def _template() -> dict[str, Any]:
    return {
        "model": {
            "w": torch.zeros(5, 7),
            "b": torch.zeros(7, dtype=torch.float64),
            "blocks": [torch.zeros(2, 3), torch.zeros(4, dtype=torch.int32)],
        },
        "optimizer": {
            "state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(5, 7)}},
            "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}],
        },
        "step": -1,
    }


def _assert_same(dcp_loaded: Any, ours: Any, path: str = "") -> None:
    if isinstance(ours, torch.Tensor):
        assert isinstance(dcp_loaded, torch.Tensor), path
        assert dcp_loaded.dtype == ours.dtype, path
        assert torch.equal(dcp_loaded, ours), path
    elif isinstance(ours, dict):
        assert dcp_loaded.keys() == ours.keys(), path
        for k in ours:
            _assert_same(dcp_loaded[k], ours[k], f"{path}/{k}")
    elif isinstance(ours, list | tuple):
        assert len(dcp_loaded) == len(ours), path
        for i, (a, b) in enumerate(zip(dcp_loaded, ours, strict=True)):
            _assert_same(a, b, f"{path}/{i}")
    else:
        assert dcp_loaded == ours, path


def _save_two_steps(uri: str, options: dict[str, Any]) -> Any:
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC, storage_options=options)
    with CheckpointManager(uri, cfg, run_id="dcp") as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        restored = mgr.restore(step=1)
    assert restored is not None
    return restored.state


@pytest.mark.parametrize("where", ["local", "moto"])
def test_dcp_load_equals_our_restore(
    request: pytest.FixtureRequest, tmp_path: Any, where: str
) -> None:
    if where == "local":
        uri, options = str(tmp_path / "ckpt"), {}
    else:
        target = request.getfixturevalue("s3")
        uri, options = f"{target.uri}/run-{uuid.uuid4().hex[:8]}", dict(target.storage_options)
    ours = _save_two_steps(uri, options)
    ours["model"]["w"] = ours["model"]["w"].reshape(5, 7)  # consolidated whole
    del ours["rng"]  # RankLocal: no DCP equivalent, left out

    loaded = _template()
    dcp.load(loaded, storage_reader=Reader(uri, step=1, storage_options=options), no_dist=True)
    _assert_same(loaded, ours)

    newest = _template()
    dcp.load(newest, storage_reader=Reader(uri, storage_options=options), no_dist=True)
    assert newest["step"] == 2


def test_a_corrupted_file_fails_the_load_and_a_missing_step_is_named(tmp_path: Any) -> None:
    root = tmp_path / "ckpt"
    _save_two_steps(str(root), {})
    (shard,) = sorted((root / "step-000000000001").glob("*.bin"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    # DCP wraps each rank's error in a CheckpointException carrying its traceback.
    with pytest.raises(CheckpointException, match=r"CorruptCheckpointError: step 1: .*checksum"):
        dcp.load(_template(), storage_reader=Reader(root, step=1), no_dist=True)
    with pytest.raises(CheckpointException, match="step 7 is not committed"):
        dcp.load(_template(), storage_reader=Reader(root, step=7), no_dist=True)


def test_a_tied_models_state_dict_loads_with_every_name(tmp_path: Any) -> None:
    # A tied head is saved once, its name listed under `__aliases__`: plain torch's
    # `model.state_dict()` has both names, and DCP's load must find both (before, it failed
    # with "Missing key in checkpoint state_dict: model.head.weight").
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(6, 4), "head": torch.nn.Linear(4, 6)})
    model["head"].weight = model["emb"].weight
    saved = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    saved["__aliases__"] = {"head.weight": "emb.weight"}
    with CheckpointManager(str(tmp_path / "ckpt"), CheckpointConfig(), run_id="r") as mgr:
        mgr.save(1, {"model": saved})
        mgr.wait_until_finished()
    target = torch.nn.ModuleDict({"emb": torch.nn.Embedding(6, 4), "head": torch.nn.Linear(4, 6)})
    state = {"model": target.state_dict()}
    assert "head.weight" in state["model"]
    dcp.load(state, storage_reader=Reader(str(tmp_path / "ckpt")))
    target.load_state_dict(state["model"])
    assert torch.equal(target["head"].weight, model["emb"].weight)
    assert torch.equal(target["emb"].weight, model["emb"].weight)
    assert torch.equal(target["head"].bias, model["head"].bias)
