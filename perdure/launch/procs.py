"""Starting perdure's processes: the coordinator and workers, as a cluster manager would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

from perdure.launch.zygote import Zygote
from perdure.lifecycle import PARENT_ENV
from perdure.runtime.entry import TOKEN_ENV, WorkerSpec


class Process(Protocol):
    """What the launcher needs of a process: ``subprocess.Popen`` or a zygote's child."""

    returncode: int | None

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "perdure", *args]


def start_coordinator(
    config_json: Path,
    run_dir: Path,
    token: str,
    *,
    resume: str | None,
    name: str,
    expected: int,
    log: Path,
    allow_config_change: bool = False,
    writes_summary: bool = False,
    zygote: Zygote | None = None,
) -> Process:
    """``writes_summary``: the caller writes summary.json itself once every process has
    stopped (the local launcher), so the coordinator does not (``--no-summary``). With a
    ready ``zygote``, the coordinator is forked from it (no Python start-up, no imports);
    without, it is a new ``python -m perdure coordinator``."""
    args = coordinator_args(
        config_json,
        run_dir,
        resume=resume,
        name=name,
        expected=expected,
        allow_config_change=allow_config_change,
        writes_summary=writes_summary,
    )
    if zygote is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        forked = zygote.spawn_command(args, child_env(token), log)
        if forked is not None:
            return forked
    return spawn(python_cmd(*args), token, log)


def coordinator_args(
    config_json: Path,
    run_dir: Path,
    *,
    resume: str | None,
    name: str,
    expected: int,
    allow_config_change: bool = False,
    writes_summary: bool = False,
    host: str | None = None,
    advertise: str | None = None,
) -> list[str]:
    """The ``perdure coordinator`` arguments of coordinator ``name`` (or ``standby``);
    ``host`` and ``advertise``: its ``--host`` and ``--advertise`` (default: the config's)."""
    args = [
        "coordinator",
        "--config-json",
        str(config_json),
        "--run-dir",
        str(run_dir),
        "--ports-file",
        str(run_dir / f"{name}.json"),
        "--expected-workers",
        str(expected),
    ]
    if resume:
        args += ["--resume", resume]
    if allow_config_change:
        args.append("--allow-config-change")
    if host is not None:
        args += ["--host", host]
    if advertise is not None:
        args += ["--advertise", advertise]
    if name == "standby":
        # It may share the primary's host (always, for the local launcher), where the
        # primary's fixed ports (if the config fixes them) are taken; the launcher reads
        # the ports it got from its ports file.
        args += ["--standby", "--channel-port", "0", "--store-port", "0"]
    if writes_summary:
        args.append("--no-summary")
    return args


def wait_ports(path: Path, proc: Process, timeout_s: float = 60.0) -> dict:
    """The ports ``proc`` published in ``path`` (a file from another process is ignored)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists():
            try:
                ports: dict = json.loads(path.read_text())
                if ports.get("pid") == proc.pid:
                    return ports
            except json.JSONDecodeError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(
                f"the coordinator exited with code {proc.returncode} (see {path.parent})"
            )
        time.sleep(0.05)
    raise TimeoutError(f"the coordinator did not publish its ports in {path} within {timeout_s} s")


def start_worker(
    name: str,
    region: str,
    coordinators: list[str],
    token: str,
    log: Path,
    *,
    role: str = "worker",
    yield_cpu: bool = False,
    zygote: Zygote | None = None,
    host: str | None = None,
    device_index: int | None = None,
) -> Process:
    """Start a worker process. ``yield_cpu`` (for replacements on a shared machine): it
    starts at a low CPU priority so that its start-up (Python, torch, the model) does not
    slow the survivors, and takes normal priority once ready to train. With a ready
    ``zygote``, the process is forked from it and skips ``import torch``; without, it is
    a new ``python -m perdure worker``."""
    spec = WorkerSpec(
        name=name,
        region=region,
        coordinators=list(coordinators),
        role=role,
        yield_cpu=yield_cpu,
        host=host,
        device_index=device_index,
    )
    if zygote is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        forked = zygote.spawn(spec, child_env(token), log)
        if forked is not None:
            return forked
    return spawn(python_cmd(*spec.argv()), token, log)


def child_env(token: str) -> dict[str, str]:
    # torch's C++ layer prints a warning with a long native stack for every store call that
    # meets a closed connection (e.g. a heartbeat racing the coordinator's exit); perdure
    # handles those and logs one line, so only C++ errors are let through.
    return {
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        **os.environ,
        TOKEN_ENV: token,
        "PYTHONUNBUFFERED": "1",
        PARENT_ENV: str(os.getpid()),  # the child dies with this launcher (lifecycle.py)
    }


def spawn(cmd: list[str], token: str, log: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session, its output appended to ``log``, the run token and
    this process's pid (it dies with us) in its environment."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = child_env(token)
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
