"""The fp16 loss scale's pure parts (issue 36 item 6): its state machine, its config
fields' checks and their place in the config hash, a saved state's check, and a slot's
flag (an overflow is the scale's, a non-finite loss the data's). The runs are in
``test_precision.py``."""

from __future__ import annotations

import pytest
import torch

from examples.tiny_lm.task import loss_fn, make_task
from perdure.config import ConfigError
from perdure.run_config import config_from_dict, config_hash
from perdure.runtime.config import TrainConfig
from perdure.runtime.replica.layout import BAD, OVERFLOW
from perdure.runtime.replica.loss_scale import LossScale, ScaleRule
from perdure.runtime.replica.slots import SlotEngine

RULE = ScaleRule(init=8.0, growth_interval=3, growth_factor=4.0, backoff_factor=0.5,
                 min_scale=2.0)  # fmt: skip


def test_the_scale_grows_after_the_interval_and_backs_off_down_to_the_floor() -> None:
    s = RULE.initial()
    path = []
    for _ in range(4):
        s = s.applied(RULE)
        path.append((s.scale, s.clean))
    assert path == [(8.0, 1), (8.0, 2), (32.0, 0), (32.0, 1)]
    down = []
    b: LossScale | None = s
    while b is not None:
        down.append((b.scale, b.clean))
        b = b.backed_off(RULE)
    assert down == [(32.0, 1), (16.0, 0), (8.0, 0), (4.0, 0), (2.0, 0)]  # then None: the floor


def test_a_backoff_resets_the_clean_count_so_growth_waits_a_full_interval() -> None:
    s = RULE.initial().applied(RULE).applied(RULE)  # one step short of growing
    backed = s.backed_off(RULE)
    assert backed == LossScale(scale=4.0, clean=0)
    assert backed.applied(RULE).applied(RULE) == LossScale(scale=4.0, clean=2)


def test_the_rule_exists_under_fp16_only() -> None:
    assert ScaleRule.of(TrainConfig(precision="bf16")) is None
    rule = ScaleRule.of(TrainConfig(precision="fp16", loss_scale_init=1024))
    assert rule == ScaleRule(init=1024.0, growth_interval=2000, growth_factor=2.0,
                             backoff_factor=0.5, min_scale=1.0)  # fmt: skip


@pytest.mark.parametrize(
    "saved",
    [
        {"scale": 3.0, "clean": 0},  # not a power of two
        {"scale": 1.0, "clean": 0},  # below the floor
        {"scale": 8.0, "clean": 3},  # a full interval: it would have grown
        {"scale": 8.0},
        {"scale": 8, "clean": 0},  # an int: not what was saved
        [8.0, 0],
    ],
)
def test_a_saved_scale_the_rule_could_not_reach_is_refused_naming_the_field(saved: object) -> None:
    with pytest.raises(ValueError, match=r"ckpt-x: optimizer\.loss_scale must be"):
        LossScale.from_dict(saved, RULE, "ckpt-x")


def test_a_saved_scale_round_trips() -> None:
    s = LossScale(scale=2.0**40, clean=2)
    assert LossScale.from_dict(s.to_dict(), RULE, "x") == s


def test_bad_loss_scale_values_are_refused_naming_each_field() -> None:
    bad = {"precision": "fp16", "loss_scale_init": 1000.0, "loss_scale_growth_interval": 0,
           "loss_scale_growth_factor": 3.0, "loss_scale_backoff_factor": 1.0,
           "loss_scale_min": 0.0}  # fmt: skip
    with pytest.raises(ConfigError) as e:
        config_from_dict({"train": bad})
    assert [(p.key, p.value) for p in e.value.problems] == [
        ("train.loss_scale_min", 0.0),
        ("train.loss_scale_init", 1000.0),
        ("train.loss_scale_growth_interval", 0),
        ("train.loss_scale_growth_factor", 3.0),
        ("train.loss_scale_backoff_factor", 1.0),
    ]
    assert "power of two" in str(e.value)


def test_an_initial_scale_below_the_floor_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"train\.loss_scale_init: must be a power of two in "
                       r"\[train\.loss_scale_min \(64\.0\)"):  # fmt: skip
        config_from_dict({"train": {"loss_scale_init": 32.0, "loss_scale_min": 64.0}})


def test_the_scale_fields_enter_the_hash_under_fp16_only() -> None:
    def h(**train: object) -> str:
        return config_hash(config_from_dict({"train": train}))

    assert h() == h(loss_scale_init=1024.0, loss_scale_growth_interval=7)  # fp32: inert
    assert h(precision="fp16") != h(precision="fp16", loss_scale_init=1024.0)
    assert h(precision="fp16") != h(precision="fp16", loss_scale_growth_interval=7)
    assert h(precision="fp16") != h(precision="bf16")


def _slot(scale: float, poison: bool = False) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    task = make_task(d_model=32, n_layers=1, n_heads=2, max_len=64)
    if poison:
        with torch.no_grad():
            next(task.model.parameters()).fill_(float("nan"))
    engine = SlotEngine(task.model, loss_fn, seed=3, slots=2, precision="fp16")
    engine.scale = scale
    g = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(0, 256, (2, 65), generator=g), "weight": torch.ones(2)}
    out = engine.new_buffer()
    engine.compute(0, 1, batch, out)
    return float(engine.layout.flags(out)[1]), engine.layout.grads(out)


def test_an_fp16_slot_flags_an_overflow_apart_from_a_non_finite_loss() -> None:
    flag, grads = _slot(2.0**10)
    assert flag == 0.0 and bool(torch.isfinite(grads).all())
    flag, grads = _slot(2.0**30)  # the backward's float16 values overflow, the loss is finite
    assert flag == OVERFLOW and not bool(torch.isfinite(grads).all())
    assert _slot(2.0**10, poison=True)[0] == BAD  # a non-finite loss: the data path


def test_the_scale_is_undone_exactly_and_keeps_values_that_scale_1_flushes_to_zero() -> None:
    """Multiplying by a power of two commutes with float16's rounding wherever no value
    underflows or overflows: two such scales give the same bits once divided back. At
    scale 1 the smallest backward values flush to zero, which is what the scale is for."""
    at12, at16 = _slot(2.0**12)[1] / 2.0**12, _slot(2.0**16)[1] / 2.0**16
    assert torch.equal(at12, at16) and at12.dtype == torch.float32
    unscaled = _slot(1.0)[1]
    assert int((unscaled == 0).sum()) > int((at12 == 0).sum())


def test_autocast_follows_the_precision_and_refuses_an_unknown_one_naming_the_field() -> None:
    from perdure.runtime.replica.slots import autocast_for

    lin = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4)
    got = {}
    for precision in ("fp32", "bf16", "fp16"):
        with autocast_for("cpu", precision)():
            got[precision] = lin(x).dtype
    assert got == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    with pytest.raises(ValueError, match=r"train\.precision: must be 'fp32', 'bf16' or 'fp16'"):
        autocast_for("cpu", "fp8")
