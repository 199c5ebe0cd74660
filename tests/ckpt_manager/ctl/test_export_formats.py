"""`ckptctl restore --format dcp` and `--format safetensors --max-shard-size`: standard readers
(plain `dcp.load` in a process without trainingd, the `safetensors` library) read the output
bitwise equal to our own restore."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, RankLocal
from ckpt_manager.ctl.cli import main
from ckpt_manager.ctl.errors import UsageError
from ckpt_manager.ctl.export_sharded import parse_size
from tests.ckpt_manager.conftest import Shard


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(6, 5, generator=g)
    return {
        "model": {
            "embed.weight": Shard(weight.reshape(-1).clone(), (6, 5), (0, 0), (0, 30)),
            "blocks.0.weight": torch.randn(4, 5, generator=g).to(torch.bfloat16),
            "blocks.0.bias": torch.randn(4, generator=g, dtype=torch.float64),
            "head.weight": torch.randn(3, 4, generator=g),
        },
        "optimizer": {"state": {"head.weight": {"step": torch.tensor(2.0)}}, "lr": 0.5},
        "step": 1,
        "rng": RankLocal({"seed": torch.tensor([7])}),
    }


@pytest.fixture
def saved(tmp_path: pathlib.Path) -> tuple[str, dict[str, Any]]:
    """A committed step 1 and our own restore of it (RankLocal dropped, as exports do)."""
    root = str(tmp_path / "ckpt")
    with CheckpointManager(root, CheckpointConfig(async_mode=AsyncMode.SYNC), run_id="x") as mgr:
        mgr.save(1, _state())
        restored = mgr.restore(step=1)
    assert restored is not None
    state = restored.state
    state["model"]["embed.weight"] = state["model"]["embed.weight"].reshape(6, 5)
    del state["rng"]
    return root, state


def test_sharded_safetensors_export_matches_the_safetensors_loader(
    saved: tuple[str, dict[str, Any]], tmp_path: pathlib.Path
) -> None:
    root, ours = saved
    out = tmp_path / "hf"
    args = ["restore", root, "1", "--format", "safetensors", "--only", "model"]
    assert main([*args, "--max-shard-size", "100B", "--to", str(out)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert files == sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == 3  # 120 (over the 100-byte limit: alone) | 40 + 32 | 48 bytes
    assert files[0] == "model-00001-of-00003.safetensors"
    loaded: dict[str, torch.Tensor] = {}
    for name in files:
        loaded.update(load_file(out / name))
    assert loaded.keys() == ours["model"].keys() == index["weight_map"].keys()
    for key, value in ours["model"].items():
        assert loaded[key].dtype == value.dtype, key
        assert torch.equal(loaded[key], value), key
    total = sum(v.numel() * v.element_size() for v in loaded.values())
    assert index["metadata"]["total_size"] == total
    # A second export into the non-empty directory needs --force.
    assert main([*args, "--max-shard-size", "1GB", "--to", str(out)]) == 2
    assert main([*args, "--max-shard-size", "1GB", "--to", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]


_DCP_LOAD = textwrap.dedent(
    """
    import sys, warnings
    import torch
    import torch.distributed.checkpoint as dcp
    warnings.simplefilter("ignore")
    template = torch.load(sys.argv[1], weights_only=True)
    dcp.load(template, checkpoint_id=sys.argv[2], no_dist=True)
    assert not any(m.split(".")[0] in ("ckpt_manager", "daemon", "sharding") for m in sys.modules)
    torch.save(template, sys.argv[3])
    """
)


def test_dcp_export_loads_with_plain_dcp_in_a_process_without_trainingd(
    saved: tuple[str, dict[str, Any]], tmp_path: pathlib.Path
) -> None:
    root, ours = saved
    out = tmp_path / "dcp"
    assert main(["restore", root, "1", "--format", "dcp", "--to", str(out)]) == 0
    assert (out / ".metadata").is_file()
    template = {
        "model": {k: torch.zeros_like(v) for k, v in ours["model"].items()},
        "optimizer": {"state": {"head.weight": {"step": torch.tensor(0.0)}}, "lr": 0.0},
        "step": 0,
    }
    torch.save(template, tmp_path / "template.pt")
    subprocess.run(
        [sys.executable, "-c", _DCP_LOAD, tmp_path / "template.pt", out, tmp_path / "out.pt"],
        check=True,
        cwd=tmp_path,  # not the repository: nothing of ours is importable by accident
        timeout=120,
    )
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert loaded["step"] == 1
    assert loaded["optimizer"]["lr"] == 0.5
    assert torch.equal(loaded["optimizer"]["state"]["head.weight"]["step"], torch.tensor(2.0))
    for key, value in ours["model"].items():
        assert loaded["model"][key].dtype == value.dtype, key
        assert torch.equal(loaded["model"][key], value), key


def test_bad_export_flags_are_usage_errors(saved: tuple[str, dict[str, Any]]) -> None:
    root, _ = saved
    assert main(["restore", root, "--max-shard-size", "2GB", "--to", "x.pt"]) == 2
    args = ["restore", root, "--format", "dcp", "--to", "s3://bucket/dcp"]
    assert main(args) == 2
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("500") == 500
    for bad in ("2 parsecs", "0MB", "-1"):
        with pytest.raises(UsageError, match="max-shard-size"):
            parse_size(bad)
