"""The global sample order: a keyed permutation with O(1) random access.

For data epoch ``e`` the order is a permutation of the N sample ids that is a pure function
of ``(seed, e, N)``. Global position ``p`` (counted from the start of the run, across data
epochs) maps to epoch ``p // N`` and index ``p % N`` of that epoch's permutation.

The permutation is an alternating Feistel network on ``b``-bit integers, ``b`` the bit
length of ``N - 1`` (at least 2), split into a high half of ``ceil(b/2)`` bits and a low half
of ``floor(b/2)`` bits; round ``i`` XORs one half with the top bits of
``(other half + a_i) * m_i mod 2**64`` (multiply-add-shift, a universal hash family; ``m_i``
odd), alternating halves, for :data:`ROUNDS` rounds. Round keys come from BLAKE2b of
``(seed, epoch, N)``. Each round is invertible whatever its round function, so the network
is a bijection on ``[0, 2**b)``; *cycle walking* (re-applying it until the value falls below
N) restricts it to a bijection on ``[0, N)``. Since ``2**b < 2N``, a lookup walks fewer than
2 times on average: O(1) expected time and memory, no N-sized array. The few positions of a
batch that walk long are finished in plain Python, where a scalar round costs less than a
numpy call's overhead. Limits: N < 2**62; Feistel networks reach only some of the N!
permutations (even ones), which is irrelevant for training.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from perdure.data.errors import DataError
from perdure.data.hashing import derive_keys

ROUNDS = 6
"""Feistel rounds (3 per half); 4 suffice for a pseudo-random permutation (Luby-Rackoff),
6 add margin for tiny domains where a 1-bit half has little room to mix."""

MAX_SAMPLES = 1 << 62
_SCALAR_TAIL = 16
"""Below this many still-walking positions, finish them in plain Python."""
_M64 = (1 << 64) - 1


def _check_n(n: int) -> None:
    if not 1 <= n < MAX_SAMPLES:
        raise DataError(f"order: number of samples must be in [1, 2**62) (got {n!r})")


@lru_cache(maxsize=4096)
def _network(seed: int, data_epoch: int, n: int) -> tuple[int, int, tuple[int, ...]]:
    """(high bits, low bits, round keys) of the network for (seed, epoch, N)."""
    bits = max(2, (n - 1).bit_length())
    low = bits // 2
    return bits - low, low, derive_keys("perdure.order.v2", ROUNDS, seed, data_epoch, n)


def _feistel(x: np.ndarray, high: int, low: int, keys: tuple[int, ...]) -> np.ndarray:
    shift = np.uint64(low)
    left, right = x >> shift, x & np.uint64((1 << low) - 1)
    top_h, top_l = np.uint64(64 - high), np.uint64(64 - low)
    tmp = np.empty_like(left)
    for i, k in enumerate(keys):  # in-place ufuncs: no temporaries per round
        add, mul = np.uint64(k >> 32), np.uint64(k | 1)
        src, dst, top = (right, left, top_h) if i % 2 == 0 else (left, right, top_l)
        np.add(src, add, out=tmp)
        np.multiply(tmp, mul, out=tmp)
        np.right_shift(tmp, top, out=tmp)
        np.bitwise_xor(dst, tmp, out=dst)
    np.left_shift(left, shift, out=left)
    return np.bitwise_or(left, right, out=left)


def _feistel_int(x: int, high: int, low: int, keys: tuple[int, ...]) -> int:
    mask_l = (1 << low) - 1
    left, right = x >> low, x & mask_l
    for i, k in enumerate(keys):
        add, mul = k >> 32, k | 1
        if i % 2 == 0:
            left ^= (((right + add) * mul) & _M64) >> (64 - high)
        else:
            right ^= (((left + add) * mul) & _M64) >> (64 - low)
    return (left << low) | right


def _walk_int(x: int, n: int, high: int, low: int, keys: tuple[int, ...]) -> int:
    while x >= n:
        x = _feistel_int(x, high, low, keys)
    return x


def permute(indices: np.ndarray, seed: int, data_epoch: int, n: int) -> np.ndarray:
    """Sample ids at ``indices`` (each in ``[0, n)``) of data epoch ``data_epoch``'s order."""
    _check_n(n)
    high, low, keys = _network(seed, data_epoch, n)
    out = _feistel(np.asarray(indices, dtype=np.uint64), high, low, keys)
    bound = np.uint64(n)
    walk = np.flatnonzero(out >= bound)
    while walk.size > _SCALAR_TAIL:
        out[walk] = _feistel(out[walk], high, low, keys)
        walk = walk[out[walk] >= bound]
    for i in walk.tolist():
        out[i] = _walk_int(int(out[i]), n, high, low, keys)
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
    # a batch spans one data epoch, two at a boundary (np.unique would import numpy.ma,
    # 0.1 s of CPU in every worker)
    for e in range(int(epochs.min()), int(epochs.max()) + 1):
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
