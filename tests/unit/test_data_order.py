from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perdure.data import DataError, Order, permute, position_to_sample, positions_to_samples


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=3000),
    seed=st.integers(min_value=0, max_value=2**63),
    epoch=st.integers(min_value=0, max_value=10**6),
)
def test_the_order_is_a_permutation_for_any_n(n: int, seed: int, epoch: int) -> None:
    perm = permute(np.arange(n), seed, epoch, n)
    assert np.array_equal(np.sort(perm), np.arange(n))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 13, 31, 97, 257, 65537, 100003])
def test_the_order_is_a_permutation_for_small_and_prime_n(n: int) -> None:
    for seed in (0, 1, 12345):
        perm = permute(np.arange(n), seed, 3, n)
        assert np.array_equal(np.sort(perm), np.arange(n))


def test_scalar_sequence_and_vector_lookups_agree_across_epoch_boundaries() -> None:
    n, seed = 37, 9
    positions = np.arange(2 * n - 10, 4 * n + 5)
    vec = positions_to_samples(seed, positions, n)
    assert [position_to_sample(seed, int(p), n) for p in positions] == vec.tolist()
    assert [Order(seed, int(p) // n, n)[int(p) % n] for p in positions] == vec.tolist()
    assert len(Order(seed, 0, n)) == n


def test_each_data_epoch_visits_every_sample_exactly_once() -> None:
    n = 1000
    samples = positions_to_samples(4, np.arange(5 * n), n).reshape(5, n)
    for row in samples:
        assert np.array_equal(np.sort(row), np.arange(n))


def test_a_lookup_in_a_huge_dataset_is_constant_time_and_memory() -> None:
    n = 2**61 + 12345
    start = time.perf_counter()
    out = positions_to_samples(1, np.arange(10**15, 10**15 + 1024), n)
    assert time.perf_counter() - start < 0.5
    assert int(out.min()) >= 0 and int(out.max()) < n
    assert len(set(out.tolist())) == 1024


def test_the_order_is_far_from_the_identity() -> None:
    n = 10_000
    perm = permute(np.arange(n), 7, 0, n)
    assert np.count_nonzero(perm == np.arange(n)) < 10  # a random permutation has ~1
    mean_shift = np.abs(perm - np.arange(n)).mean()
    assert abs(mean_shift - n / 3) < 0.05 * n  # random: E|p(i) - i| = n/3
    assert abs(np.corrcoef(perm, np.arange(n))[0, 1]) < 0.05
    steps = np.abs(np.diff(perm))
    assert np.count_nonzero(steps == 1) < 20  # neighbours do not stay neighbours


def test_each_sample_is_uniform_over_positions_across_seeds() -> None:
    n, seeds = 8, 4000
    counts = np.zeros((n, n))
    for seed in range(seeds):
        perm = permute(np.arange(n), seed, 0, n)
        counts[np.arange(n), perm] += 1
    expected = seeds / n
    chi2 = ((counts - expected) ** 2 / expected).sum(axis=1)
    # chi-square with 7 degrees of freedom: the 99.9% quantile is 24.3
    assert chi2.max() < 24.3, chi2


def test_epochs_and_seeds_give_unrelated_orders() -> None:
    n = 5000
    base = permute(np.arange(n), 1, 0, n)
    for other in (permute(np.arange(n), 1, 1, n), permute(np.arange(n), 2, 0, n)):
        assert np.count_nonzero(base == other) < 15
        assert abs(np.corrcoef(base, other)[0, 1]) < 0.05


def test_bad_order_arguments_are_errors() -> None:
    with pytest.raises(DataError, match="number of samples"):
        permute(np.arange(1), 0, 0, 0)
    with pytest.raises(DataError, match="positions must be >= 0"):
        positions_to_samples(0, np.array([-1]), 10)
    with pytest.raises(IndexError):
        Order(0, 0, 3)[3]


def test_consecutive_positions_are_jointly_uniform_across_seeds() -> None:
    n, seeds = 64, 3000
    counts = np.zeros((8, 8))
    for seed in range(seeds):
        perm = permute(np.arange(2), seed, 0, n)
        counts[perm[0] // 8, perm[1] // 8] += 1
    expected = seeds / 64
    # chi-square with 63 degrees of freedom: the 99.9% quantile is 103.4
    assert ((counts - expected) ** 2 / expected).sum() < 103.4
