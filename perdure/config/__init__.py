"""Config plumbing, the bottom layer: problem collection, TOML-to-dataclass building and
diffs of canonical configs.

Every component's config imports this package (for :class:`Checker`); it imports none of
them. The run config that composes them lives above them, in :mod:`perdure.run_config`.
"""

from perdure.config.build import build
from perdure.config.errors import Checker, ConfigError, Problem

MATH = {"math": True}
"""Field metadata that marks a field as math-affecting: it enters the config hash."""

MATH_ADDED = {"math": True, "hash_default": False}
"""A math field added after runs existed, whose default is the math they already did: at
its default it is left out of the config hash, so their checkpoints keep their hash and
resume without ``--allow-config-change``; any other value enters the hash."""

__all__ = ["MATH", "MATH_ADDED", "Checker", "ConfigError", "Problem", "build"]
