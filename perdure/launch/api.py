"""``perdure.run(config)``: the programmatic twin of ``perdure run CONFIG``."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from perdure import events as ev
from perdure.checkpoint.config import CheckpointConfig, checkpoint_root
from perdure.config.errors import ConfigError, Problem
from perdure.launch.local import LocalLauncher
from perdure.launch.lock import RunDirLock
from perdure.launch.supervisor import Supervisor
from perdure.run_config import RunConfig, config_hash, with_overrides


def spread_workers(config: RunConfig, workers: int) -> RunConfig:
    """Spread ``workers`` over the configured regions, round robin, in region order."""
    regions = config.cluster.regions
    counts = [
        workers // len(regions) + (1 if i < workers % len(regions) else 0)
        for i in range(len(regions))
    ]
    new = [{"name": r.name, "workers": c} for r, c in zip(regions, counts, strict=True)]
    return with_overrides(config, cluster={"regions": new})


def default_run_dir(config: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{config_hash(config)[7:15]}"


def resolve_resume(
    resume: str | None, run_dir: Path, checkpoints: CheckpointConfig | None = None
) -> str | None:
    """``latest`` (in this run dir), a run directory, or a checkpoint directory; a run
    directory's checkpoints are where ``checkpoints.dir`` puts them."""
    if resume is None:
        return None
    from perdure.checkpoint import latest_checkpoint

    cc = checkpoints or CheckpointConfig()
    if resume == "latest":
        root = checkpoint_root(cc, run_dir)
        found = latest_checkpoint(root)
        if found is None:
            raise FileNotFoundError(f"--resume latest: no intact checkpoint under {root}")
        return str(found)
    p = Path(resume)
    if checkpoint_root(cc, p).is_dir():
        found = latest_checkpoint(checkpoint_root(cc, p))
        if found is None:
            raise FileNotFoundError(f"--resume {resume}: no intact checkpoint in it")
        return str(found)
    if not p.exists():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint")
    return str(p)


L = TypeVar("L", bound=Supervisor)
"""A launcher's type: :func:`with_chaos` returns the launcher it was given."""


def local_launcher(
    config: RunConfig,
    run_dir: Path,
    *,
    resume: str | None = None,
    timeout_s: float = 3600.0,
    allow_config_change: bool = False,
) -> LocalLauncher:
    """The local launcher for ``config``, with the fault schedule's driver attached when the
    schedule has faults (a fault-free run's monitor loop runs no chaos code)."""
    launcher = LocalLauncher(
        config,
        run_dir,
        resume=resume,
        timeout_s=timeout_s,
        allow_config_change=allow_config_change,
    )
    return with_chaos(launcher, config)


def with_chaos(launcher: L, config: RunConfig) -> L:
    """``launcher`` with the fault schedule's driver attached when the schedule has faults."""
    if config.chaos.faults:
        from perdure.chaos.driver import ChaosDriver

        launcher.hooks.append(ChaosDriver(config.chaos, launcher))
    return launcher


LAUNCHERS = ("local", "ray")
"""The launchers ``perdure.run`` knows (``run.launcher``, ``perdure run --launcher``): the
local one, and Ray's (``launch/ray.py``, imported only when chosen)."""


@contextlib.contextmanager
def prepared(config: RunConfig, name: str) -> Iterator[Any]:
    """What launcher ``name`` needs before the run directory is made (for Ray: a
    connection to a cluster checked to host the run), held until the run ends."""
    if name == "ray":
        from perdure.launch.ray import connect

        with connect(config) as cluster:
            yield cluster
    else:
        yield None


def make_launcher(
    name: str, config: RunConfig, run_dir: Path, held: Any, **options: Any
) -> Supervisor:
    """Launcher ``name`` for ``config`` (``held``: what :func:`prepared` yielded)."""
    if name == "ray":
        from perdure.launch.ray import RayLauncher

        return with_chaos(RayLauncher(config, run_dir, cluster=held, **options), config)
    return local_launcher(config, run_dir, **options)


