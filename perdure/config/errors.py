"""Config problems are collected, never raised one at a time.

A user who fixes one typo only to meet the next one loses a run's worth of patience, so
every validator appends to a list of :class:`Problem` and raises one :class:`ConfigError`
that lists them all, each naming the key, the rule it broke and the value it got.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One broken rule: where (dotted key), what rule, and the value received."""

    key: str
    rule: str
    value: object

    def __str__(self) -> str:
        return f"{self.key}: {self.rule} (got {self.value!r})"

    def under(self, prefix: str) -> Problem:
        key = f"{prefix}.{self.key}" if prefix and self.key else prefix or self.key
        return Problem(key=key, rule=self.rule, value=self.value)


class ConfigError(ValueError):
    """Every problem of one config (file, section or dataclass), reported at once."""

    def __init__(self, problems: list[Problem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"config {self.source}" if self.source else "config"
        n = len(self.problems)
        lines = [f"{where}: {n} problem{'s' if n != 1 else ''}"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

    def under(self, prefix: str) -> ConfigError:
        return ConfigError([p.under(prefix) for p in self.problems], self.source)


class Checker:
    """Collects the problems of one dataclass so that ``__post_init__`` reports all of them.

    Usage::

        def __post_init__(self) -> None:
            c = Checker()
            c.check(self.lr > 0, "lr", "must be > 0", self.lr)
            c.done()
    """

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def check(self, ok: bool, key: str, rule: str, value: object) -> bool:
        if not ok:
            self.problems.append(Problem(key=key, rule=rule, value=value))
        return ok

    def positive(self, key: str, value: float) -> bool:
        """A finite number > 0 (an infinite learning rate or timeout is never meant)."""
        return self.check(_finite(value) and value > 0, key, "must be a finite number > 0", value)

    def non_negative(self, key: str, value: float) -> bool:
        ok = _finite(value) and value >= 0
        return self.check(ok, key, "must be a finite number >= 0", value)

    def one_of(self, key: str, value: object, allowed: tuple[object, ...]) -> bool:
        return self.check(value in allowed, key, f"must be one of {list(allowed)}", value)

    def extend(self, error: ConfigError, prefix: str = "") -> None:
        self.problems += [p.under(prefix) for p in error.problems]

    def done(self) -> None:
        if self.problems:
            raise ConfigError(self.problems)


def _finite(value: float) -> bool:
    return isinstance(value, int) or math.isfinite(value)
