"""A checkpoint written by the previous release restores (#31).

`tests/ckpt_manager/fixtures/prev_release/checkpoint/` is step 2 of a 2-rank run of the tree
before #31 (`3846d5f`: its rank loop, ZeRO-3, AdamW, a tiny Hugging Face Llama), committed
once by `make_checkpoint.py` beside it (README.md there says how). That tree saved the
rotary buffers (`inv_freq`) with the weights; this one leaves non-persistent buffers out of
the state, and its data order is a Feistel permutation. Today's tree must:

- restore every value as that tree read it back (sha256 of each tensor in `expected.json`);
- accept it in `ckptctl list` and `ckptctl verify`;
- resume the run from it on 2 ranks: step 3's loss and weights equal that tree's own
  uninterrupted 3-step run's (`step3_model.safetensors`; every step trains on the whole
  4-sample set, so the data order cannot change what a step sees).
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager.ctl.cli import main as ckptctl
from tests.ckpt_manager.fixtures.prev_release import make_checkpoint as prev
from tests.support.dist import run_on_ranks

pytest.importorskip("transformers")

HERE = pathlib.Path(prev.__file__).parent
EXPECTED = json.loads((HERE / "expected.json").read_text())
_ROTARY = ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq")


@pytest.fixture
def root(tmp_path: pathlib.Path) -> str:
    """A copy of the fixture's root: opening a manager writes its lease."""
    copy = tmp_path / "ckpt"
    shutil.copytree(HERE / "checkpoint", copy)
    return str(copy)


def test_every_value_restores_as_the_previous_release_read_it(root: str) -> None:
    with CheckpointManager(root, CheckpointConfig(async_mode=AsyncMode.SYNC), run_id="r") as mgr:
        restored = mgr.restore()
    assert restored is not None
    assert restored.step == EXPECTED["step"] == prev.STEP
    got = prev.checksums(restored.state)
    assert got == EXPECTED["tensors"]
    assert {f"model.{name}" for name in _ROTARY} <= set(got)  # the premise: it holds them
    assert restored.state["scheduler"] == EXPECTED["scheduler"]
    assert restored.state["data"] == EXPECTED["data"]


def test_ckptctl_lists_and_verifies_it(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert ckptctl(["list", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["step"], row["state"], row["world_size"]) for row in rows] == [
        (prev.STEP, "committed", prev.WORLD_SIZE)
    ]
    assert ckptctl(["verify", root]) == 0
    assert capsys.readouterr().out.startswith(f"step {prev.STEP}: ok (4 files,")


def _resume(rank: int, world_size: int, root: str) -> tuple[int, float | None]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from daemon._config_load import load_config
    from daemon.jobs.job import JobSpec
    from daemon.rank.loop import run_training
    from daemon.rank.telemetry import NullTelemetry
    from daemon.rundir.control import RankControl

    job = JobSpec(
        model=prev.tiny_llama(),
        train_data=prev.Tokens(),
        loss_fn=prev.lm_loss,
        unit_modules=(LlamaDecoderLayer,),
    )
    cfg = load_config(prev.flags(root, prev.STEP + 1), env={})
    control = RankControl(None, graceful_signals=False)
    result = run_training(cfg, job, telemetry=NullTelemetry(), control=control)
    return result.start_step, result.last_loss


@pytest.mark.slow
def test_a_run_resumes_from_it_as_if_never_stopped(root: str) -> None:
    from safetensors.torch import load_file

    results = run_on_ranks(_resume, prev.WORLD_SIZE, root, timeout_s=300)
    assert [start for start, _ in results] == [prev.STEP] * prev.WORLD_SIZE
    loss = results[0][1]
    assert loss == pytest.approx(EXPECTED["step3_loss"], abs=1e-6)
    with CheckpointManager(root, CheckpointConfig(async_mode=AsyncMode.SYNC), run_id="r") as mgr:
        restored = mgr.restore()
    assert restored is not None
    assert restored.step == prev.STEP + 1
    model = restored.state["model"]
    reference = load_file(str(HERE / "step3_model.safetensors"))
    assert set(model) == set(reference)  # today's step holds no rotary buffers
    for name, want in reference.items():
        got = model[name].reshape(want.shape)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # A step, not a copy: the weights moved from step 2's.
    assert not torch.equal(model["lm_head.weight"], _step2_head(root))


def _step2_head(root: str) -> Any:
    with CheckpointManager(root, CheckpointConfig(async_mode=AsyncMode.SYNC), run_id="r") as mgr:
        step2 = mgr.restore(prev.STEP)
    assert step2 is not None
    return step2.state["model"]["lm_head.weight"].reshape(-1)
