"""`--init-from` a `save_pretrained` directory of tiny Hugging Face models (built in code).

The check and the load the ranks run (`check_source` on the unsharded module, `load_into` on
the engine), at world size 1 under every strategy: the rotary buffers Llama and Qwen2 rebuild
(non-persistent, absent from the file) are neither missing nor read, and the wrapped model's
logits equal the saved model's.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from daemon.jobs.init_from import check_source, load_into
from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.support.hf import VOCAB, tiny_model

pytest.importorskip("transformers")


@pytest.mark.parametrize("strategy", list(Strategy), ids=[s.value for s in Strategy])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_a_save_pretrained_directory_loads(
    kind: str, strategy: Strategy, tmp_path: pathlib.Path
) -> None:
    saved = tiny_model(kind, seed=1)
    saved.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    fresh = tiny_model(kind, seed=2)
    init = check_source(fresh, str(tmp_path), None)
    model = FullyShardedDataParallel(fresh, ShardingConfig(strategy=strategy))
    assert load_into(model, init) > 0
    saved.eval()  # GPT-2's dropout
    model.eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, saved(ids).logits, rtol=0, atol=0)
