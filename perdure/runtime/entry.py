"""The worker's entry function: what ``perdure worker`` and the zygote's forks both run.

A cluster manager starts ``perdure worker`` (the CLI parses its flags into a
:class:`WorkerSpec`); the local launcher's fork server calls :func:`run_worker` directly
in a forked child, so a worker's start-up never goes through the CLI's imports.
"""

from __future__ import annotations

import os
import signal
from dataclasses import asdict, dataclass, field
from typing import Any

TOKEN_ENV = "PERDURE_RUN_TOKEN"


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything a worker process needs to join a run, but the token (from the
    environment, so it never appears in a process listing)."""

    name: str
    region: str
    coordinators: list[str] = field(default_factory=list)
    """``HOST:PORT`` of each coordinator's channel, the primary first."""
    role: str = "worker"
    yield_cpu: bool = False
    """Start at the lowest CPU priority; take normal priority once ready to train."""
    join_timeout_s: float = 60.0
    host: str | None = None
    """The address this worker's data plane listens on (where its peers reach it);
    unset: its own address on the path to the coordinator."""
    interface: str | None = None
    """The network interface its data plane uses, by name (instead of ``host``)."""
    device_index: int | None = None
    """The GPU of its host it takes with ``train.device = 'cuda'`` (modulo the host's
    count); unset: ``$LOCAL_RANK``, else 0."""

    def __post_init__(self) -> None:
        if not self.coordinators:
            raise ValueError("a worker needs at least one --coordinator HOST:PORT")
        if self.host and self.interface:
            raise ValueError(
                f"give --host ({self.host}) or --interface ({self.interface}), not both"
            )
        for c in self.coordinators:
            parse_address(c)

    def argv(self) -> list[str]:
        """The ``perdure worker`` command line for this spec."""
        args = ["worker", "--name", self.name, "--region", self.region, "--role", self.role]
        if self.yield_cpu:
            args.append("--yield-cpu-until-ready")
        args += ["--join-timeout-s", str(self.join_timeout_s)]
        if self.host:
            args += ["--host", self.host]
        if self.interface:
            args += ["--interface", self.interface]
        if self.device_index is not None:
            args += ["--device-index", str(self.device_index)]
        for c in self.coordinators:
            args += ["--coordinator", c]
        return args

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as a pair; ValueError naming the rule."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--coordinator must be HOST:PORT with a port in [1, 65535] (got {value!r})"
        )
    return host, int(port)


def run_worker(spec: WorkerSpec, token: str | None = None) -> int:
    """Run one worker until the run ends; returns its exit code. SIGTERM asks it to
    leave at the next step boundary."""
    from perdure.lifecycle import die_with_parent
    from perdure.proctitle import set_title

    die_with_parent()  # started by a launcher (not forked by its zygote): end with it
    set_title("spare" if spec.role == "spare" else "worker", spec.name)
    token = token or os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"set the run token in the environment variable {TOKEN_ENV}")
    if spec.yield_cpu:
        from perdure.runtime.member.priority import yield_cpu

        yield_cpu()
    from perdure.runtime.worker import Worker

    w = Worker(
        name=spec.name,
        region=spec.region,
        coordinators=[parse_address(c) for c in spec.coordinators],
        token=token,
        role=spec.role,
        timeout_s=spec.join_timeout_s,
        restore_priority=spec.yield_cpu,
        host=spec.host,
        interface=spec.interface,
        device_index=spec.device_index,
    )
    signal.signal(signal.SIGTERM, lambda *_: w.leave())
    return w.run()
