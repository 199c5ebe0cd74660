"""`ckptctl restore` of a real ZeRO-3 checkpoint: consolidate (torch, safetensors), reshard 2 -> 3.

The checkpoints come from one 2-rank run (`_zero3_run.zero3_run`): the tiny GPT
trained under `sharding.FullyShardedDataParallel` (ZeRO-3), saved by the real
`CheckpointManager` to local disk and to S3 (moto). Every consolidation is compared with the
full state dict the engine gathered in training at the same step.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager, RankLocal
from ckpt_manager.ctl.cli import main
from daemon import GPT
from tests.ckpt_manager.ctl._zero3_run import CFG, Run, wrap, zero3_run
from tests.support.dist import run_on_ranks
from tests.support.s3 import MotoS3

pytestmark = [pytest.mark.slow, pytest.mark.s3]

STEP = 2


@pytest.fixture
def run(tmp_path_factory: pytest.TempPathFactory, moto_server: MotoS3) -> Run:
    return zero3_run(tmp_path_factory.getbasetemp(), moto_server)


def _restore_resharded(rank: int, world: int, uri: str, options: dict[str, Any]) -> Any:
    """On `world` ranks: restore the resharded step into a fresh model; gather its weights."""
    model = wrap(seed=123)
    config = CheckpointConfig(async_mode=AsyncMode.SYNC, storage_options=options)
    with CheckpointManager(uri, config, run_id="resumed") as mgr:
        template = {"model": model.sharded_state_dict(), "rng": RankLocal({"rank": -1})}
        result = mgr.restore(into=template)
    assert result is not None
    assert result.step == STEP
    model.load_sharded_state_dict(result.state["model"])
    return {"full": model.full_state_dict(), "rng_rank": result.state["rng"]["rank"]}


def _plain(state: dict[str, torch.Tensor]) -> GPT:
    model = GPT(CFG)
    model.load_state_dict(state)  # strict: every key present, none unknown
    return model.eval()


def _probe() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, CFG.vocab_size, (3, CFG.seq_len), generator=g)


def test_torch_format_from_s3_gives_identical_outputs(run: Run, tmp_path: pathlib.Path) -> None:
    out = tmp_path / "model.pt"
    argv = ["restore", run.s3, str(STEP), "--only", "model", "--to", str(out)]
    assert main([*argv, "--endpoint-url", run.bucket.endpoint_url]) == 0
    restored = torch.load(out, weights_only=True)
    full = run.fulls[STEP]
    # Every name of the plain module, the tied head included, sharing its embedding's
    # storage as in the module's own state_dict(): a strict load_state_dict accepts it.
    assert set(restored) == set(full)
    assert restored["head.weight"].data_ptr() == restored["tok_emb.weight"].data_ptr()
    for key, value in restored.items():
        assert torch.equal(value, full[key]), key
    with torch.no_grad():
        assert torch.equal(_plain(restored)(_probe()), _plain(full)(_probe()))


def test_safetensors_from_local_to_s3(run: Run, tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file

    uri = f"{run.bucket.uri}/export-{tmp_path.name}/model.safetensors"
    argv = ["--endpoint-url", run.bucket.endpoint_url, "restore", run.local, str(STEP)]
    assert main([*argv, "--format", "safetensors", "--only", "model", "--to", uri]) == 0
    local = tmp_path / "model.safetensors"
    run.bucket.filesystem().get(uri.removeprefix("s3://"), str(local))
    tensors = load_file(str(local))
    full = run.fulls[STEP]
    assert set(tensors) == set(full) - {"head.weight"}
    for key, value in tensors.items():
        assert torch.equal(value, full[key]), key


def test_full_state_keeps_optimizer_and_leaves_out_rank_local(
    run: Run, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "full.pt"
    assert main(["restore", run.local, "--to", str(out), "--buffer-mib", "1"]) == 0
    assert "left out rank-local state 'rng'" in capsys.readouterr().err
    state = torch.load(out, weights_only=True)
    assert set(state) == {"model", "optimizer"}
    # Optimizer state is per parameter (a tied one once); the model has every module name.
    assert set(state["optimizer"]["state"]) == set(state["model"]) - {"head.weight"}
    for key, value in state["model"].items():
        assert torch.equal(value, run.fulls[4][key]), key  # latest = step 4
    for key, per_param in state["optimizer"]["state"].items():
        assert per_param["exp_avg"].shape == state["model"][key].shape


def test_reshard_two_ranks_to_three_restores_same_weights(run: Run, tmp_path: pathlib.Path) -> None:
    dest = f"{run.bucket.uri}/world3-{tmp_path.name}"
    argv = ["restore", run.local, str(STEP), "--world-size", "3", "--to", dest]
    assert main([*argv, "--endpoint-url", run.bucket.endpoint_url]) == 0
    options = dict(run.bucket.storage_options)
    results = run_on_ranks(_restore_resharded, 3, dest, options, timeout_s=180)
    full = results[0]["full"]
    assert set(full) == set(run.fulls[STEP])
    for key, value in full.items():
        assert torch.equal(value, run.fulls[STEP][key]), key
    # RankLocal: saved ranks 0 and 1 get their own state back; rank 2 keeps its template.
    assert [r["rng_rank"] for r in results] == [0, 1, -1]


_GROWTH = """
import json, sys
import ckpt_manager.ctl.export, ckpt_manager.ctl.reshard, ckpt_manager.ctl.restore
from ckpt_manager.ctl.cli import main
def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
growths = []
for argv in json.loads(sys.argv[1]):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS: earlier runs do not count
    base = kib("VmRSS")
    assert main(argv) == 0, argv
    growths.append((kib("VmHWM") - base) / 1024)
