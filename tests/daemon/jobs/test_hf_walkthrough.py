"""README "Train a Hugging Face model on your tokens", run as written (tiny model, 4 steps).

In a fresh working directory: `trainingd prepare-data`, the README's job file taken from the
README itself (`--job hf_job.py:build`), `trainingd run --init-from base-model/ --data ...
--val-data ... --eval-every` on 2 ranks (the validation loss logged at the evaluated steps),
`ckptctl restore ... --max-shard-size` and a strict `from_pretrained` of the export.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest
import torch

from tests.daemon._daemon_proc import CKPTCTL, REPO, TRAININGD, DaemonProc
from tests.support.hf import tiny_config

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

_SECTION = (
    (REPO / "README.md").read_text().split("### Train a Hugging Face model on your tokens")[1]
)


def _readme_job() -> str:
    """The job file of the walkthrough, with a short sequence for a tiny model."""
    blocks = re.findall(r"```python\n(.*?)```", _SECTION, flags=re.S)
    job = "\n".join(line.removeprefix("   ") for line in blocks[0].splitlines())
    assert "SEQ = 1024" in job
    return job.replace("SEQ = 1024", "SEQ = 16")


def test_the_readme_walkthrough(tmp_path: pathlib.Path, procs: list[DaemonProc]) -> None:
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.vocab_size = 256  # byte-level tokens
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    base.save_pretrained(tmp_path / "base-model")
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat. " * 200)
    (tmp_path / "heldout.txt").write_text("a dog sat on the log. " * 20)
    (tmp_path / "data").mkdir()
    for text, out in (("corpus.txt", "data/train.bin"), ("heldout.txt", "data/val.bin")):
        args = [TRAININGD, "prepare-data", text, "--out", out]
        subprocess.run(args, cwd=tmp_path, check=True, timeout=120)
    (tmp_path / "hf_job.py").write_text(_readme_job())

    run = ["--job", "hf_job.py:build", "--init-from", "base-model/", "--data", "data/train.bin"]
    run += ["--val-data", "data/val.bin", "--eval-every", "2"]
    run += ["--ckpt-uri", "runs/ft", "--max-steps", "4", "--nproc-per-node", "2"]
    run += ["--batch-size", "2", "--device", "cpu"]
    d = DaemonProc(tmp_path, run, cwd=tmp_path)
    procs.append(d)
    assert d.wait(240) == 0, d.logs()
    assert len(d.find("initialized_from")) == 2, d.logs()
    # Step 4: the validation loss, logged (rank 0) at every evaluated step.
    validations = d.find("validation")
    assert [int(e["step"]) for e in validations] == [2, 4], d.logs()
    assert all(float(e["val_loss"]) > 0 for e in validations), validations

    restore = [CKPTCTL, "restore", "runs/ft", "latest", "--format", "safetensors", "--only"]
    restore += ["model", "--max-shard-size", "2GB", "--to", "finetuned/"]
    subprocess.run(restore, cwd=tmp_path, check=True, timeout=120)
    assert (tmp_path / "finetuned" / "config.json").read_text() == (
        tmp_path / "base-model" / "config.json"
    ).read_text()
    loaded, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "finetuned", output_loading_info=True
    )
    assert not any(info.values()), info
    trained = dict(loaded.named_parameters())
    moved = [n for n, p in base.named_parameters() if not torch.equal(p, trained[n])]
    assert moved, "the export holds the base model's weights: nothing was trained"
