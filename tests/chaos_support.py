"""Helpers shared by the chaos tests (no tests here): a recording ClusterControl."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from perdure.launch.base import Progress


@dataclass
class FakeControl:
    """A ClusterControl that records what fault injection asked of it."""

    alive: dict[str, str] = field(default_factory=dict)  # process name -> region
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    posted: dict[str, str] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    vetoed: set[str] = field(default_factory=set)
    now: Progress = field(default_factory=Progress)
    restart_ok: list[bool] = field(default_factory=list)  # answers of restart(), then True

    def signal(self, name: str, sig: int, *, expected_exit: bool = False) -> list[int]:
        self.calls.append(("signal", name, sig, expected_exit))
        return [1000 + sorted(self.alive).index(name)] if name in self.alive else []

    def processes(self, region: str) -> list[str]:
        return [n for n, r in self.alive.items() if r == region]

    def post(self, key: str, value: str) -> bool:
        self.posted[key] = value
        return True

    def restart(self, name: str) -> bool:
        ok = self.restart_ok.pop(0) if self.restart_ok else True
        self.calls.append(("restart", name, ok))
        return ok

    def veto_replacements(self, region: str) -> None:
        self.vetoed.add(region)

    def lift_veto(self, region: str) -> None:
        self.vetoed.discard(region)

    def progress(self) -> Progress:
        return self.now

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(record)
