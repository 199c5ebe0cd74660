"""The prefetching loader: same batches and positions as the plain loader, errors resurface."""

from __future__ import annotations

import threading

import pytest
import torch

from daemon.jobs.default_job import ByteCorpus, corpus
from daemon.rank.data import ShardedLoader
from daemon.rank.prefetch import PrefetchingLoader


def _loader() -> ShardedLoader:
    return ShardedLoader(ByteCorpus(corpus(20_000), 16), batch_size=4, rank=0, world_size=1, seed=2)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_batches_and_checkpointed_positions_match_the_plain_loader(depth: int) -> None:
    plain = _loader()
    with PrefetchingLoader(_loader(), depth=depth) as ahead:
        for _ in range(7):
            assert torch.equal(plain.next_batch()[0], ahead.next_batch()[0])
            # The position is what was handed out, not what the thread read ahead.
            assert ahead.state_dict() == plain.state_dict()


def test_resume_drops_what_was_read_ahead() -> None:
    with PrefetchingLoader(_loader(), depth=3) as first:
        for _ in range(5):
            first.next_batch()
        state = first.state_dict()
        expected = [first.next_batch()[0] for _ in range(3)]
        first.load_state_dict(state)  # back to step 5, thread running ahead meanwhile
        again = [first.next_batch()[0] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(expected, again, strict=True))
    with PrefetchingLoader(_loader(), depth=2) as resumed:
        resumed.load_state_dict(state)
        assert torch.equal(resumed.next_batch()[0], expected[0])


class _Failing:
    def __init__(self) -> None:
        self.reads = 0

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        if self.reads > 8:
            raise OSError("storage went away")
        return torch.tensor(index), torch.tensor(index)


def test_a_read_error_resurfaces_after_the_good_batches_and_the_thread_ends() -> None:
    loader = ShardedLoader(_Failing(), batch_size=4, rank=0, world_size=1, seed=0)
    with PrefetchingLoader(loader, depth=4) as ahead:
        ahead.next_batch()
        ahead.next_batch()
        with pytest.raises(OSError, match="storage went away"):
            ahead.next_batch()
    assert not [t for t in threading.enumerate() if t.name == "trainingd-prefetch"]


def test_close_ends_the_thread() -> None:
    ahead = PrefetchingLoader(_loader(), depth=2)
    ahead.next_batch()
    ahead.close()
    assert not [t for t in threading.enumerate() if t.name == "trainingd-prefetch"]
    with pytest.raises(ValueError, match="depth"):
        PrefetchingLoader(_loader(), depth=-1)
