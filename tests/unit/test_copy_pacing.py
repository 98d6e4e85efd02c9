"""The paced copy's parts (``runtime/member/copy_pacing.py``): pure functions."""

from __future__ import annotations

import pytest
import torch

from perdure.checkpoint.tensors import flatten
from perdure.runtime.comm.swarm import StateCopyFailed
from perdure.runtime.member.copy_pacing import Pacing, param_units, parts, unit_of


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


def test_a_parameter_and_its_optimizer_state_are_one_unit() -> None:
    m, o, _ = _state()
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
    assert unit_of("model/1.running_mean", units) is None  # a buffer: the first part
    assert unit_of("optimizer/param_groups/0/lr", units) is None


def test_parts_hold_whole_units_within_the_budget_and_every_key_once() -> None:
    m, o, sizes = _state()
    units = _units(m, o)
    got = parts(sizes, units, budget=600, most=100)
    assert sorted(k for p in got for k in p) == sorted(k for k, _ in sizes)
    by_key = dict(sizes)
    for p in got:
        ids = {unit_of(k, units) for k in p} - {None}
        for u in ids:  # every key of each of its units
            assert {k for k, _ in sizes if unit_of(k, units) == u} <= p
        if len(ids) > 1:
            assert sum(by_key[k] for k in p) <= 600
    assert {k for k, _ in sizes if unit_of(k, units) is None} <= got[0]
    # 0.weight (8x16 floats, x3 with its moments: 1536 bytes) is larger than the budget:
    # a part of its own
    first_weight = next(p for p in got if "model/0.weight" in p)
    assert {unit_of(k, units) for k in first_weight} - {None} == {0}


def test_parts_are_capped_by_the_steps_left_and_one_part_is_the_whole_state() -> None:
    m, o, sizes = _state()
    units = _units(m, o)
    many = parts(sizes, units, budget=1, most=100)
    assert len(many) == 7  # the loose keys and each parameter's unit
    capped = parts(sizes, units, budget=1, most=3)
    assert len(capped) == 3 and capped[:2] == many[:2]
    assert capped[2] == frozenset().union(*many[2:])
    assert parts(sizes, units, budget=1 << 30, most=100) == [frozenset(k for k, _ in sizes)]
    with pytest.raises(ValueError, match="budget and most"):
        parts(sizes, units, budget=0, most=1)


def test_a_template_whose_parts_differ_from_a_holders_own_is_refused() -> None:
    m, o, sizes = _state()
    pacing = Pacing(10, _units(m, o), 600, 100)
    pacing.derive(sizes)
    assert pacing.count > 2 and pacing.end == 10 + pacing.count
    assert pacing.part_at(10) is None and pacing.part_at(11) == 1
    assert pacing.part_at(10 + pacing.count) is None
    with pytest.raises(StateCopyFailed, match="differ"):
        pacing.derive(sizes[:-1])
    pacing.sent, pacing.flushed = 2, 12
    assert pacing.end == 13 and pacing.part_at(12) is None
    assert pacing.rest()(sizes) == frozenset().union(*pacing.parts[2:])


def test_a_frozen_parameter_is_a_unit_of_its_own_not_the_first_parts() -> None:
    """A frozen base (no optimizer state) is most of a fine-tuning run's state: each of
    its tensors travels in a part of its own, not all in the first part."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    for p in [*m[1].parameters(), *m[2].parameters()]:
        p.requires_grad_(False)
    o = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    units = _units(m, o)
    assert units == {
        "0.weight": 0,
        "0.bias": 1,
        "1.weight": 2,
        "1.bias": 3,
        "2.weight": 4,
        "2.bias": 5,
    }
    tensors, _ = flatten(m.state_dict(), o.state_dict())
    sizes = [(k, t.numel() * t.element_size()) for k, t in tensors.items()]
    got = parts(sizes, units, budget=16384 + 256, most=100)  # a weight and a bias
    assert [sorted(p) for p in got] == [
        ["model/0.bias", "model/0.weight", "model/1.weight"],
        ["model/1.bias", "model/2.weight"],
        ["model/2.bias"],
    ]
