"""``train.shard_reduce_slots``: ``each`` only where a streamed exact reduction can
reduce-scatter a slot inside a replica group, and a setting outside the config hash (a
performance choice: both values give the same bits, tests/integration/test_shard_slots.py)."""

from __future__ import annotations

from typing import Any

import pytest

from perdure.config.errors import ConfigError
from perdure.runtime.config import TrainConfig


@pytest.mark.parametrize(
    "train,rule",
    [
        ({"reduction": "chain", "shard_degree": 2}, "'each' needs train.reduction = 'exact'"),
        (
            {"reduction_exponents": "step", "shard_degree": 2},
            "'each' needs train.reduction = 'exact' with train.reduction_exponents = 'streamed'",
        ),
        (
            {"reduction_exponents": "carried", "reduction_bits": 64, "shard_degree": 2},
            "'each' needs train.reduction = 'exact' with train.reduction_exponents = 'streamed'",
        ),
        ({"shard_degree": 1}, "'each' needs train.shard_degree > 1"),
        ({"shard_degree": 2, "shard_reduce": "whole"}, "'each' needs train.shard_reduce"),
    ],
)
def test_each_without_a_streamed_scatter_in_groups_is_refused_naming_field_rule_and_value(
    train: dict[str, Any], rule: str
) -> None:
    with pytest.raises(ConfigError) as e:
        TrainConfig(shard_reduce_slots="each", **train)
    text = str(e.value)
    assert "shard_reduce_slots" in text and rule in text and "'each'" in text


def test_the_setting_is_outside_the_config_hash() -> None:
    from perdure.run_config import RunConfig, config_hash, with_overrides

    base = with_overrides(RunConfig(), train={"shard_degree": 2})
    each = with_overrides(base, train={"shard_reduce_slots": "each"})
    assert each != base
    assert config_hash(each) == config_hash(base)
