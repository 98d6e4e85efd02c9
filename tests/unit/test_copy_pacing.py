"""The paced copy's parts (``runtime/member/copy_pacing.py``): pure functions, and the
agreement every member reaches from the template alone."""

from __future__ import annotations

import pytest
import torch

from perdure.checkpoint.tensors import flatten
from perdure.runtime.comm.swarm import StateCopyFailed
from perdure.runtime.member.copy_pacing import (
    PACE_KEY,
    Pacing,
    auto_budget,
    budget_of,
    groups,
    param_units,
    take,
    unit_of,
)


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[tuple[str, int]]]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)
    )
    o = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 8)).sum().backward()
    o.step()
    tensors, _ = flatten(m.state_dict(), o.state_dict())
    return m, o, [(k, t.numel() * t.element_size()) for k, t in tensors.items()]


def _units(m: torch.nn.Module, o: torch.optim.Optimizer) -> dict[str, int]:
    return param_units(m, [g["params"] for g in o.param_groups])


def test_a_parameter_and_its_optimizer_state_are_one_group() -> None:
    m, o, sizes = _state()
    units = _units(m, o)
    assert units == {
        "0.weight": 0,
        "0.bias": 1,
        "1.weight": 2,
        "1.bias": 3,
        "2.weight": 4,
        "2.bias": 5,
    }
    assert unit_of("model/0.weight", units) == 0
    assert unit_of("optimizer/state/4/exp_avg_sq", units) == 4
    assert unit_of("model/1.running_mean", units) is None  # a buffer: the first group
    gs = groups(sizes, units)
    assert len(gs) == 7
    assert set(gs[0][0]) == {
        "model/1.running_mean",
        "model/1.running_var",
        "model/1.num_batches_tracked",
    }
    assert set(gs[1][0]) == {
        "model/0.weight",
        "optimizer/state/0/step",
        "optimizer/state/0/exp_avg",
        "optimizer/state/0/exp_avg_sq",
    }
    assert gs[1][1] == 3 * 8 * 16 * 4 + 4  # the weight, its two moments, its step
    assert sorted(k for keys, _ in gs for k in keys) == sorted(k for k, _ in sizes)


def test_a_part_takes_whole_groups_within_its_budget_and_at_least_one() -> None:
    gs = [(("a",), 10), (("b",), 100), (("c",), 30), (("d",), 30)]
    assert take(gs, 0, 10) == 1
    assert take(gs, 1, 10) == 2  # a group larger than the budget goes alone
    assert take(gs, 2, 60) == 4
    assert take(gs, 0, 1 << 62) == 4
    assert take(gs, 4, 100) == 4


def test_a_frozen_parameter_is_a_group_of_its_own_not_the_first_ones() -> None:
    """A frozen base (no optimizer state) is most of a fine-tuning run's state: each of
    its tensors travels in a group of its own, not all in the first one."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    for p in [*m[1].parameters(), *m[2].parameters()]:
        p.requires_grad_(False)
    o = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    units = _units(m, o)
    assert units["1.weight"] == 2 and units["2.bias"] == 5
    tensors, _ = flatten(m.state_dict(), o.state_dict())
    gs = groups([(k, t.numel() * t.element_size()) for k, t in tensors.items()], units)
    assert [keys for keys, _ in gs[3:]] == [
        ("model/1.weight",),
        ("model/1.bias",),
        ("model/2.weight",),
        ("model/2.bias",),
    ]


def test_every_member_advances_through_the_templates_parts_alike() -> None:
    """Two members' views (a holder, a receiver) of a copy whose template budgets 600
    bytes a part: the same keys each part, the same end, nothing twice, nothing left."""
    m, o, sizes = _state()
    views = [Pacing(10, _units(m, o)), Pacing(10, _units(m, o))]
    seen: list[str] = []
    while not views[0].complete:
        keys = [v.select()(sizes, {PACE_KEY: 600}) for v in views]
        assert keys[0] == keys[1] and keys[0]
        assert views[0].select()(sizes, {PACE_KEY: 600}) == keys[0]  # the same on a 2nd call
        seen += keys[0]
        for v in views:
            v.advance()
    assert views[1].complete and views[0].parts == views[1].parts > 2
    assert sorted(seen) == sorted(k for k, _ in sizes)


def test_a_flush_takes_every_group_left_and_a_changed_template_is_refused() -> None:
    m, o, sizes = _state()
    p = Pacing(10, _units(m, o))
    p.select()(sizes, {PACE_KEY: 1})
    p.advance()
    rest = p.select(rest=True)(sizes, {PACE_KEY: 1})
    assert rest == {k for k, _ in sizes} - set(groups(sizes, _units(m, o))[0][0])
    p.advance()
    assert p.complete
    q = Pacing(10, _units(m, o))
    q.select()(sizes, {PACE_KEY: 1})
    with pytest.raises(StateCopyFailed, match="groups"):
        q.select()([x for x in sizes if unit_of(x[0], _units(m, o)) != 5], {PACE_KEY: 1})


@pytest.mark.parametrize("bad", [None, 0, -5, 1.5, "64", True])
def test_a_templates_budget_is_a_peers_input_checked(bad: object) -> None:
    with pytest.raises(StateCopyFailed, match=PACE_KEY):
        budget_of({PACE_KEY: bad} if bad is not None else {})
    assert budget_of({PACE_KEY: 7}) == 7


def test_an_automatic_part_fills_the_sources_compute_at_the_last_parts_rate() -> None:
    # 100 MB in 0.5 s, a step's compute 2 s: 80 % of 400 MB
    assert auto_budget(100_000_000, 0.5, 2.0) == 320_000_000
    assert auto_budget(100_000_000, 0.5, None) is None  # no slot measured yet
    assert auto_budget(0, 0.5, 2.0) is None


def test_a_partial_receiver_writes_no_tensor_of_a_checkpoint() -> None:
    """``saves.holders``: in a paced copy's window the others write the receiver's share
    (every tensor's holders less the partial ranks); outside it, the trainer's own."""
    from types import SimpleNamespace

    from perdure.runtime.member.saves import holders

    m, o, _ = _state()
    state = SimpleNamespace(model=m.state_dict(), optimizer=o.state_dict())
    trainer = SimpleNamespace(save_holders=lambda state, world: {})
    ep = SimpleNamespace(size=4, runner=SimpleNamespace(partial=frozenset({1})))
    got = holders(trainer, ep, state)  # type: ignore[arg-type]
    keys, _ = flatten(state.model, state.optimizer)
    assert got == {k: (0, 2, 3) for k in keys}
    ep.runner.partial = frozenset()
    assert holders(trainer, ep, state) == {}  # type: ignore[arg-type]


def test_a_non_finite_slot_is_re_run_on_the_next_whole_member() -> None:
    """``StepRunner.rerunner``: the next rank after the slot's owner, skipping the
    partial ones (a paced copy's receivers), wrapping around."""
    from types import SimpleNamespace

    from perdure.runtime.step import StepRunner

    run = SimpleNamespace(size=4, partial=frozenset({2, 3}))
    assert StepRunner.rerunner(run, 1) == 0  # type: ignore[arg-type]
    assert StepRunner.rerunner(run, 0) == 1  # type: ignore[arg-type]
    run.partial = frozenset()
    assert StepRunner.rerunner(run, 3) == 0  # type: ignore[arg-type]
