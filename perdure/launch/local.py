"""The local launcher: the embedded default deployment on one machine.

It plays the cluster manager: starts the coordinator (and a standby, when the config names
one), one process per worker with its region as a label, optional warm spares, and a
replacement for a worker that dies. It also injects the fault schedule, shows the live
view, and writes ``summary.json`` once the coordinator reports the run complete.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perdure import events as ev
from perdure.config.run import RunConfig, to_dict
from perdure.events import JsonLines, Tail
from perdure.launch.procs import Process, child_env, start_coordinator, start_worker, wait_ports
from perdure.launch.zygote import Zygote

ZYGOTE_READY_S = 60.0
"""How long the launcher waits for the fork server's imports before starting workers."""

MAX_CRASHES = 3
"""A worker that crashes this often without a fault being injected is a bug, not a fault:
the launcher stops instead of replacing it for ever."""


@dataclass
class Proc:
    """A process the launcher started."""

    name: str
    region: str
    kind: str  # "worker", "spare", "coordinator"
    popen: Process
    started: float = field(default_factory=time.time)
    generation: int = 0
    expected_exit: bool = False
    reaped: bool = False

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


class LocalLauncher:
    """Runs one training run on this machine; ``run()`` returns the summary."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: str | Path,
        *,
        resume: str | None = None,
        live: bool = False,
        timeout_s: float = 3600.0,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.live = live
        self.timeout_s = timeout_s
        self.token = secrets.token_hex(16)
        self.procs: dict[str, Proc] = {}
        self.coordinators: list[Proc] = []
        self.addresses: list[str] = []
        self.events = JsonLines(self.run_dir / "events.jsonl")
        self.started = time.time()
        self.replacements: dict[str, float] = {}
        self.store_addrs: list[tuple[str, int]] = []
        self.crashes: dict[str, int] = {}
        self._events_tail = Tail(self.run_dir / "events.jsonl", from_end=True)
        self._ended = False
        self.zygote: Zygote | None = None

    # -- processes -------------------------------------------------------------------------

    def _start_coordinators(self) -> None:
        cfg_path = self.run_dir / "config.json"
        cfg_path.write_text(json.dumps(to_dict(self.config), indent=2))
        names = [("coordinator", self.config.cluster.coordinator_region)]
        if self.config.cluster.standby_region:
            names.append(("standby", self.config.cluster.standby_region))
        for name, region in names:
            popen = start_coordinator(
                cfg_path,
                self.run_dir,
                self.token,
                resume=self.resume,
                name=name,
                expected=self.config.cluster.workers,
                log=self.run_dir / "logs" / f"{name}.log",
            )
            ports = wait_ports(self.run_dir / f"{name}.json", popen)
            region = region or self.config.cluster.regions[0].name
            self.coordinators.append(Proc(name, region, "coordinator", popen))
            self.addresses.append(f"{ports['host']}:{ports['channel_port']}")
            self.store_addrs.append((ports["host"], int(ports["store_port"])))

    def _start_worker(self, name: str, region: str, role: str = "worker", gen: int = 0) -> None:
        log = self.run_dir / "logs" / f"{name}.log"
        popen = start_worker(
            name,
            region,
            self.addresses,
            self.token,
            log,
            role=role,
            yield_cpu=gen > 0,
            zygote=self.zygote,
        )
        self.procs[name] = Proc(name, region, role, popen, generation=gen)

    def _start_workers(self) -> None:
        for region in self.config.cluster.regions:
            for i in range(region.workers):
                self._start_worker(f"{region.name}-{i}", region.name)
        for i in range(self.config.cluster.spares):
            home = self.config.cluster.regions[i % len(self.config.cluster.regions)].name
            self._start_worker(f"spare-{i}", home, role="spare")

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events.write(
            {"event": ev.RUN_START, "run_dir": str(self.run_dir), "resume": self.resume}
        )
        try:
            self._start_coordinators()
            self._start_zygote()
            self._start_workers()
            self._monitor()
        finally:
            self._stop_all()
        from perdure.launch.summary import write_summary

        return write_summary(self.run_dir, self.config, started=self.started)

    def _start_zygote(self) -> None:
        """The fork server every worker starts from (see ``launch/zygote.py``), where
        ``fork`` exists. Workers are then started as ordinary processes if it is not ready
        within ``ZYGOTE_READY_S`` (its log says why)."""
        if not hasattr(os, "fork"):
            return
        self.zygote = Zygote(child_env(self.token), self.run_dir / "logs" / "zygote.log")
        if not self.zygote.wait_ready(ZYGOTE_READY_S):
            self.events.write({"event": ev.ZYGOTE_UNAVAILABLE, "log": "logs/zygote.log"})

    def _monitor(self) -> None:
        end = time.monotonic() + self.timeout_s
        while time.monotonic() < end:
            if self._run_complete():
                return
            if not self._run_ended():
                self._reap()
            self._tick()
            time.sleep(0.05)
        raise TimeoutError(f"run did not finish within {self.timeout_s} s (see {self.run_dir})")

    def _tick(self) -> None:
        """Hook for fault injection and the live view (see ChaosLauncher)."""

    def _run_complete(self) -> bool:
        """A coordinator exited 0: it saw every member finish. (A standby that never took
        over is stopped afterwards.)"""
        if any(c.popen.poll() == 0 for c in self.coordinators):
            return True
        if all(not c.alive for c in self.coordinators):
            raise RuntimeError(
                f"every coordinator is gone before the run completed ({self.run_dir})"
            )
        return False

    def _run_ended(self) -> bool:
        """The coordinator logged the end of the run: exits from here on are shutdown."""
        if not self._ended:
            self._ended = any(e["event"] == ev.RUN_END for e in self._events_tail.read())
        return self._ended

    def _reap(self) -> None:
        """Notice dead workers; start a replacement after the configured delay."""
        delay = self.config.cluster.replace_after_ms / 1000
        for p in list(self.procs.values()):
            if p.alive or p.reaped:
                continue
            p.reaped = True
            if p.popen.returncode == 0:
                continue
            self.events.write(
                {
                    "event": ev.PROCESS_EXIT,
                    "worker": p.name,
                    "code": p.popen.returncode,
                    "injected": p.expected_exit,
                }
            )
            if not p.expected_exit:
                self.crashes[p.name] = self.crashes.get(p.name, 0) + 1
                if self.crashes[p.name] >= MAX_CRASHES:
                    raise RuntimeError(
                        f"worker {p.name} crashed {MAX_CRASHES} times; giving up "
                        f"(see {self.run_dir}/logs/{p.name}.log)"
                    )
            if delay >= 0 and p.kind == "worker":
                self.replacements[p.name] = time.monotonic() + delay
        now = time.monotonic()
        for name, at in list(self.replacements.items()):
            if now >= at and self._may_replace(name):
                old = self.procs[name]
                del self.replacements[name]
                self._start_worker(name, old.region, gen=old.generation + 1)
                self.events.write({"event": ev.REPLACEMENT_STARTED, "worker": name})

    def _may_replace(self, name: str) -> bool:
        return True

    def _stop_all(self) -> None:
        for p in [*self.procs.values(), *self.coordinators]:
            if p.alive:
                p.popen.send_signal(signal.SIGCONT)
                p.popen.terminate()
        deadline = time.monotonic() + 10
        for p in [*self.procs.values(), *self.coordinators]:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(timeout=5)
        if self.zygote is not None:
            self.zygote.close()