def run(
    config: RunConfig,
    *,
    run_dir: str | Path | None = None,
    resume: str | None = None,
    live: bool = False,
    timeout_s: float = 3600.0,
    allow_config_change: bool = False,
    source: str | None = None,
    launcher: str | None = None,
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Train ``config``; returns the summary. ``launcher``: ``local`` (processes on this
    machine) or ``ray`` (actors on a Ray cluster, ``launch/ray.py``); default
    ``config.run.launcher``. ``ray_address`` overrides ``config.ray.address``.

    Before any process starts, preflight (``launch/preflight.py``) checks what every
    worker would otherwise fail on identically, raising :class:`PreflightError` (a
    ``ConfigError``) naming each problem, and builds the stdlib dataset when the config
    names the shipped default path and nothing is there. ``allow_config_change`` resumes
    from a checkpoint written under another config hash; every worker records the
    override in the decision log. ``source`` names the config file in messages.

    The run directory is created private to the user (checkpoints and logs hold the model
    and the data's provenance) and held by one launcher at a time (``launch/lock.py``)."""
    from perdure.launch.preflight import preflight

    name = launcher or config.run.launcher
    if name not in LAUNCHERS:
        raise ConfigError([Problem("--launcher", f"must be one of {list(LAUNCHERS)}", name)])
    if ray_address is not None:
        config = with_overrides(config, ray={"address": ray_address})
    rd = Path(run_dir) if run_dir else default_run_dir(config)
    with contextlib.ExitStack() as held:
        if rd.exists():  # someone may be running there: refuse before anything else
            held.enter_context(RunDirLock(rd))
        if resume is None and (rd / "events.jsonl").exists():
            raise FileExistsError(
                f"--run-dir {rd}: already holds a run (events.jsonl); a new run needs a new "
                "directory, and --resume latest continues this one from its newest checkpoint"
            )
        ckpt = resolve_resume(resume, rd, config.checkpoint)
        checked = preflight(
            config, source=source, resume=ckpt, allow_config_change=allow_config_change,
            build_default=True, say=lambda line: print(line, file=sys.stderr), launcher=name,
        )  # fmt: skip
        cluster = held.enter_context(prepared(config, name))
        if not rd.exists():  # created only once the run can start: a refusal leaves nothing
            # 0711: another account (a web server) may open report.html (0644) by its name,
            # not list the directory; everything else a run writes is 0600/0700 (umask 077).
            rd.mkdir(mode=0o711, parents=True)
            rd.chmod(0o711)  # mkdir's mode is masked by the caller's umask
            held.enter_context(RunDirLock(rd))
        held.enter_context(private_files())
        started = make_launcher(
            name, config, rd, cluster,
            resume=ckpt, timeout_s=timeout_s, allow_config_change=allow_config_change,
        )  # fmt: skip
        if checked.override is not None:  # the operator's decision, logged once for the run
            started.events.write({"event": ev.DECISION, "by": "launcher", **checked.override})
        return run_with_view(started, config.train.steps) if live else started.run()


@contextlib.contextmanager
def private_files() -> Iterator[None]:
    """Files and directories made while the block runs, by this process and the processes
    it starts, are the user's alone (umask 077); the caller's umask comes back after."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def run_with_view(launcher: Supervisor, steps: int) -> dict[str, Any]:
    """``launcher.run()`` with the live view attached as its last hook (after chaos, so
    that a tick's faults show in the same refresh)."""
    from perdure.launch.view import LiveView

    with LiveView(launcher.run_dir, steps, launcher) as view:
        launcher.hooks.append(view)
        return launcher.run()


__all__ = [
    "LAUNCHERS",
    "local_launcher",
    "make_launcher",
    "resolve_resume",
    "run",
    "spread_workers",
]
