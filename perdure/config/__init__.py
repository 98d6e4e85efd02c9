"""Config plumbing: problem collection and TOML-to-dataclass building.

The run config itself lives in :mod:`perdure.config.run`, imported explicitly, so that the
component configs (which import this package for :class:`Checker`) do not form a cycle.
"""

from perdure.config.build import build
from perdure.config.errors import Checker, ConfigError, Problem

MATH = {"math": True}
"""Field metadata that marks a field as math-affecting: it enters the config hash."""

__all__ = ["MATH", "Checker", "ConfigError", "Problem", "build"]
