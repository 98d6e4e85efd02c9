"""The local launcher: the embedded default deployment on one machine.

Every process of the run starts here as a child of this one: the coordinator (and a
standby) as ``python -m perdure coordinator``, each worker forked from the fork server
(``launch/zygote.py``), where one is ready, or else started as an ordinary process. The
run loop (the monitor, crash rules, replacements, the stop, the faces hooks use) is the
one every launcher shares (``launch/supervisor.py``); this module is the part that is the
local launcher's own, a :class:`~perdure.launch.spawner.Spawner`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from perdure import events as ev
from perdure.launch.base import MonitorHook
from perdure.launch.procs import Process, child_env, start_coordinator, start_worker, wait_ports
from perdure.launch.spawner import (
    Proc,
    RunContext,
    Started,
    coordinator_names,
    preload_modules,
)
from perdure.launch.supervisor import (
    RunFailed,
    StopRequested,
    Supervisor,
    WorkerCrashError,
    last_error,
)
from perdure.launch.zygote import Zygote
from perdure.launch.zygote_base import run_zygote
from perdure.run_config import RunConfig, to_dict
from perdure.runtime.control.address import host_port
from perdure.runtime.control.launched import record_launched

log = logging.getLogger(__name__)

ZYGOTE_READY_S = 60.0
"""How long the launcher waits for the fork server's imports before starting workers."""


class LocalSpawner:
    """Starts the run's processes on this machine."""

    def __init__(self) -> None:
        self.zygote: Zygote | None = None
        self._device_index: dict[str, int] = {}
        """Each worker name's GPU index on this host (for train.device = 'cuda')."""

    def start_coordinators(self, ctx: RunContext) -> Iterator[Started]:
        self._start_zygote(ctx)  # the coordinators are its forks too
        cfg_path = ctx.run_dir / "config.json"
        cfg_path.write_text(json.dumps(to_dict(ctx.config), indent=2))
        for name, region in coordinator_names(ctx.config.cluster):
            popen = start_coordinator(
                cfg_path,
                ctx.run_dir,
                ctx.token,
                resume=ctx.resume,
                allow_config_change=ctx.allow_config_change,
                name=name,
                expected=ctx.config.cluster.workers,
                writes_summary=True,  # by the launcher, once every process has stopped
                log=ctx.log_of(name),
                zygote=self.zygote,
            )
            ports = wait_ports(ctx.run_dir / f"{name}.json", popen)
            yield Started(
                Proc(name, region, "coordinator", popen),
                host_port(ports["host"], ports["channel_port"]),
                (ports["host"], int(ports["store_port"])),
            )

    def prepare_workers(self, ctx: RunContext) -> None:
        """The zygote is started with the coordinators (``_start_zygote``)."""
        self._start_zygote(ctx)

    def _start_zygote(self, ctx: RunContext) -> None:
        """The fork server every coordinator and worker starts from (see
        ``launch/zygote.py``), where ``fork`` exists; once. They are started as ordinary
        processes if it is not ready within ``ZYGOTE_READY_S`` (its log says why)."""
        if not hasattr(os, "fork") or self.zygote is not None:
            return
        env, log_path = child_env(ctx.token), ctx.run_dir / "logs" / "zygote.log"
        run_dir, preload = str(ctx.run_dir), preload_modules(ctx.config)
        self.zygote = run_zygote(env, log_path, run_dir=run_dir, preload=preload) or Zygote(
            env, log_path, run_dir=run_dir, preload=preload
        )
        if not self.zygote.wait_ready(ZYGOTE_READY_S):
            ctx.events.write({"event": ev.ZYGOTE_UNAVAILABLE, "log": "logs/zygote.log"})

    def start_worker(
        self, ctx: RunContext, name: str, region: str, role: str, gen: int, coordinators: list[str]
    ) -> Process:
        # One GPU per worker name, kept by its replacements (train.device = 'cuda').
        index = self._device_index.setdefault(name, len(self._device_index))
        popen = start_worker(
            name,
            region,
            coordinators,
            ctx.token,
            ctx.log_of(name),
            role=role,
            yield_cpu=gen > 0,
            zygote=self.zygote,
            host=ctx.config.cluster.host,
            device_index=index,
        )
        try:  # settles a contested name in the coordinator's admission (control/launched.py)
            record_launched(ctx.run_dir, name, popen.pid)
        except OSError as e:
            log.warning("cannot record %s pid: %s", name, e)
        return popen

    def tick(self, ctx: RunContext) -> None:
        """Nothing of its own: the shared loop does it all."""

    def exit_cause(self, p: Proc) -> str | None:
        return None  # the exit code says it all

    def before_stop(self, ctx: RunContext, procs: list[Proc]) -> None:
        """Nothing to do first: the processes are this machine's children."""

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()


class LocalLauncher(Supervisor):
    """Runs one training run on this machine; ``run()`` returns the summary. The shared
    run loop (:class:`~perdure.launch.supervisor.Supervisor`) with a
    :class:`LocalSpawner`: nothing of the loop is overridden here."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: str | Path,
        *,
        resume: str | None = None,
        timeout_s: float = 3600.0,
        hooks: list[MonitorHook] | None = None,
        allow_config_change: bool = False,
    ) -> None:
        super().__init__(
            config,
            run_dir,
            LocalSpawner(),
            resume=resume,
            timeout_s=timeout_s,
            hooks=hooks,
            allow_config_change=allow_config_change,
        )


__all__ = [
    "ZYGOTE_READY_S",
    "LocalLauncher",
    "LocalSpawner",
    "Proc",
    "RunFailed",
    "StopRequested",
    "WorkerCrashError",
    "last_error",
]
