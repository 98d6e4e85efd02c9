"""The run config: one TOML file mapped onto the components' config dataclasses.

The math-affecting fields (marked with ``metadata=MATH``) form the *canonical config*,
whose SHA-256 is the config hash written into every checkpoint. Worker counts, regions,
ports, paths, checkpoint and logging settings are not part of it: they decide who computes
what, which by the design invariant cannot change a bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from perdure.chaos.config import ChaosConfig, check_targets
from perdure.checkpoint.config import CheckpointConfig
from perdure.config.build import build
from perdure.config.errors import Checker, ConfigError
from perdure.data.config import DataConfig
from perdure.run_config.launch import RayConfig
from perdure.runtime.config import ClusterConfig, OptimConfig, TaskConfig, TrainConfig


@dataclass(kw_only=True, frozen=True)
class RunOptions:
    """Where a run writes and how it shows itself; none of it changes the math."""

    dir: str | None = None
    """Run directory (events, metrics, checkpoints, summary); default ``runs/<run-id>``."""
    live_view: bool = True
    """Show the live terminal view when standard output is a terminal."""
    launcher: Literal["local", "ray"] = "local"
    """What starts the run's processes: ``local`` (processes on this machine) or ``ray``
    (Ray actors on a cluster, see ``[ray]``); ``perdure run --launcher`` overrides it."""


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """A whole run. Each section is owned by the component that uses it."""

    task: TaskConfig = field(default_factory=TaskConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    run: RunOptions = field(default_factory=RunOptions)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        c = Checker()
        names = {f"{r.name}-{i}" for r in self.cluster.regions for i in range(64)}
        regions = {r.name for r in self.cluster.regions}
        check_targets(self.chaos, names, regions, c)
        c.done()


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a TOML run config; every problem of the file is reported at once."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError([], source=f"{path} (no such file)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([], source=f"{path} (not valid TOML: {e})") from None
    return config_from_dict(data, source=str(path))


def config_from_dict(data: dict[str, Any], source: str | None = None) -> RunConfig:
    try:
        return build(RunConfig, data)
    except ConfigError as e:
        raise ConfigError(e.problems, source=source) from None


def to_dict(config: Any) -> dict[str, Any]:
    """The whole config as plain data (TOML/JSON-able)."""
    return dataclasses.asdict(config)


def canonical(config: RunConfig) -> dict[str, Any]:
    """The math-affecting part of the config, as plain data with sorted keys."""
    out: dict[str, Any] = {}
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        math = {
            f.name: _plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.metadata.get("math")
        }
        if math:
            out[section.name] = math
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def canonical_json(config: RunConfig) -> str:
    return json.dumps(canonical(config), sort_keys=True, separators=(",", ":"))


def config_hash(config: RunConfig) -> str:
    """SHA-256 of the canonical config, as ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(canonical_json(config).encode()).hexdigest()


def with_overrides(config: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """A copy of ``config`` with some fields of some sections replaced, re-validated."""
    data = to_dict(config)
    for name, fields in sections.items():
        data[name].update(fields)
    return config_from_dict(data)
