"""DiLoCo's math on one replica, without processes (``runtime/replica/outer.py``): the
int8 rounding, a virtual replica as a pure function of (outer parameters, step, replica),
the outer step as torch's Nesterov SGD, and the settings that cannot go with it."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch

from perdure.config import ConfigError
from perdure.run_config import RunConfig, canonical
from perdure.runtime.replica.outer import ef21_encode, ef21_update, quantize_int8
from perdure.runtime.replica.trainer import Trainer
from tests.runtime_support import small_config


def _trainer(dataset: Path, **outer: object) -> Trainer:
    """``outer.delay = 1`` with the exponents' step form (what it needs with fp32)."""
    train = {"reduction_exponents": "step"} if outer.get("delay") else {}
    cfg = small_config(
        dataset, workers=1, steps=4, slots=4, batch=16,
        outer={"replicas": 4, "inner_steps": 2, **outer}, train=train,
    )  # fmt: skip
    return Trainer(cfg)


def test_int8_rounds_each_block_to_seven_bits_below_its_own_peaks_power_of_two() -> None:
    # block 1: peak 1.5 = 0.75 * 2**1, step 2**-6; block 2: peak 0.2 < 0.25, step 2**-9
    x = torch.tensor([1.5, -0.5, 0.3, 1e-3, 0.2, -0.1, 0.0, 0.0, 0.0, 0.0])
    got = quantize_int8(x.clone(), 4)
    step1, step2 = 2.0**-6, 2.0**-9
    want = [96 * step1, -32 * step1, 19 * step1, 0.0, 102 * step2, -51 * step2, 0, 0, 0, 0]
    assert got.tolist() == want
    assert (got[:4] / step1).abs().max() <= 127 and (got[4:8] / step2).abs().max() <= 127


def test_a_replica_is_the_same_bits_in_any_order_and_leaves_the_outer_state_as_it_was(
    small_dataset: Path,
) -> None:
    a, b = _trainer(small_dataset), _trainer(small_dataset)
    before = a.digest()
    bufs = {r: a.layout.new_buffer() for r in (0, 2, 3)}
    for r in (3, 0, 2):
        assert a.compute_slots(1, range(r, r + 1), [bufs[r]])
    assert a.digest() == before  # parameters back, inner optimizer state empty
    other = b.layout.new_buffer()
    b.compute_slots(1, range(2, 3), [other])
    assert torch.equal(other, bufs[2])
    assert not torch.equal(bufs[0], bufs[2])  # replicas read data of their own
    lay = a.layout
    assert lay.flags(bufs[2]).tolist() == [0.0] * 4
    assert [i for i, v in enumerate(lay.losses(bufs[2]).tolist()) if v] == [2]


def test_a_kept_replica_is_copied_only_under_the_same_step_and_state_version(
    small_dataset: Path,
) -> None:
    """The streamed exponents (the default) compute a step twice when a prediction
    fails: the second pass copies the replica. The proof it is a copy: a change the
    state version does not name (made here by hand) is not seen until it moves."""
    tr = _trainer(small_dataset)
    first, again, moved = (tr.layout.new_buffer() for _ in range(3))
    assert tr.compute_slots(1, range(1, 2), [first])
    with torch.no_grad():
        tr.outer.params[0].add_(1.0)  # type: ignore[union-attr]
    assert tr.compute_slots(1, range(1, 2), [again])
    assert torch.equal(again, first)
    tr.state_version += 1
    assert tr.compute_slots(1, range(1, 2), [moved])
    assert not torch.equal(moved, first)


def test_the_outer_step_is_torchs_nesterov_sgd_on_the_mean_pseudo_gradient(
    small_dataset: Path,
) -> None:
    tr = _trainer(small_dataset, lr=0.7, momentum=0.9)
    params = tr.outer.params  # type: ignore[union-attr]
    twins = [copy.deepcopy(p.detach()).requires_grad_(True) for p in params]
    sgd = torch.optim.SGD(twins, lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    gen = torch.Generator().manual_seed(0)
    for t in range(3):
        total = tr.layout.new_buffer()
        tr.layout.grads(total).copy_(torch.randn(tr.layout.numel, generator=gen))
        mean = tr.layout.grads(total) / 4
        offset = 0
        for twin in twins:
            twin.grad = mean[offset : offset + twin.numel()].view_as(twin).clone()
            offset += twin.numel()
        tr.apply(t, total)
        sgd.step()
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(params, twins, strict=True))
    assert tr.next_step == 3


