"""A seeded permutation of `[0, n)` computed index by index, in memory that does not grow with n.

`FeistelPermutation(n, seed=..., epoch=...)[i]` is the `i`-th element of a pseudo-random
permutation of `[0, n)`: a balanced Feistel network over the smallest even number of bits that
covers `n`, with cycle walking to stay inside `[0, n)`. Nothing is materialised: an epoch of
10^9 samples costs the same few hundred bytes as an epoch of 10 (a `randperm(n).tolist()` of
10^9 indices is ~36 GB of Python ints).

[Note: why a Feistel network with cycle walking]
A Feistel network is a bijection on `[0, 2^bits)` whatever its round function, so its output is a
permutation by construction, not by luck of a hash. Cycle walking (encrypt again while the value
is `>= n`) restricts a bijection of the larger domain to a bijection of `[0, n)`: following the
cycle of `i` from `i` always reaches a value below `n` (at worst `i` itself), and two indices
below `n` cannot land on the same value because the walk is the bijection's own cycle. Since the
domain is at most `4n`, the expected walk is under 4 encryptions. The round function is the
SplitMix64 finaliser (a strong 64-bit mixer) of the half-block xor a round key; the keys come
from `(seed, epoch)` so every epoch has its own order. Pure Python integers only: no tensor, so
the training loop's host-sync count (`tests/daemon/rank/test_loop_host_syncs.py`) is unchanged.
"""

from __future__ import annotations

__all__ = ["FeistelPermutation"]

_MASK64 = (1 << 64) - 1
_NUM_ROUNDS = 6


def _mix64(value: int) -> int:
    """The SplitMix64 finaliser: a bijective, well-avalanching 64-bit mix."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class FeistelPermutation:
    """The `(seed, epoch)` permutation of `[0, n)`, one index at a time, O(1) memory in `n`.

    Args:
        n: size of the permuted range (at least 1).
        seed: the run's seed (any int; taken modulo 2^64).
        epoch: the epoch (each epoch has its own order).

    Raises:
        ValueError: `n < 1` or `epoch < 0`.
    """

    __slots__ = ("_half_bits", "_half_mask", "_keys", "_n")

    def __init__(self, n: int, *, seed: int, epoch: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._n = n
        # An even number of bits covering [0, n): the domain is < 4n, so cycle walks are short.
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self._half_bits = bits // 2
        self._half_mask = (1 << self._half_bits) - 1
        state = _mix64(seed & _MASK64) ^ _mix64((epoch * 0x632BE59BD9B4E019) & _MASK64)
        keys = []
        for _ in range(_NUM_ROUNDS):
            state = _mix64(state)
            keys.append(state)
        self._keys = tuple(keys)

    def __len__(self) -> int:
        return self._n

    def _encrypt(self, value: int) -> int:
        half, mask = self._half_bits, self._half_mask
        left, right = value >> half, value & mask
        for key in self._keys:
            left, right = right, left ^ (_mix64(right ^ key) & mask)
        return (left << half) | right

    def __getitem__(self, index: int) -> int:
        """The element at position `index` (`0 <= index < n`)."""
        if not 0 <= index < self._n:
            raise IndexError(f"index {index} is outside [0, {self._n})")
        value = self._encrypt(index)
        while value >= self._n:  # cycle walking, see [Note: why a Feistel network ...]
            value = self._encrypt(value)
        return value
