"""The daemon's optimizer: AdamW in two groups, no weight decay on biases, norms, embeddings."""

from __future__ import annotations

from daemon import GPT, Block, GPTConfig
from daemon.rank.loop import make_optimizer
from sharding import FullyShardedDataParallel, ShardingConfig


def test_default_optimizer_decays_only_matrices() -> None:
    gpt = GPT(GPTConfig(d_model=16, num_layers=2, num_heads=2, seq_len=8))
    decayed = {n for n, p in gpt.named_parameters() if p.ndim >= 2 and "emb" not in n}
    model = FullyShardedDataParallel(gpt, ShardingConfig(unit_modules=(Block,)))
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.1)
    groups = optimizer.sharded_state_dict()["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert set(groups[0]["param_names"]) == decayed
    undecayed = set(groups[1]["param_names"])
    assert {"tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight"} <= undecayed
    assert not decayed & undecayed
