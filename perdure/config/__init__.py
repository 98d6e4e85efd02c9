"""Config plumbing, the bottom layer: problem collection, TOML-to-dataclass building and
diffs of canonical configs.

Every component's config imports this package (for :class:`Checker`); it imports none of
them. The run config that composes them lives above them, in :mod:`perdure.run_config`.
"""

from perdure.config.build import RenamedWarning, build, renamed_value
from perdure.config.errors import Checker, ConfigError, Problem

MATH = {"math": True}
"""Field metadata that marks a field as math-affecting: it enters the config hash."""

MATH_ADDED = {"math": True, "hash_default": False}
"""A math field added after runs existed, whose default is the math they already did: at
its default it is left out of the config hash, so their checkpoints keep their hash and
resume without ``--allow-config-change``; any other value enters the hash."""


def renamed(old_names: dict[str, str]) -> dict[str, object]:
    """Metadata of a field some of whose values were renamed (old name to new): a config
    that gives an old name loads, with a DeprecationWarning (``renamed_value``)."""
    return {"renamed": old_names}


def math_unless(sibling: str, value: object, hashed_as: object) -> dict[str, object]:
    """Metadata of a math field that matters only while the field ``sibling`` of the same
    section equals ``value``: otherwise it enters the config hash as ``hashed_as`` (the
    value every run had before its default changed), so that it cannot change the hash of
    a run it does not touch (``train.reduction_bits`` under the chain reduction)."""
    return {"math": True, "inert_unless": (sibling, value, hashed_as)}


def math_only_if(sibling: str, value: object) -> dict[str, object]:
    """Metadata of a math field that exists for one setting of the field ``sibling`` of
    the same section (``train.loss_scale_*`` under ``train.precision = "fp16"``): it
    enters the config hash only while ``sibling`` equals ``value`` (then always, at its
    default too), and is left out otherwise, so that it changes no other run's hash."""
    return {"math": True, "only_if": (sibling, value)}


__all__ = [
    "MATH",
    "MATH_ADDED",
    "Checker",
    "ConfigError",
    "Problem",
    "RenamedWarning",
    "build",
    "math_only_if",
    "math_unless",
    "renamed",
    "renamed_value",
]
