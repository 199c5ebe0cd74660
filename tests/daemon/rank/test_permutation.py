"""The Feistel permutation: a bijection of [0, n) for every n, seeded by (seed, epoch)."""

from __future__ import annotations

import itertools

import pytest

from daemon.rank.permutation import FeistelPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4097])
def test_every_index_appears_exactly_once(n: int) -> None:
    perm = FeistelPermutation(n, seed=11, epoch=2)
    assert sorted(perm[i] for i in range(n)) == list(range(n))
    assert len(perm) == n


def test_order_depends_on_seed_and_epoch_and_is_reproducible() -> None:
    def order(seed: int, epoch: int) -> list[int]:
        perm = FeistelPermutation(1000, seed=seed, epoch=epoch)
        return [perm[i] for i in range(1000)]

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(1, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != list(range(1000))
    # Shuffled, not merely rotated: few indices keep their neighbour.
    ref = order(0, 0)
    assert sum(abs(a - b) == 1 for a, b in itertools.pairwise(ref)) < 20


def test_large_ranges_stay_in_range_without_materialising() -> None:
    perm = FeistelPermutation(10**9, seed=3, epoch=0)
    values = [perm[i] for i in range(2000)]
    assert all(0 <= v < 10**9 for v in values)
    assert len(set(values)) == len(values)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="n >= 1"):
        FeistelPermutation(0, seed=0, epoch=0)
    with pytest.raises(ValueError, match="epoch"):
        FeistelPermutation(3, seed=0, epoch=-1)
    with pytest.raises(IndexError):
        FeistelPermutation(3, seed=0, epoch=0)[3]
