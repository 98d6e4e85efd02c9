"""The global sample order: a keyed permutation with O(1) random access.

For data epoch ``e`` the order is a permutation of the N sample ids that is a pure function
of ``(seed, e, N)``. Global position ``p`` (counted from the start of the run, across data
epochs) maps to epoch ``p // N`` and index ``p % N`` of that epoch's permutation.

The permutation is a balanced Feistel network on ``2h``-bit integers (``4**h >= N``, the
smallest such ``h``) with :data:`ROUNDS` rounds whose round function is splitmix64 of the
right half XOR a round key; round keys come from BLAKE2b of ``(seed, epoch, N)``. A Feistel
network is a bijection on ``[0, 4**h)`` whatever its round function; *cycle walking*
(re-applying it until the value falls below N) restricts it to a bijection on ``[0, N)``.
Since ``4**h < 4N``, a lookup walks fewer than 4 times on average: O(1) time and memory,
no N-sized array. Limits: N < 2**62; Feistel networks on tiny domains reach only some of
the N! permutations (they are even permutations), which is irrelevant for training.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from perdure.data.errors import DataError
from perdure.data.hashing import derive_keys, mix64

ROUNDS = 6
"""Feistel rounds; 4 suffice for a pseudo-random permutation (Luby-Rackoff), 6 add margin
for the tiny domains where a 2-bit half has little room to mix."""

MAX_SAMPLES = 1 << 62


def _check_n(n: int) -> None:
    if not 1 <= n < MAX_SAMPLES:
        raise DataError(f"order: number of samples must be in [1, 2**62) (got {n!r})")


def _half_bits(n: int) -> int:
    h = 1
    while 1 << (2 * h) < n:
        h += 1
    return h


@lru_cache(maxsize=4096)
def _keys(seed: int, data_epoch: int, n: int) -> tuple[np.uint64, ...]:
    return tuple(np.uint64(k) for k in derive_keys("perdure.order.v1", ROUNDS, seed, data_epoch, n))


def _feistel(x: np.ndarray, keys: tuple[np.uint64, ...], h: int) -> np.ndarray:
    shift, mask = np.uint64(h), np.uint64((1 << h) - 1)
    left, right = x >> shift, x & mask
    for k in keys:
        left, right = right, left ^ (mix64(right ^ k) & mask)
    return (left << shift) | right


def permute(indices: np.ndarray, seed: int, data_epoch: int, n: int) -> np.ndarray:
    """Sample ids at ``indices`` (each in ``[0, n)``) of data epoch ``data_epoch``'s order."""
    _check_n(n)
    idx = np.asarray(indices, dtype=np.uint64)
    keys, h, bound = _keys(seed, data_epoch, n), _half_bits(n), np.uint64(n)
    out = _feistel(idx, keys, h)
    walk = np.flatnonzero(out >= bound)
    while walk.size:
        out[walk] = _feistel(out[walk], keys, h)
        walk = walk[out[walk] >= bound]
    return out.astype(np.int64)


def positions_to_samples(seed: int, positions: np.ndarray, n: int) -> np.ndarray:
    """Vectorised global lookup: sample id at each global position (positions >= 0)."""
    _check_n(n)
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size and int(pos.min()) < 0:
        raise DataError(f"order: positions must be >= 0 (got {int(pos.min())})")
    epochs, index = np.divmod(pos, n)
    if pos.size and epochs.min() == epochs.max():
        return permute(index, seed, int(epochs.flat[0]), n)
    out = np.empty(pos.shape, dtype=np.int64)
    for e in np.unique(epochs):  # a batch spans one data epoch, two at a boundary
        sel = epochs == e
        out[sel] = permute(index[sel], seed, int(e), n)
    return out


def position_to_sample(seed: int, position: int, n: int) -> int:
    """Sample id at one global position: O(1) time and memory."""
    return int(positions_to_samples(seed, np.array([position]), n)[0])


class Order:
    """The order of one data epoch, as a random-access sequence of sample ids."""

    def __init__(self, seed: int, data_epoch: int, n: int) -> None:
        _check_n(n)
        self.seed, self.data_epoch, self.n = seed, data_epoch, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not -self.n <= index < self.n:
            raise IndexError(f"order index {index} out of range for {self.n} samples")
        return int(self.take(np.array([index % self.n]))[0])

    def take(self, indices: np.ndarray) -> np.ndarray:
        """Sample ids at ``indices`` of this data epoch (vectorised)."""
        return permute(np.asarray(indices), self.seed, self.data_epoch, self.n)