print(json.dumps(growths))
"""


def _peak_growths_mib(runs: list[list[str]]) -> list[float]:
    """Peak RSS growth of each `ckptctl` run, one after another in one fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", _GROWTH, json.dumps(runs)],
        capture_output=True,
        text=True,
        check=True,
        timeout=180,
    )
    return [float(g) for g in json.loads(out.stdout.splitlines()[-1])]


def test_restore_memory_is_bounded_by_the_buffer(tmp_path: pathlib.Path) -> None:
    """A 48 MiB tensor restored with 2 MiB buffers: the peak grows by a few buffers only."""
    root = str(tmp_path / "big")
    numel = 12 << 20
    with CheckpointManager(root, CheckpointConfig(async_mode=AsyncMode.SYNC)) as mgr:
        mgr.save(1, {"model": {"big": torch.arange(numel, dtype=torch.float32)}})
        mgr.wait_until_finished()
    small = ["--buffer-mib", "2", "--no-verify"]
    runs = [
        [
            "restore",
            root,
            "--format",
            fmt,
            "--only",
            "model",
            "--to",
            str(tmp_path / f"big.{fmt}"),
            *small,
        ]
        for fmt in ("torch", "safetensors")
    ]
    runs.append(["restore", root, "--world-size", "2", "--to", str(tmp_path / "ws2"), *small])
    # Control: one 128 MiB chunk holds the whole tensor, which the measurement must see.
    whole = ["restore", root, "--format", "safetensors", "--to", str(tmp_path / "whole")]
    runs.append([*whole, "--buffer-mib", "128", "--no-verify"])
    *bounded, control = _peak_growths_mib(runs)
    assert max(bounded) < 24, bounded
    assert control > 48
    loaded = torch.load(tmp_path / "big.torch", weights_only=True, mmap=True)
    assert torch.equal(loaded["big"], torch.arange(numel, dtype=torch.float32))


def test_alias_key_is_the_same_string_on_both_sides_of_the_contract() -> None:
    from ckpt_manager._types import ALIASES_KEY as EXPORT_KEY
    from sharding._state_dict import ALIASES_KEY as ENGINE_KEY

    assert EXPORT_KEY == ENGINE_KEY == "__aliases__"
