"""Optimizer parameter groups at world size 1: resolution, errors, schedulers, state dicts."""

from __future__ import annotations

import pytest
import torch

from daemon import lm_loss
from sharding import Strategy, no_decay_groups
from sharding.errors import StateDictLayoutError
from tests.sharding._helpers import Setup, batch, make_model, wrap

ZERO3 = Setup(strategy=Strategy.OPTIM_GRADS_PARAMS)


def test_no_decay_groups_split_matrices_from_biases_norms_and_embeddings() -> None:
    plain = make_model(ZERO3)
    decay, no_decay = no_decay_groups(plain, weight_decay=0.1)
    names = {id(p): n for n, p in plain.named_parameters()}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    decayed = {names[id(p)] for p in decay["params"]}
    assert all(len(plain.get_parameter(n).shape) == 2 for n in decayed)
    # The tied LM head is the token embedding: no decay.
    assert "tok_emb.weight" in {names[id(p)] for p in no_decay["params"]}
    assert "pos_emb.weight" not in decayed
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(plain.parameters()))


def test_groups_by_name_equal_groups_by_parameter() -> None:
    model = wrap(make_model(ZERO3), ZERO3)
    names = {id(p): n for n, p in model.module.named_parameters()}
    groups = no_decay_groups(model, weight_decay=0.1)
    by_name = [{**g, "params": [names[id(p)] for p in g["params"]]} for g in groups]
    a = model.make_optimizer(torch.optim.AdamW, groups, lr=1e-3)
    b = model.make_optimizer(torch.optim.AdamW, by_name, lr=1e-3)
    assert a.group_names == b.group_names
    assert [g["weight_decay"] for g in b.param_groups] == [0.1, 0.0]


def test_bad_groups_say_what_is_wrong() -> None:
    model = wrap(make_model(ZERO3), ZERO3)
    decay, no_decay = no_decay_groups(model, weight_decay=0.1)
    with pytest.raises(ValueError, match="in no parameter group"):
        model.make_optimizer(torch.optim.AdamW, [decay], lr=1e-3)
    with pytest.raises(ValueError, match="is in groups 0 and 1"):
        model.make_optimizer(torch.optim.AdamW, [decay, decay, no_decay], lr=1e-3)
    with pytest.raises(ValueError, match="not a trained parameter"):
        model.make_optimizer(torch.optim.AdamW, [{"params": ["nope"]}], lr=1e-3)


def test_scheduler_scales_each_group_and_state_dict_restores_groups() -> None:
    model = wrap(make_model(ZERO3), ZERO3)
    groups = no_decay_groups(model, weight_decay=0.1)
    groups[1]["lr"] = 4e-3
    opt = model.make_optimizer(torch.optim.AdamW, groups, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lambda step: 0.5 ** (step + 1))
    x, y = batch(0, 0, 0, 2)
    lm_loss(model(x), y).backward()
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [2.5e-4, 1e-3]
    saved = opt.sharded_state_dict()
    assert [g["weight_decay"] for g in saved["param_groups"]] == [0.1, 0.0]
    other = model.make_optimizer(torch.optim.AdamW, no_decay_groups(model, 0.3), lr=9.0)
    other.load_sharded_state_dict(saved)
    assert [g["lr"] for g in other.param_groups] == [2.5e-4, 1e-3]
    assert [g["weight_decay"] for g in other.param_groups] == [0.1, 0.0]
    assert "param_names" not in other.param_groups[0]
    swapped = list(reversed(no_decay_groups(model, 0.1)))
    mismatch = model.make_optimizer(torch.optim.AdamW, swapped, lr=1e-3)
    with pytest.raises(StateDictLayoutError, match="held other parameters"):
        mismatch.load_sharded_state_dict(saved)


def test_reload_mid_training_continues_exactly() -> None:
    # Groups cut buckets into several chunks; a reload once gave them one shared `step`
    # tensor, which AdamW then advanced once per chunk.
    from tests.sharding._ckpt_ranks import save_after_training

    result = save_after_training(0, 1, Strategy.NO_SHARD)
    assert result["again"] == result["after"]
