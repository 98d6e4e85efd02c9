from __future__ import annotations

import torch

from perdure.runtime.replica.slots import all_finite


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


def test_applied_gradient_is_the_gradient_of_the_mean_loss_over_the_global_batch() -> None:
    from examples.tiny_lm.task import make_task
    from perdure.runtime.comm.chain import local_fold
    from perdure.runtime.replica.slots import SlotEngine

    task = make_task(d_model=32, n_layers=1, n_heads=2, dropout=0.0)
    B, S = 6, 3
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (B, 17), generator=g)
    weight = torch.ones(B)
    engine = SlotEngine(task.model, task.loss_fn, seed=0, slots=S)
    bufs = [engine.new_buffer() for _ in range(S)]
    per = B // S
    for s in range(S):
        batch = {
            "tokens": tokens[s * per : (s + 1) * per],
            "weight": weight[s * per : (s + 1) * per],
        }
        engine.compute(0, s, batch, bufs[s])
    total = engine.new_buffer()
    local_fold(bufs, total)
    engine.assign_grads(total, B)
    got = {n: p.grad.clone() for n, p in task.model.named_parameters()}

    task.model.zero_grad(set_to_none=True)
    (task.loss_fn(task.model, {"tokens": tokens, "weight": weight}) / B).backward()
    for n, p in task.model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
