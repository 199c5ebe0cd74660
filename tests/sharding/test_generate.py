"""Generation on a wrapped Hugging Face model, 2 ranks, every strategy.

`model.generate(...)` (and `model.module.generate(...)` inside `summon_full_params()`) must
give the tokens the unwrapped model gives (greedy, a batch with left padding), and leave the
wrapper as it was: the next forward's logits equal the reference's and a training step works.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sharding import FullyShardedDataParallel, ShardingConfig, Strategy
from tests.support.dist import run_on_ranks
from tests.support.hf import VOCAB, tiny_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def _generate_everywhere(rank: int, world_size: int) -> dict[str, Any]:
    return {kind: _generate(kind) for kind in ("llama", "gpt2")}  # untied and tied


def _generate(kind: str) -> dict[str, Any]:
    reference = tiny_model(kind, seed=0).eval()
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding on the second row
    ids[1, :2] = 0
    options: dict[str, Any] = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False}
    options |= {"pad_token_id": 0}
    with torch.no_grad():
        expected = reference.generate(ids, **options)
        logits = reference(ids, attention_mask=mask).logits
    out: dict[str, Any] = {"expected": expected}
    for strategy in Strategy:
        model = FullyShardedDataParallel(
            tiny_model(kind, seed=0).eval(), ShardingConfig(strategy=strategy)
        )
        generated = model.generate(ids, **options)
        with model.summon_full_params():
            summoned = model.module.generate(ids, **options)
        with torch.no_grad():
            after = model(ids, attention_mask=mask).logits
        optimizer = model.make_optimizer(torch.optim.SGD, lr=0.1)
        model(ids, attention_mask=mask).logits.sum().backward()
        optimizer.step()
        out[strategy.value] = {
            "generated": generated,
            "summoned": summoned,
            "logits_match": bool(torch.equal(after, logits)),
        }
    return out


def test_generate_on_the_wrapper_equals_the_unwrapped_model() -> None:
    results = run_on_ranks(_generate_everywhere, 2, timeout_s=300)
    for result in (r[kind] for r in results for kind in ("llama", "gpt2")):
        expected = result["expected"]
        assert expected.shape[1] > 6  # something was generated
        for strategy in Strategy:
            got = result[strategy.value]
            assert torch.equal(got["generated"], expected), strategy
            assert torch.equal(got["summoned"], expected), strategy
            assert got["logits_match"], strategy
