"""`trainingd run --init-from`: a run starts from exported safetensors weights, or refuses them.

The weights come from our own export (`ckptctl restore --format safetensors --max-shard-size`,
the Hugging Face sharded layout with its index) of the default job's GPT with other weights
than the job would initialise. The run's first loss (step 1's forward, before any optimizer
step; with `--max-steps 1` the loss each rank reports at the end) must be the loss of exactly
those weights on the job's first batch, bitwise. A directory with one renamed key exits 2
naming it, before any rank starts.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager.ctl.cli import main as ckptctl
from daemon import GPT, lm_loss
from daemon.errors import JobError
from daemon.jobs.default_job import MODEL, ByteCorpus, corpus
from daemon.jobs.init_from import SafetensorsSource, mismatch
from daemon.rank.data import ShardedLoader
from tests.daemon._daemon_proc import DaemonProc

pytestmark = pytest.mark.slow

_BATCH_SIZE = 2
_WORLD = 2
_ARGS = ["--nproc-per-node", str(_WORLD), "--batch-size", str(_BATCH_SIZE), "--max-steps", "1"]
_ARGS += ["--warmup-steps", "1", "--strategy", "optim_grads_params", "--seed", "0"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[str, Any]]:
    """A GPT (seed 7, not the job's seed) exported as sharded safetensors; its state dict."""
    base = tmp_path_factory.mktemp("init-from")
    torch.manual_seed(7)
    weights = {k: v.clone() for k, v in GPT(MODEL).state_dict().items()}
    cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
    with CheckpointManager(str(base / "ckpt"), cfg, run_id="export") as mgr:
        mgr.save(1, {"model": weights})
    out = base / "hf"
    args = ["restore", str(base / "ckpt"), "1", "--format", "safetensors", "--only", "model"]
    assert ckptctl([*args, "--max-shard-size", "200KB", "--to", str(out)]) == 0
    return out, weights


def test_export_is_read_by_the_safetensors_library(
    exported: tuple[pathlib.Path, dict[str, Any]],
) -> None:
    out, weights = exported
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    loaded: dict[str, torch.Tensor] = {}
    for name in files:
        loaded.update(load_file(out / name))
    assert loaded.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(loaded[key], value), key
    assert mismatch(GPT(MODEL), SafetensorsSource(str(out)), None) is None


def _first_loss(weights: dict[str, Any]) -> float:
    """The job's step-1 loss with `weights`: mean over ranks of each rank's first batch."""
    model = GPT(MODEL)
    model.load_state_dict(weights)
    total = torch.zeros(())
    data = ByteCorpus(corpus(), MODEL.seq_len)
    with torch.no_grad():
        for rank in range(_WORLD):
            loader = ShardedLoader(
                data, batch_size=_BATCH_SIZE, rank=rank, world_size=_WORLD, seed=0
            )
            inputs, targets = loader.next_batch()
            total += lm_loss(model(inputs), targets)
    return float(total) / _WORLD


def test_run_starts_from_exactly_the_exported_weights(
    exported: tuple[pathlib.Path, dict[str, Any]], tmp_path: pathlib.Path, procs: list[DaemonProc]
) -> None:
    out, weights = exported
    root = tmp_path / "ckpt"
    d = DaemonProc(tmp_path, [*_ARGS, "--init-from", str(out), "--ckpt-uri", str(root)])
    procs.append(d)
    assert d.wait(180) == 0, d.logs()
    assert len(d.find("initialized_from")) == _WORLD, d.logs()
    expected = _first_loss(weights)
    torch.manual_seed(0)
    own_init = _first_loss(GPT(MODEL).state_dict())
    assert abs(expected - own_init) > 1e-3  # the exported weights are not the job's own
    # The loss of step 1 (its forward ran on the initial weights), as each rank returned it.
    finished = d.find("rank_finished")
    assert [e["loss"] for e in finished] == [expected] * _WORLD, d.logs()


def test_a_renamed_key_exits_2_naming_it(
    exported: tuple[pathlib.Path, dict[str, Any]], tmp_path: pathlib.Path, procs: list[DaemonProc]
) -> None:
    out, _ = exported
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    old = "blocks.1.attn.qkv.weight" if "blocks.1.attn.qkv.weight" in index["weight_map"] else None
    old = old or sorted(index["weight_map"])[3]
    new = old.replace("weight", "kernel")
    shard = broken / index["weight_map"][old]
    tensors = load_file(shard)
    tensors[new] = tensors.pop(old)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"][new] = index["weight_map"].pop(old)
    index_path.write_text(json.dumps(index))

    root = tmp_path / "ckpt"
    d = DaemonProc(tmp_path, [*_ARGS, "--init-from", str(broken), "--ckpt-uri", str(root)])
    procs.append(d)
    assert d.wait(120) == 2, d.logs()
    err = d.stderr_path.read_text()
    lines = [x for x in err.splitlines() if "does not fit the model" in x]
    assert len(lines) == 1, err
    assert f"missing {old!r}" in lines[0]
    assert f"unexpected {new!r}" in lines[0]
    assert not d.find("daemon_started")  # refused before any rank started


class _Tied(torch.nn.Module):
    """An embedding tied to the head, plus a buffer: names the file may give once."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(3, dtype=torch.float64))


def test_names_through_the_key_map_tied_names_and_the_first_differences(
    tmp_path: pathlib.Path,
) -> None:
    model = _Tied()
    single = tmp_path / "one.safetensors"
    named = {"model.emb.weight": torch.randn(5, 3), "model.scale": torch.ones(3).double()}
    save_file(named, single)
    source = SafetensorsSource(str(single))

    def drop_prefix(name: str) -> str:
        return name.removeprefix("model.")

    assert mismatch(model, source, drop_prefix) is None  # head.weight is tied to emb.weight
    problem = mismatch(model, source, None)
    assert problem is not None
    assert problem.startswith(f"init_from={str(single)!r} does not fit the model: missing ")
    assert "unexpected 'model.emb.weight'" in problem

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    tensors = {"emb.weight": torch.randn(5, 4), "scale": torch.ones(3)}
    tensors.update({f"extra.{i}": torch.zeros(1) for i in range(6)})
    save_file(tensors, wrong / "model.safetensors")  # a directory with one model.safetensors
    problem = mismatch(model, SafetensorsSource(str(wrong)), None)
    assert problem is not None
    assert "'emb.weight' has shape (5, 4) in the file, (5, 3) in the model" in problem
    assert "'scale' is torch.float32 in the file, torch.float64 in the model" in problem
    # 9 differences (the tied head.weight is named too, 6 unexpected): the first 5 named.
    assert problem.endswith("(and 4 more)")
    assert "\n" not in problem


@pytest.mark.s3
def test_a_source_on_s3_is_read_in_byte_ranges(s3: Any, tmp_path: pathlib.Path) -> None:
    local = tmp_path / "m.safetensors"
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_file({"w": weight}, local)
    fs = s3.filesystem()
    uri = f"{s3.uri}/hf/model.safetensors"
    fs.put(str(local), uri.removeprefix("s3://"))
    source = SafetensorsSource(f"{s3.uri}/hf", s3.storage_options)
    assert source.entries["w"].shape == (3, 4)
    assert torch.equal(source.read("w", 5, 9), weight.reshape(-1)[5:9])
    with pytest.raises(JobError, match="no such file or directory"):
        SafetensorsSource(f"{s3.uri}/missing", s3.storage_options)
