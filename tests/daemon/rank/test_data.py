"""The rank-sharded loader: disjoint, deterministic, resumable at any world size."""

from __future__ import annotations

import tracemalloc

import torch

from daemon.jobs.default_job import ByteCorpus, corpus
from daemon.rank.data import ShardedLoader


class _Indices:
    def __len__(self) -> int:
        return 42

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(index), torch.tensor(index)


def _loaders(world: int, seed: int = 0) -> list[ShardedLoader]:
    ds = ByteCorpus(corpus(20_000), 16)
    return [
        ShardedLoader(ds, batch_size=4, rank=r, world_size=world, seed=seed) for r in range(world)
    ]


def test_ranks_get_disjoint_batches_and_targets_are_shifted_inputs() -> None:
    a, b = _loaders(2)
    xa, ya = a.next_batch()
    xb, _ = b.next_batch()
    assert xa.shape == (4, 16)
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert not any(torch.equal(r, s) for r in xa for s in xb)


def test_order_is_deterministic_per_seed_and_covers_an_epoch() -> None:
    first = [_loaders(1, seed=3)[0].next_batch()[0] for _ in range(2)]
    again = [_loaders(1, seed=3)[0].next_batch()[0] for _ in range(2)]
    other = _loaders(1, seed=4)[0].next_batch()[0]
    assert torch.equal(first[0], again[0])
    assert not torch.equal(first[0], other)
    loader = ShardedLoader(_Indices(), batch_size=4, rank=0, world_size=1, seed=0)
    n = len(_Indices()) // 4
    seen = [int(i) for _ in range(n) for i in loader.next_batch()[0]]
    # Each sample at most once per epoch; only the trailing partial batch (2 samples) is dropped.
    assert len(set(seen)) == len(seen) == 40
    assert loader.epoch == 0
    loader.next_batch()
    assert loader.epoch == 1


def test_position_resumes_exactly_and_across_world_sizes() -> None:
    ref = _loaders(2)
    for _ in range(5):
        for r in ref:
            r.next_batch()
    state = ref[0].state_dict()
    assert state == ref[1].state_dict()  # the position is global: identical on every rank
    resumed = _loaders(2)
    for r in resumed:
        r.load_state_dict(state)
    for r, s in zip(ref, resumed, strict=True):
        assert torch.equal(r.next_batch()[0], s.next_batch()[0])
    # One rank continues from the same global sample (8 samples per step at 2 x 4).
    single = _loaders(1)[0]
    single.load_state_dict(state)
    assert single.samples_consumed == state["samples_consumed"]


def test_one_rank_with_two_micro_batches_takes_the_samples_of_a_two_rank_step() -> None:
    # [Note: an elastic job keeps its global batch]: an elastic job that shrank from 2 ranks to
    # 1 accumulates 2 micro-batches per step, so each step trains on the same global samples.
    pair = _loaders(2)
    single = _loaders(1)[0]
    for _ in range(3):
        step_of_two = torch.cat([r.next_batch()[0] for r in pair])
        step_of_one = torch.cat([single.next_batch()[0] for _ in range(2)])
        assert torch.equal(step_of_two, step_of_one)
    assert single.state_dict() == pair[0].state_dict()


def test_world_sizes_1_2_4_read_the_same_global_batches() -> None:
    # The same global batch of 16 samples (batch 4 x world x micro-batches per rank) at every
    # world size: each step trains on the same samples, whichever rank reads them.
    per_world = {}
    for world in (1, 2, 4):
        loaders = _loaders(world)
        steps = []
        for _ in range(6):
            micro = 4 // world  # micro-batches per rank so every step is 16 samples
            steps.append(torch.cat([r.next_batch()[0] for _ in range(micro) for r in loaders]))
        per_world[world] = steps
    for step in range(6):
        ref = sorted(tuple(r.tolist()) for r in per_world[1][step])
        for world in (2, 4):
            assert sorted(tuple(r.tolist()) for r in per_world[world][step]) == ref


class _Virtual:
    """10^9 samples that exist only when read."""

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([index]), torch.tensor([index])


def test_loader_memory_does_not_grow_with_the_sample_count() -> None:
    # The loader's own Python allocations (tracemalloc, not the noisy process RSS): the old
    # `randperm(n).tolist()` would need ~36 GB here; a few batches must stay under 64 KiB.
    tracemalloc.start()
    try:
        loader = ShardedLoader(_Virtual(), batch_size=8, rank=1, world_size=4, seed=5)
        seen = [int(i) for _ in range(50) for i in loader.next_batch()[0]]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    assert len(set(seen)) == len(seen) == 400
    assert loader.state_dict() == {"epoch": 0, "samples_consumed": 50 * 32, "seed": 5}


def test_a_position_saved_by_the_previous_release_restores() -> None:
    # The keys are unchanged, so a checkpoint's data position from before the Feistel order
    # restores (the order after it is the new one: see README "Data order").
    loader = _loaders(2)[1]
    loader.load_state_dict({"epoch": 3, "samples_consumed": 24, "seed": 0})
    assert loader.state_dict() == {"epoch": 3, "samples_consumed": 24, "seed": 0}
    loader.next_batch()
    assert loader.state_dict()["samples_consumed"] == 32
