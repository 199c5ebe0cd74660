"""Dict batches through the real rank loop: a tiny Llama with padding masks matches DDP.

Each sample is `{"input_ids", "attention_mask", "labels"}` (right padding on some rows, the
padded labels -100), passed as `model(**batch)`; with no `loss_fn` the loss is the model's
own `outputs.loss`. On 2 ranks the loop (`run_training`) under every strategy must end with
the weights and loss of a DDP reference that runs the same steps by hand: the loader's order,
AdamW in the same groups, the warmup schedule and gradient clipping.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from daemon.rank.batch import collate, forward_loss, num_tokens
from tests.support.dist import run_on_ranks
from tests.support.hf import VOCAB, tiny_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

_SEQ = 8
_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class _Padded(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token rows of random lengths 3..8, right-padded: ids 0, mask 0, labels -100."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(1, VOCAB, (16, _SEQ), generator=g)
        self.lengths = torch.randint(3, _SEQ + 1, (16,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = (torch.arange(_SEQ) < self.lengths[i]).long()
        ids = self.ids[i] * mask
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }


def _config(root: str, strategy: str) -> Any:
    from daemon._config_load import load_config

    flags = {"ckpt_uri": root, "max_steps": "3", "batch_size": "2", "ckpt_every": "0"}
    flags |= {"async_mode": "sync", "device": "cpu", "warmup_steps": "2", "lr": "0.01"}
    flags |= {"strategy": strategy, "grad_clip": "0.5"}
    return load_config(flags, env={})


def _ddp_reference(rank: int, world_size: int, cfg: Any) -> tuple[dict[str, torch.Tensor], float]:
    """The loop's steps by hand on DDP: the final weights and the last step's global loss."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from daemon.rank.data import ShardedLoader
    from daemon.rank.loop import _lr_lambda
    from sharding import no_decay_groups

    plain = tiny_model("llama", seed=0)
    ddp = DistributedDataParallel(plain)
    tc = cfg.train
    groups = no_decay_groups(plain, tc.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=tc.lr, weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    loader = ShardedLoader(
        _Padded(), batch_size=tc.batch_size, rank=rank, world_size=world_size, seed=tc.seed
    )
    loss = torch.zeros(())
    for _ in range(tc.max_steps):
        loss = forward_loss(ddp, None, loader.next_batch())
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(plain.parameters(), tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    dist.all_reduce(loss)
    return {k: v.detach().clone() for k, v in plain.state_dict().items()}, float(loss) / world_size


def _runs(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from daemon.jobs.job import JobSpec
    from daemon.rank.loop import run_training
    from daemon.rank.telemetry import NullTelemetry
    from daemon.rundir.control import RankControl

    losses = {}
    for strategy in _STRATEGIES:
        model = tiny_model("llama", seed=0)
        job = JobSpec(model=model, train_data=_Padded(), unit_modules=(LlamaDecoderLayer,))
        control = RankControl(None, graceful_signals=False)
        cfg = _config(f"{root}/{strategy}", strategy)
        result = run_training(cfg, job, telemetry=NullTelemetry(), control=control)
        losses[strategy] = result.last_loss
    weights, loss = _ddp_reference(rank, world_size, _config(root, "no_shard"))
    return {"losses": losses, "ddp_weights": weights, "ddp_loss": loss}


def test_dict_batches_with_padding_match_ddp(tmp_path: pathlib.Path) -> None:
    first, _ = run_on_ranks(_runs, 2, str(tmp_path), timeout_s=400)
    reference = first["ddp_weights"]
    for strategy in _STRATEGIES:
        assert first["losses"][strategy] == pytest.approx(first["ddp_loss"], abs=1e-6), strategy
        cfg = CheckpointConfig(async_mode=AsyncMode.SYNC)
        with CheckpointManager(str(tmp_path / strategy), cfg, run_id="r") as mgr:
            restored = mgr.restore()
        assert restored is not None
        assert restored.step == 3
        saved = restored.state["model"]
        assert saved.keys() == reference.keys()  # no rotary buffers: they are not persistent
        for name, value in reference.items():
            got = saved[name].reshape(value.shape)
            torch.testing.assert_close(got, value, rtol=0, atol=1e-6, msg=f"{strategy} {name}")
        assert not torch.equal(
            saved["lm_head.weight"], tiny_model("llama").lm_head.weight.flatten()
        )


def test_batches_collate_by_key_and_count_input_ids() -> None:
    data = _Padded()
    batch = collate([data[0], data[1]])
    assert isinstance(batch, dict)
    assert batch["attention_mask"].shape == (2, _SEQ)
    assert num_tokens(batch) == 2 * _SEQ
    pairs = collate([(torch.zeros(3), torch.ones(3))] * 2)
    assert isinstance(pairs, tuple)
    assert num_tokens(pairs) == 6