def test_a_state_without_the_outer_momentum_is_refused_naming_it(small_dataset: Path) -> None:
    tr = _trainer(small_dataset)
    _, optim, _ = tr.export()
    assert set(optim["outer"]) == {"momentum"}
    del optim["outer"]
    with pytest.raises(ValueError, match=r"optimizer\.outer\.momentum must be a float32 tensor"):
        tr._load_optimizer(optim, "ckpt/step-4")


def test_outer_replicas_must_equal_the_slots_and_off_leaves_every_hash_as_it_was(
    small_dataset: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"outer\.replicas.*must equal train\.slots \(8\)"):
        small_config(small_dataset, slots=8, outer={"replicas": 4})
    assert "outer" not in canonical(RunConfig())
    assert canonical(small_config(small_dataset, slots=4, outer={"replicas": 4}))["outer"] == {
        "replicas": 4
    }


def test_fp16_with_outer_replicas_is_refused_naming_the_precision(small_dataset: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.precision.*cannot be 'fp16' with outer"):
        small_config(small_dataset, slots=4, train={"precision": "fp16"}, outer={"replicas": 4})


def test_one_inner_sgd_step_and_a_plain_outer_step_are_the_synchronous_sgd_step(
    small_dataset: Path,
) -> None:
    """H = 1, inner SGD without momentum, outer lr 1 and no momentum: each replica's
    pseudo-gradient is lr x its slot's mean gradient, so the outer step is the synchronous
    step up to rounding (the same samples and randomness: replica r's inner step is slot
    r of the synchronous step)."""
    optim = {"name": "sgd", "momentum": 0.0, "schedule": "constant", "warmup_steps": 0,
             "grad_clip": None, "lr": 0.05}  # fmt: skip
    sync = Trainer(small_config(small_dataset, workers=1, steps=3, slots=4, optim=optim))
    outer = Trainer(small_config(
        small_dataset, workers=1, steps=3, slots=4, optim=optim,
        outer={"replicas": 4, "inner_steps": 1, "lr": 1.0, "momentum": 0.0},
    ))  # fmt: skip
    start = [p.detach().clone() for p in sync.model.parameters()]
    for t in range(3):
        for tr in (sync, outer):
            bufs = [tr.layout.new_buffer() for _ in range(4)]
            assert tr.compute_slots(t, range(4), bufs)
            tr.apply(t, torch.stack(bufs).sum(0))
    pairs = list(zip(sync.model.parameters(), outer.model.parameters(), strict=True))
    moved = max(float((p.detach() - s).abs().max()) for (p, _), s in zip(pairs, start, strict=True))
    apart = max(float((p.detach() - q.detach()).abs().max()) for p, q in pairs)
    assert moved > 1e-3 and apart < 1e-6, (moved, apart)


def _pseudo_gradient(seed: int, n: int = 4096) -> torch.Tensor:
    """Values spread over 8 binary orders of magnitude (most of a block's small values
    round to zero against its peak, as a pseudo-gradient's do)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.pow(2.0, torch.randint(-8, 0, (n,), generator=g))


def test_error_feedback_shrinks_the_rounding_error_of_a_slowly_moving_pseudo_gradient() -> None:
    """EF21 against plain int8 on a pseudo-gradient that moves by 1e-3 per outer step:
    the first step is plain int8's rounding (the estimate starts at zero); from the second
    on, the record holds the small difference and the estimate's error is below 1/100 of
    plain int8's, every step."""
    base, drift, block = _pseudo_gradient(3), 1e-3 * _pseudo_gradient(4), 256
    estimate = torch.zeros_like(base)
    for t in range(8):
        delta = base + t * drift
        plain = float((quantize_int8(delta.clone(), block) - delta).norm())
        q, e = ef21_encode(delta, estimate, block)
        estimate = ef21_update(estimate, q, e, block)
        err = float((estimate - delta).norm())
        assert err == plain if t == 0 else err < plain / 100, (t, err, plain)


def test_error_feedback_on_a_fixed_pseudo_gradient_cuts_the_error_100x_each_step() -> None:
    delta, block = _pseudo_gradient(5), 256
    estimate, errors = torch.zeros_like(delta), []
    for _ in range(4):
        q, e = ef21_encode(delta, estimate, block)
        estimate = ef21_update(estimate, q, e, block)
        errors.append(float((estimate - delta).norm()))
    assert all(b < a / 100 for a, b in itertools.pairwise(errors)), errors


def test_error_feedback_needs_int8_and_enters_the_hash(small_dataset: Path) -> None:
    outer = {"replicas": 4, "error_feedback": True}
    with pytest.raises(ConfigError, match=r"outer\.error_feedback.*needs precision = 'int8'"):
        small_config(small_dataset, slots=4, outer=outer)
    cfg = small_config(small_dataset, slots=4, outer={**outer, "precision": "int8"})
    assert canonical(cfg)["outer"] == {**outer, "precision": "int8"}


def test_the_replicas_estimates_travel_in_the_state_and_a_state_without_them_is_refused(
    small_dataset: Path,
) -> None:
    tr = _trainer(small_dataset, precision="int8", error_feedback=True)
    _, optim, _ = tr.export()
    est = optim["outer"]["estimates"]
    assert est.dtype == torch.float32 and list(est.shape) == [4, tr.layout.numel]
    other = _trainer(small_dataset, precision="int8", error_feedback=True)
    est.fill_(0.5)
    other._load_optimizer(optim, "the received state")
    assert other.outer is not None and other.outer.estimates is not None
    assert torch.equal(other.outer.estimates, est)
    del optim["outer"]["estimates"]
    with pytest.raises(ValueError, match=r"optimizer\.outer\.estimates must be a float32"):
        other._load_optimizer(optim, "ckpt/step-4")


def test_a_delayed_outer_step_applies_the_previous_steps_mean_and_step_zero_moves_nothing(
    small_dataset: Path,
) -> None:
    """``outer.delay = 1``: outer step 0 leaves the parameters as they were; step 1 moves
    them as the undelayed step 0 did (the same mean, the same momentum); the mean not yet
    applied is in the state."""
    late, now = _trainer(small_dataset, delay=1), _trainer(small_dataset)
    start = [p.detach().clone() for p in late.model.parameters()]
    gen = torch.Generator().manual_seed(1)
    totals = []
    for _ in range(2):
        total = late.layout.new_buffer()
        late.layout.grads(total).copy_(torch.randn(late.layout.numel, generator=gen))
        totals.append(total)
    late.apply(0, totals[0])
    assert all(
        torch.equal(p.detach(), q) for p, q in zip(late.model.parameters(), start, strict=True)
    )
    late.apply(1, totals[1])
    now.apply(0, totals[0])
    pairs = zip(late.model.parameters(), now.model.parameters(), strict=True)
    assert all(torch.equal(p.detach(), q.detach()) for p, q in pairs)
    _, optim, _ = late.export()
    assert torch.equal(optim["outer"]["pending"], late.layout.grads(totals[1]).div(4))
    with pytest.raises(ConfigError, match=r"outer\.delay.*must be one of \[0, 1\]"):
        small_config(small_dataset, slots=4, outer={"replicas": 4, "delay": 2})


def test_the_overlapped_delayed_step_moves_the_same_bits_and_an_undo_puts_the_state_back(
    small_dataset: Path,
) -> None:
    """The overlapped form of ``outer.delay = 1`` (``Trainer.apply_pending`` before the
    step's sum exists, ``settle_outer`` once it is in) is :meth:`Trainer.apply`'s
    arithmetic bit for bit; ``undo_outer`` (the reduction lost with a member) restores
    the parameters, the momentum, the pending mean and the step, under a new state
    version, and the step redone lands on the same bits."""
    late, split = _trainer(small_dataset, delay=1), _trainer(small_dataset, delay=1)
    gen = torch.Generator().manual_seed(2)
    totals = []
    for _ in range(4):
        total = late.layout.new_buffer()
        late.layout.grads(total).copy_(torch.randn(late.layout.numel, generator=gen))
        late.layout.losses(total).copy_(torch.rand(4, generator=gen))
        totals.append(total)
    for t in range(3):
        loss = late.apply(t, totals[t])
        split.apply_pending(t)
        assert split.settle_outer(t, totals[t]) == loss
        assert split.next_step == late.next_step == t + 1
        assert split.digest() == late.digest()
    before, version = split.digest(), split.state_version
    theta = [p.detach().clone() for p in split.model.parameters()]
    split.apply_pending(3)
    assert not torch.equal(next(split.model.parameters()).detach(), theta[0])
    with pytest.raises(AssertionError, match="in flight"):
        split.digest()  # no state is read while a reduction is in flight
    assert split.undo_outer() == 3 == split.next_step
    assert split.digest() == before and split.state_version > version + 1
    split.apply_pending(3)
    split.settle_outer(3, totals[3])
    late.apply(3, totals[3])
    assert split.digest() == late.digest()


def test_a_delayed_outer_step_with_fp32_needs_the_exponents_step_form(
    small_dataset: Path,
) -> None:
    """The overlapped reduction of ``outer.delay = 1`` is one pass over replicas already
    computed: carried exponents (a second pass on a missed prediction) are refused."""
    with pytest.raises(ConfigError, match=r"train\.reduction_exponents.*must be 'step'"):
        small_config(small_dataset, slots=4, outer={"replicas": 4, "delay": 1})
    small_config(small_dataset, slots=4, outer={"replicas": 4, "delay": 1, "precision": "int8"})
