"""Optimizer state dicts cut and merged by shard (plain dicts: no torch calls).

A torch optimizer's ``state_dict()`` holds ``"state"`` (per parameter index, in
param-group order) and ``"param_groups"`` (hyperparameters, identical on every rank).
A shard's part keeps the param groups and the states of the parameters it owns; a
recipe's scheduler state (under ``"scheduler"``) is identical on every rank and travels
with every part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def part(state: dict[str, Any], owner: Sequence[int], shard: int) -> dict[str, Any]:
    """The part of ``state`` that shard ``shard`` owns."""
    kept = {i: s for i, s in state["state"].items() if owner[int(i)] == shard}
    return {**state, "state": kept}


def merge(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state from the parts of every shard (their param groups are equal)."""
    assert parts, "merge of no parts"
    states: dict[Any, Any] = {}
    for p in parts:
        states.update(p["state"])
    return {**parts[0], "state": dict(sorted(states.items(), key=lambda kv: int(kv[0])))}
