"""`ckptctl restore --format dcp` of a trained engine's step, read by plain torch alone.

A process that imports none of our packages builds a plain module with the trained model's
names, shapes and ties and a torch AdamW with the same groups, takes `model.state_dict()` and
`get_optimizer_state_dict(model, optimizer)` as the template, and `dcp.load`s the export into
it: every key the plain module has (a tied head included) must be in the checkpoint, and the
optimizer state must be in torch's layout. The values must equal the engine's.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager._types import GROUP_NAMES_KEY as EXPORT_KEY
from ckpt_manager.ctl.cli import main
from daemon import GPT, GPTConfig
from daemon.rank.loop import make_optimizer
from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from sharding._optimizer import GROUP_NAMES_KEY as ENGINE_KEY

_PLAIN_LOAD = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict, set_optimizer_state_dict)
    warnings.simplefilter("ignore")
    spec = json.loads(open(sys.argv[1]).read())
    model = torch.nn.Module()
    def owner(name):
        module = model
        for part in name.split(".")[:-1]:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        return module, name.rsplit(".", 1)[-1]
    params = {}
    for name, shape in spec["params"]:
        module, leaf = owner(name)
        params[name] = torch.nn.Parameter(torch.zeros(shape))
        module.register_parameter(leaf, params[name])
    for alias, target in spec["ties"].items():
        module, leaf = owner(alias)
        module.register_parameter(leaf, params[target])
    for name, shape in spec["buffers"]:
        module, leaf = owner(name)
        module.register_buffer(leaf, torch.zeros(shape))
    groups = [{"params": [params[n] for n in names], "weight_decay": wd}
              for names, wd in spec["groups"]]
    optimizer = torch.optim.AdamW(groups, lr=1.0)
    state = {"model": model.state_dict(),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=sys.argv[2], no_dist=True)
    model.load_state_dict(state["model"], strict=True)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    ours = [m for m in sys.modules if m.split(".")[0] in ("ckpt_manager", "daemon", "sharding")]
    assert not ours, ours
    torch.save({"model": model.state_dict(),
                "optimizer": get_optimizer_state_dict(model, optimizer),
                "tied": [model.get_parameter(a) is model.get_parameter(t)
                         for a, t in spec["ties"].items()]}, sys.argv[3])
    """
)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_dcp_export_loads_into_a_plain_torch_model_and_optimizer(
    tied: bool, tmp_path: pathlib.Path
) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, seq_len=8, num_layers=2, d_model=16, num_heads=2)
    plain = GPT(dataclasses.replace(cfg, tie_embeddings=tied))
    names = {id(p): n for n, p in plain.named_parameters()}
    ties = {
        n: names[id(p)]
        for n, p in plain.named_parameters(remove_duplicate=False)
        if names[id(p)] != n
    }
    assert bool(ties) == tied
    named = {*names.values(), *ties}
    buffers = [[n, list(b.shape)] for n, b in plain.state_dict().items() if n not in named]
    model = FullyShardedDataParallel(plain, ShardingConfig(strategy=Strategy.OPTIM_GRADS_PARAMS))
    optimizer = make_optimizer(model, lr=0.01, weight_decay=0.1)
    ids = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        logits = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    root = str(tmp_path / "ckpt")
    with CheckpointManager(root, CheckpointConfig(async_mode=AsyncMode.SYNC), run_id="x") as mgr:
        state = {"model": model.sharded_state_dict(), "optimizer": optimizer.sharded_state_dict()}
        mgr.save(2, state)
    out = tmp_path / "dcp"
    assert main(["restore", root, "2", "--format", "dcp", "--to", str(out)]) == 0

    full = model.full_state_dict()
    saved_groups = optimizer.sharded_state_dict()["param_groups"]
    spec = {
        "params": [[n, list(full[n].shape)] for n in names.values()],
        "ties": ties,
        "buffers": buffers,
        "groups": [[g[ENGINE_KEY], g["weight_decay"]] for g in saved_groups],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run(
        [sys.executable, "-c", _PLAIN_LOAD, tmp_path / "spec.json", out, tmp_path / "out.pt"],
        check=True,
        cwd=tmp_path,  # not the repository: nothing of ours is importable by accident
        timeout=120,
    )
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert loaded["tied"] == [True] * len(ties)
    assert loaded["model"].keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(loaded["model"][key], value), key
    moments = optimizer.sharded_state_dict()["state"]
    assert loaded["optimizer"]["state"].keys() == moments.keys() == set(names.values())
    for name, entries in moments.items():
        for key, saved in entries.items():
            want = saved.local.view(saved.global_shape) if hasattr(saved, "local") else saved
            assert torch.equal(loaded["optimizer"]["state"][name][key], want), (name, key)
    for got, want in zip(loaded["optimizer"]["param_groups"], saved_groups, strict=True):
        assert got["params"] == want[ENGINE_KEY]
        assert got["lr"] == 0.01
        assert got["weight_decay"] == want["weight_decay"]


def test_group_names_key_is_the_same_string_on_both_sides_of_the_contract() -> None:
    assert EXPORT_KEY == ENGINE_KEY == "param_names"
