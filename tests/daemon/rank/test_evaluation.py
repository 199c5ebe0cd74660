"""The validation loss through the real rank loop, on 2 ranks (`daemon/rank/evaluation.py`).

A tiny LM with dropout trains under ZeRO-3 with `eval_every=2`, every step checkpointed:
- each evaluated step's saved `val_loss` equals a single-process evaluation (eval mode, no
  dropout) of that step's checkpointed weights on the same samples, within 1e-6, and only the
  evaluated steps carry one;
- each rank's model ran exactly its training forwards plus `eval_batches` per evaluation;
- `keep_best=2, keep_best_metric=val_loss` keeps the two best evaluated steps (and the newest);
- a run stopped at step 3 and resumed evaluates at the same steps, with the same values, as the
  run that was not stopped.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from torch import nn

from ckpt_manager import AsyncMode, CheckpointConfig, CheckpointManager
from ckpt_manager._store.steps import read_manifest
from daemon.errors import JobError
from daemon.rank.evaluation import Evaluator, eval_indices
from daemon.rank.telemetry import NullTelemetry
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.slow

_VOCAB, _SEQ, _DIM = 32, 8, 16
_BATCH, _EVAL_BATCHES, _EVERY, _STEPS, _WORLD = 2, 2, 2, 6, 2
_FORWARD_CALLS = [0]
"""Forward calls of `_TinyLM` in this process (a rank counts its own)."""


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(_DIM, _DIM)
        self.drop = nn.Dropout(0.3)  # eval mode must turn it off

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.fc(x)))


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(_VOCAB, _DIM)
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(_DIM, _VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _FORWARD_CALLS[0] += 1
        return self.head(self.blocks(self.emb(x)))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _Tokens(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, _VOCAB, (n, _SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[i, :-1], self.rows[i, 1:]


def _config(root: str, max_steps: int, **extra: str) -> Any:
    from daemon._config_load import load_config

    flags = {"ckpt_uri": root, "max_steps": str(max_steps), "batch_size": str(_BATCH)}
    flags |= {"async_mode": "sync", "device": "cpu", "warmup_steps": "2", "lr": "0.02"}
    flags |= {"strategy": "optim_grads_params", "ckpt_every": "1", "memory_every": "0"}
    flags |= {"keep_last": "0"}  # every step kept, unless a test keeps fewer
    flags |= {"eval_every": str(_EVERY), "eval_batches": str(_EVAL_BATCHES), **extra}
    return load_config(flags, env={})


def _job() -> Any:
    from daemon.jobs.job import JobSpec

    torch.manual_seed(0)
    return JobSpec(
        model=_TinyLM(),
        train_data=_Tokens(32, seed=1),
        val_data=_Tokens(6, seed=2),  # fewer than 2 x 2 x 2 samples: the indices wrap
        loss_fn=_lm_loss,
        unit_modules=(_Block,),
    )


def _stop_after(steps: int) -> Any:
    """A `RankControl` whose stop request comes with the poll of step `steps` (0: never)."""
    from daemon.rundir.control import RankControl

    class StopAfter(RankControl):
        polls = 0

        def poll(self) -> tuple[bool, bool]:
            self.polls += 1
            stop, checkpoint = super().poll()
            return stop or self.polls == steps, checkpoint

    return StopAfter(None, graceful_signals=False)


def _train(root: str, *, stop_after: int = 0, **extra: str) -> int:
    """One run to `_STEPS` (or stopped after `stop_after` steps); this rank's forward calls."""
    from daemon.rank.loop import run_training

    _FORWARD_CALLS[0] = 0
    cfg = _config(root, _STEPS, **extra)
    run_training(cfg, _job(), telemetry=NullTelemetry(), control=_stop_after(stop_after))
    return _FORWARD_CALLS[0]


def _runs(rank: int, world_size: int, root: str) -> dict[str, Any]:
    calls = _train(f"{root}/all")
    _train(f"{root}/best", keep_last="1", keep_best="2", keep_best_metric="val_loss")
    _train(f"{root}/resumed", stop_after=3)
    _train(f"{root}/resumed")
    return {"calls": calls}


def _step_metrics(root: pathlib.Path) -> dict[int, dict[str, Any]]:
    with CheckpointManager(str(root), CheckpointConfig(async_mode=AsyncMode.SYNC)) as mgr:
        return {s: dict(read_manifest(mgr.storage, s).metrics) for s in mgr.all_steps()}


