from __future__ import annotations

import torch

from perdure.runtime.slots import all_finite


def test_all_finite_accepts_finite_values_whose_sum_overflows() -> None:
    big = torch.full((4,), 3e38)
    assert not torch.isfinite(big.sum())
    assert all_finite(big)


def test_all_finite_rejects_every_kind_of_non_finite_element() -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(1000)
        x[517] = bad
        assert not all_finite(x), bad
    both = torch.zeros(10)
    both[2], both[7] = float("inf"), float("-inf")
    assert not all_finite(both)


def test_all_finite_agrees_with_the_elementwise_test_on_random_data() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = torch.randn(257, generator=g) * 1e37
        mask = torch.rand(257, generator=g) < 0.01
        x[mask] = float("nan")
        assert all_finite(x) == bool(torch.isfinite(x).all())
