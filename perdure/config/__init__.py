"""Config plumbing, the bottom layer: problem collection, TOML-to-dataclass building and
diffs of canonical configs.

Every component's config imports this package (for :class:`Checker`); it imports none of
them. The run config that composes them lives above them, in :mod:`perdure.run_config`.
"""

from perdure.config.build import build
from perdure.config.errors import Checker, ConfigError, Problem

MATH = {"math": True}
"""Field metadata that marks a field as math-affecting: it enters the config hash."""

__all__ = ["MATH", "Checker", "ConfigError", "Problem", "build"]