def _reference_val_loss(root: pathlib.Path, step: int) -> float:
    """One process, the checkpointed weights of `step`, the first 2 x 2 x 2 samples (wrapped)."""
    with CheckpointManager(str(root), CheckpointConfig(async_mode=AsyncMode.SYNC)) as mgr:
        restored = mgr.restore(step=step)
    assert restored is not None
    model = _TinyLM()
    reference = model.state_dict()
    model.load_state_dict(
        {k: restored.state["model"][k].reshape(v.shape) for k, v in reference.items()}
    )
    model.eval()
    data = _Tokens(6, seed=2)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, _BATCH * _EVAL_BATCHES * _WORLD, _BATCH):
            rows = [data[i % len(data)] for i in range(start, start + _BATCH)]
            inputs = torch.stack([r[0] for r in rows])
            targets = torch.stack([r[1] for r in rows])
            total += float(_lm_loss(model(inputs), targets)) * inputs.numel()
            tokens += inputs.numel()
    return total / tokens


def test_val_loss_equals_one_process_costs_its_forwards_ranks_best_and_resumes(
    tmp_path: pathlib.Path,
) -> None:
    first, second = run_on_ranks(_runs, _WORLD, str(tmp_path), timeout_s=300)
    evaluated = list(range(_EVERY, _STEPS + 1, _EVERY))
    # The eval costs its forward passes: training forwards plus eval_batches per evaluation.
    for result in (first, second):
        assert result["calls"] == _STEPS + len(evaluated) * _EVAL_BATCHES

    metrics = _step_metrics(tmp_path / "all")
    assert sorted(metrics) == list(range(1, _STEPS + 1))
    assert sorted(s for s, m in metrics.items() if "val_loss" in m) == evaluated
    for step in evaluated:
        expected = _reference_val_loss(tmp_path / "all", step)
        assert metrics[step]["val_loss"] == pytest.approx(expected, abs=1e-6), step
    values = [metrics[s]["val_loss"] for s in evaluated]
    assert len(set(values)) == len(values)  # the weights moved between evaluations

    # KeepBest by val_loss (with keep_last=1): the two best evaluated steps and the newest.
    best = sorted(evaluated, key=lambda s: metrics[s]["val_loss"])[:2]
    assert sorted(_step_metrics(tmp_path / "best")) == sorted({*best, _STEPS})

    # Stopped at step 3 and resumed: the same schedule and values.
    resumed = _step_metrics(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, _STEPS + 1))
    assert sorted(s for s, m in resumed.items() if "val_loss" in m) == evaluated
    for step in evaluated:
        assert resumed[step]["val_loss"] == pytest.approx(metrics[step]["val_loss"], abs=1e-6)


def test_indices_cover_the_first_samples_once_across_ranks() -> None:
    by_rank = [
        eval_indices(100, batch_size=3, num_batches=2, rank=r, world_size=2) for r in range(2)
    ]
    assert sorted(i for batches in by_rank for batch in batches for i in batch) == list(range(12))
    assert eval_indices(5, batch_size=2, num_batches=2, rank=1, world_size=2) == [[2, 3], [1, 2]]
    # An elastic job: 2 ranks evaluate twice the batches of 4 ranks, the same batches in all.
    two = [eval_indices(100, batch_size=3, num_batches=4, rank=r, world_size=2) for r in range(2)]
    four = [eval_indices(100, batch_size=3, num_batches=2, rank=r, world_size=4) for r in range(4)]
    assert sorted(b for rank in two for b in rank) == sorted(b for rank in four for b in rank)


def test_eval_every_without_val_data_is_refused() -> None:
    from daemon.jobs.job import JobSpec

    job = JobSpec(model=_TinyLM(), train_data=_Tokens(4, seed=1), loss_fn=_lm_loss)
    with pytest.raises(JobError, match="no validation data: give --val-data"):
        Evaluator(
            job,
            every=5,
            max_steps=10,
            batch_size=2,
            num_batches=1,
            rank=0,
            world_size=1,
            device=torch.device("cpu"),
            telemetry=NullTelemetry(),
        )
    with pytest.raises(JobError, match="val_data is empty"):
        JobSpec(model=_TinyLM(), train_data=_Tokens(4, seed=1), val_data=_Tokens(0, seed=1))
