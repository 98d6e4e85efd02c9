"""The run config: one TOML file mapped onto the components' config dataclasses.

The math-affecting fields (marked with ``metadata=MATH``) form the *canonical config*,
whose SHA-256 is the config hash written into every checkpoint. Worker counts, regions,
ports, paths, checkpoint and logging settings are not part of it: they decide who computes
what, which by the design invariant cannot change a bit.

What the config file does not say but the math depends on is the run's *identity*
(``runtime.replica.identity``): the dataset's version id and the task's actual recipe (its
optimizer's hyperparameters, its scheduler, its loss reduction). The trainer and the
launcher's preflight add it under the canonical key ``identity``; ``config_hash(config)``
without it is the hash of the file alone (``perdure config``'s first line).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from perdure.chaos.config import ChaosConfig, check_targets
from perdure.checkpoint.config import CheckpointConfig
from perdure.config.build import build
from perdure.config.digest import hash_canonical
from perdure.config.errors import Checker, ConfigError
from perdure.data.config import DataConfig
from perdure.metrics.config import MetricsConfig
from perdure.run_config.launch import RayConfig
from perdure.runtime.config import (
    ClusterConfig,
    EvalConfig,
    OptimConfig,
    OuterConfig,
    TaskConfig,
    TrainConfig,
)


@dataclass(kw_only=True, frozen=True)
class RunOptions:
    """Where a run writes and how it shows itself; none of it changes the math."""

    dir: str | None = None
    """Run directory (events, metrics, checkpoints, summary); default ``runs/<run-id>``."""
    live_view: bool = True
    """Show the live terminal view when standard output is a terminal."""
    base_dir: str | None = None
    """Directory the config's relative paths (``data.dataset``) and the task's module
    (``task.entry``, when it is not an installed package) are found from, itself relative
    to the config file's directory; default: the config file's directory (for a config
    built in Python, the working directory of ``perdure.run``). Set by ``load_config`` to
    an absolute path, so that every process of the run, started from any directory on any
    host, finds the same files."""
    launcher: Literal["local", "ray"] = "local"
    """What starts the run's processes: ``local`` (processes on this machine) or ``ray``
    (Ray actors on a cluster, see ``[ray]``); ``perdure run --launcher`` overrides it."""


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """A whole run. Each section is owned by the component that uses it."""

    task: TaskConfig = field(default_factory=TaskConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunOptions = field(default_factory=RunOptions)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        c = Checker()
        names = {f"{r.name}-{i}" for r in self.cluster.regions for i in range(64)}
        regions = {r.name for r in self.cluster.regions}
        check_targets(self.chaos, names, regions, c)
        c.check(
            not (self.cluster.data_plane == "nccl" and self.train.device == "cpu"),
            "cluster.data_plane",
            "'nccl' carries CUDA tensors: it needs train.device = 'cuda'",
            self.cluster.data_plane,
        )
        workers = sum(r.workers for r in self.cluster.regions)
        c.check(
            workers >= self.train.shard_degree,
            "train.shard_degree",
            f"must be at most the cluster's worker count ({workers}): a replica group is "
            "that many workers",
            self.train.shard_degree,
        )
        c.check(
            not (self.eval.every_steps and self.train.shard_params),
            "eval.every_steps",
            "cannot be set with train.shard_params: a member evaluates the whole model, and "
            "with its parameters sharded at rest it holds only its shard",
            self.eval.every_steps,
        )
        _check_outer(self, c)
        c.done()


def _check_outer(config: RunConfig, c: Checker) -> None:
    """DiLoCo's settings against the rest: a slot is a virtual replica, and one replica's
    inner steps run whole on one worker (no replica groups, ``runtime/replica/outer.py``)."""
    outer, train = config.outer, config.train
    if not outer.on:
        return
    c.check(
        outer.replicas == train.slots,
        "outer.replicas",
        f"must equal train.slots ({train.slots}): each slot of an outer step is one "
        "virtual replica",
        outer.replicas,
    )
    c.check(
        train.shard_degree == 1,
        "train.shard_degree",
        "must be 1 with outer.replicas set: a virtual replica's inner steps run on one "
        "worker (replica groups inside a region are not built for DiLoCo)",
        train.shard_degree,
    )
    c.check(
        outer.delay == 0
        or outer.precision == "int8"
        or train.reduction != "exact"
        or train.reduction_exponents == "step",
        "train.reduction_exponents",
        "must be 'step' with outer.delay = 1 and fp32 pseudo-gradients: the outer "
        "reduction runs behind the next step's replicas, and carried exponents would make "
        "it a second pass over replicas computed before (not built)",
        train.reduction_exponents,
    )
    c.check(
        train.precision != "fp16",
        "train.precision",
        "cannot be 'fp16' with outer.replicas set: the loss scale's overflow verdict is a "
        "step's, and an outer step's inner steps run inside one slot (use 'bf16' or 'fp32')",
        train.precision,
    )


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a TOML run config; every problem of the file is reported at once."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError([], source=f"{path} (no such file)") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([], source=f"{path} (not valid TOML: {e})") from None
    run = data.get("run")
    if isinstance(run, dict) and isinstance(run.get("base_dir", "."), str):
        base = (path.parent / run.get("base_dir", ".")).resolve()
        data = {**data, "run": {**run, "base_dir": str(base)}}
    elif run is None:
        data = {**data, "run": {"base_dir": str(path.parent.resolve())}}
    return config_from_dict(data, source=str(path))


def anchored(config: RunConfig) -> RunConfig:
    """``config`` with ``run.base_dir`` absolute (the working directory when unset), as
    the processes of a run must receive it: they may start anywhere."""
    base = config.run.base_dir
    if base is not None and Path(base).is_absolute():
        return config
    root = Path.cwd() / (base or ".")
    return with_overrides(config, run={"base_dir": str(root.resolve())})


def resolve_path(config: RunConfig, value: str) -> str:
    """A path of the config as the processes of the run open it: a URL (``s3://...``) or
    an absolute path as given, a relative one under ``run.base_dir`` (or the working
    directory, for a config that has none)."""
    if "://" in value or Path(value).is_absolute():
        return value
    return str(Path(config.run.base_dir or Path.cwd()) / value)


def dataset_path(config: RunConfig) -> str:
    """Where ``data.dataset`` is, for every process of the run."""
    return resolve_path(config, config.data.dataset)


def config_from_dict(data: dict[str, Any], source: str | None = None) -> RunConfig:
    try:
        return build(RunConfig, data)
    except ConfigError as e:
        raise ConfigError(e.problems, source=source) from None


def to_dict(config: Any) -> dict[str, Any]:
    """The whole config as plain data (TOML/JSON-able)."""
    return dataclasses.asdict(config)


def canonical(config: RunConfig, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """The math-affecting part of the config, as plain data with sorted keys, with the
    run's identity (dataset version, recipe) under ``identity`` when given."""
    out: dict[str, Any] = {}
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        math = {
            f.name: _plain(_hashed(value, f))
            for f in dataclasses.fields(value)
            if f.metadata.get("math")
            and not _default_left_out(f, getattr(value, f.name))
            and not _absent(value, f)
        }
        if math:
            out[section.name] = math
    if identity is not None:
        out["identity"] = identity
    return out


def _default_left_out(f: dataclasses.Field[Any], value: Any) -> bool:
    """A ``MATH_ADDED`` field at its default: not in the hash (``perdure.config``)."""
    return f.metadata.get("hash_default") is False and value == f.default


def _absent(section: Any, f: dataclasses.Field[Any]) -> bool:
    """A ``math_only_if`` field whose sibling has another value: not in the hash."""
    only = f.metadata.get("only_if")
    return only is not None and getattr(section, only[0]) != only[1]


def _hashed(section: Any, f: dataclasses.Field[Any]) -> Any:
    """The value ``f`` enters the hash with: its own, or, for a field inert in this
    section (``perdure.config.math_unless``), the value it was always hashed as."""
    inert = f.metadata.get("inert_unless")
    if inert is not None and getattr(section, inert[0]) != inert[1]:
        return inert[2]
    return getattr(section, f.name)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def config_hash(config: RunConfig, identity: dict[str, Any] | None = None) -> str:
    """SHA-256 of the canonical config (with the run's identity when given), as
    ``sha256:<hex>``."""
    return hash_canonical(canonical(config, identity))


def with_overrides(config: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """A copy of ``config`` with some fields of some sections replaced, re-validated."""
    data = to_dict(config)
    for name, fields in sections.items():
        data[name].update(fields)
    return config_from_dict(data)
