"""Tiny Llama and GPT-2 trained from `--init-from DIR` export as what `from_pretrained` loads.

The run (the real rank loop, 2 ranks) records DIR's `config.json` and
`generation_config.json` with its checkpoints; `ckptctl restore --format safetensors` writes
them beside the weights, and `AutoModelForCausalLM.from_pretrained(export)` loads strict
(nothing missing, unexpected or mismatched) with logits equal to the trained engine's. Both
models train in the same two spawned ranks (Llama: untied head, rotary buffers; GPT-2: a head
tied to the embedding, which the checkpoint names once).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager.ctl.cli import main as ckptctl
from sharding import FullyShardedDataParallel, ShardingConfig
from tests.support.dist import run_on_ranks
from tests.support.hf import VOCAB, tiny_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

_SEQ = 8


class _Tokens(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random token rows as `(inputs, targets)` (targets shifted by one)."""

    def __init__(self) -> None:
        self.rows = torch.randint(
            0, VOCAB, (16, _SEQ + 1), generator=torch.Generator().manual_seed(5)
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[i, :-1], self.rows[i, 1:]


def _lm_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(outputs.logits.flatten(0, 1), targets.flatten())


_KINDS = ("llama", "gpt2")


def _unit_modules(kind: str) -> tuple[type[torch.nn.Module], ...]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return (LlamaDecoderLayer,) if kind == "llama" else (GPT2Block,)


def _train_all(rank: int, world_size: int, root: str) -> None:
    for kind in _KINDS:
        _train(kind, f"{root}/{kind}/src", f"{root}/{kind}/ckpt")


def _train(kind: str, source: str, ckpt_root: str) -> None:
    from daemon._config_load import load_config
    from daemon.jobs.job import JobSpec
    from daemon.rank.loop import run_training
    from daemon.rank.telemetry import NullTelemetry
    from daemon.rundir.control import RankControl

    flags = {"ckpt_uri": ckpt_root, "max_steps": "2", "batch_size": "2", "ckpt_every": "0"}
    flags |= {"async_mode": "sync", "device": "cpu", "init_from": source, "warmup_steps": "1"}
    flags |= {"strategy": "optim_grads_params", "lr": "0.01"}
    cfg = load_config(flags, env={})
    model = tiny_model(kind, seed=2)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[kind]
    job = JobSpec(
        model=model, train_data=_Tokens(), loss_fn=_lm_loss, unit_modules=_unit_modules(kind)
    )
    run_training(
        cfg, job, telemetry=NullTelemetry(), control=RankControl(None, graceful_signals=False)
    )


def test_an_init_from_run_exports_what_from_pretrained_loads(tmp_path: pathlib.Path) -> None:
    from transformers import GenerationConfig

    for kind in _KINDS:
        src = tmp_path / kind / "src"
        tiny_model(kind, seed=1).save_pretrained(src)
        GenerationConfig(max_new_tokens=3, bos_token_id=1).save_pretrained(src)
    run_on_ranks(_train_all, 2, str(tmp_path), timeout_s=300)
    for kind in _KINDS:
        _check_export(kind, tmp_path / kind)


def _check_export(kind: str, tmp_path: pathlib.Path) -> None:
    """`kind`'s run (under `tmp_path`: `src/`, `ckpt/`) exports what loads strict."""
    from transformers import AutoModelForCausalLM

    source = tiny_model(kind, seed=1)
    root = str(tmp_path / "ckpt")
    out = tmp_path / "export"
    args = ["restore", root, "latest", "--format", "safetensors", "--only", "model"]
    assert ckptctl([*args, "--to", str(out / "model.safetensors")]) == 0
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_text() == (tmp_path / "src" / name).read_text(), name
    loaded, info = AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info.values()), (kind, info)  # strict: nothing missing, unexpected, ...

    # The trained engine: a fresh wrapped model given the checkpoint's weights.
    with CheckpointManager(root, CheckpointConfig(async_mode=AsyncMode.SYNC), run_id="r") as mgr:
        restored = mgr.restore()
    assert restored is not None
    assert restored.step == 2
    engine = FullyShardedDataParallel(tiny_model(kind, seed=3), ShardingConfig())
    engine.load_sharded_state_dict(restored.state["model"])
    ids = torch.randint(0, VOCAB, (2, _SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = engine(ids).logits
        torch.testing.assert_close(loaded(ids).logits, trained, rtol=0, atol=0)
        # Training moved the weights away from the source's.
        assert not torch.equal(trained, source(ids).logits)

    # The sharded layout gets them too.
    sharded = tmp_path / "sharded"
    assert ckptctl([*args, "--max-shard-size", "20KB", "--to", str(sharded)]) == 0
    assert (sharded / "config.json").read_text() == (out / "config.json").read_text()
    resharded = AutoModelForCausalLM.from_pretrained(sharded, attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(resharded(ids).logits, trained, rtol=0, atol=0)


def test_an_export_without_a_recorded_config_says_so_in_one_line(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(tmp_path / "ckpt")
    with CheckpointManager(root, CheckpointConfig(async_mode=AsyncMode.SYNC), run_id="r") as mgr:
        mgr.save(1, {"model": {"w": torch.ones(2)}})
    out = tmp_path / "export" / "model.safetensors"
    args = ["restore", root, "1", "--format", "safetensors", "--only", "model"]
    assert ckptctl([*args, "--to", str(out)]) == 0
    assert out.is_file()
    assert not (out.parent / "config.json").exists()
    notes = [line for line in capsys.readouterr().err.splitlines() if "config.json" in line]
    assert len(notes) == 1, notes
    assert "records no config.json" in notes[0], notes


def test_model_files_key_is_the_same_string_on_both_sides_of_the_contract() -> None:
    from ckpt_manager._types import MODEL_FILES_KEY as EXPORT_KEY
    from daemon.jobs.model_files import MODEL_FILES_KEY as DAEMON_KEY

    assert EXPORT_KEY == DAEMON_KEY == "__model_files__"
