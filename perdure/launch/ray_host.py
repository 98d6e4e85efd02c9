"""The Ray actor that hosts one perdure process on its node (``launch/ray.py`` creates one
per process of the run).

A module of its own, light on purpose: a Ray worker process imports it to become the
actor, and nothing here may pull in torch (the launcher's modules do, through the run
config), which would cost every actor seconds of start-up before it can start anything.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
import signal
import subprocess
from pathlib import Path
from typing import Any

from perdure.launch.procs import Process, child_env, python_cmd, spawn
from perdure.launch.zygote import Zygote
from perdure.runtime.entry import WorkerSpec

ZYGOTE_READY_S = 60.0
"""How long a worker's start waits for its actor's fork server (then: a new process)."""

CALL_TIMEOUT_S = 10.0
"""How long a call to a live actor (a signal, a placement query) may take."""

POLL_S = 0.02
"""How often an actor looks at its process's exit."""


class ProcessHost:
    """A Ray actor that hosts one perdure process at a time on its node (run as an async
    actor: a method waiting for an exit does not block a signal).

    A worker's host starts a fork server (``launch/zygote.py``) as soon as it is placed,
    so that ``import torch`` overlaps the coordinator's start-up, and a replacement started
    in the same actor (its process died, its node did not) is a fork that starts within
    ~0.05 s; a coordinator is a new process. Processes are numbered by the launcher
    (``launch``), so that a wait or a signal meant for one process never reaches its
    successor; starting a process stops the one still running here first: a name has
    one process."""

    def __init__(
        self,
        cwd: str | None,
        pythonpath: list[str],
        token: str,
        zygote_log: str | None,
        *,
        run_dir: str | None = None,
        preload: list[str] | None = None,
    ) -> None:
        self.incarnation = secrets.token_hex(8)
        self.procs: dict[int, Process] = {}
        self.current: int | None = None
        self.token = token
        # This actor's process is its own: its children start where the driver runs and
        # find the code where the driver found it (a cluster shares paths: see the limits).
        if cwd and Path(cwd).is_dir():
            os.chdir(cwd)
        paths = [*pythonpath, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        self.zygote: Zygote | None = None
        if zygote_log is not None and hasattr(os, "fork"):
            # the task's module imported before forking, as the local launcher's zygote
            self.zygote = Zygote(
                child_env(token), Path(zygote_log), run_dir=run_dir, preload=preload or []
            )

    async def start(
        self,
        launch: int,
        log_path: str,
        *,
        args: list[str] | None = None,
        spec: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Start a process: ``python -m perdure ARGS``, or the worker of ``spec`` (a
        ``WorkerSpec``'s fields), its data plane on this node's address; where it runs."""
        import ray

        self._stop_current()
        ip = ray.util.get_node_ip_address()
        log = Path(log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        proc: Process | None = None
        if spec is not None:
            worker = WorkerSpec(**{**spec, "host": bind_address(ip)})
            if self.zygote is not None:
                await asyncio.to_thread(self.zygote.wait_ready, ZYGOTE_READY_S)
                proc = self.zygote.spawn(worker, child_env(self.token), log)
            args = worker.argv()
        if proc is None:
            assert args is not None
            proc = spawn(python_cmd(*args), self.token, log)  # its parent is this actor
        self.procs[launch] = proc
        self.current = launch
        return {
            "pid": proc.pid,
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ip,
            "actor_pid": os.getpid(),
            "forked": not isinstance(proc, subprocess.Popen),
            "incarnation": self.incarnation,
        }

    async def wait_exit(self, launch: int) -> int:
        """The exit code of process ``launch`` (negative: the signal that killed it)."""
        while launch not in self.procs:  # its start was submitted first; it may not have run
            await asyncio.sleep(POLL_S)
        proc = self.procs[launch]
        while (code := proc.poll()) is None:
            await asyncio.sleep(POLL_S)
        return code

    async def signal(self, launch: int, sig: int) -> int | None:
        """Send ``sig`` to process ``launch`` if it runs; its pid, or None."""
        proc = self.procs.get(launch)
        if proc is None or proc.poll() is not None:
            return None
        proc.send_signal(sig)
        return proc.pid

    async def node(self) -> dict[str, Any]:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_pid": os.getpid(),
            "incarnation": self.incarnation,
        }

    def _stop_current(self) -> None:
        proc = self.procs.get(self.current) if self.current is not None else None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=CALL_TIMEOUT_S)


def bind_address(ip: str) -> str:
    """The address to bind for ``ip`` (a v6 address as it is, no brackets)."""
    return str(ipaddress.ip_address(ip))
