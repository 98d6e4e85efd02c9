"""The local launcher with the fault schedule applied.

Faults that a real cluster inflicts from outside are real here too: ``kill`` is SIGKILL,
``hang`` is SIGSTOP (and SIGCONT after ``duration_s``), ``region_down`` kills every process
labelled with the region at once, the coordinator included when it lives there. Faults that
need the process's cooperation (``delay``, ``comm_error``) are posted in the store for the
worker's heartbeat thread; ``poison_shard`` is applied by the loaders themselves at its
step, so the reference run poisons exactly the same samples.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch.distributed as dist

from perdure import events as ev
from perdure.chaos.config import FaultConfig
from perdure.events import Tail
from perdure.launch.local import LocalLauncher


class ChaosLauncher(LocalLauncher):
    """Injects each fault of ``config.chaos`` when its trigger is reached."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.todo = list(enumerate(self.config.chaos.faults))
        self.later: list[tuple[float, str, Any]] = []
        self.down_regions: dict[str, float] = {}
        self.seq = 0
        self._store: dist.Store | None = None
        self._metrics = Tail(self.run_dir / "metrics.jsonl", from_end=True)
        self.step = -1
        self.first_step_t: float | None = None
        self.view: Any = None

    # -- triggers --------------------------------------------------------------------------

    def _tick(self) -> None:
        self._read_progress()
        now = time.time()
        for i, fault in list(self.todo):
            if self._due(fault, now):
                self.todo.remove((i, fault))
                self._inject(i, fault)
        for item in [x for x in self.later if x[0] <= now]:
            self.later.remove(item)
            self._undo(item[1], item[2])
        if self.view is not None:
            self.view.update(self)

    def run(self) -> dict[str, Any]:
        if not self.live:
            return super().run()
        from perdure.launch.view import LiveView

        with LiveView(self.run_dir, self.config.train.steps) as view:
            self.view = view
            try:
                return super().run()
            finally:
                self.view = None

    def _due(self, fault: FaultConfig, now: float) -> bool:
        if fault.at_step is not None:
            return self.step >= fault.at_step
        assert fault.at_s is not None
        return self.first_step_t is not None and now - self.first_step_t >= fault.at_s

    def _read_progress(self) -> None:
        for rec in self._metrics.read():
            self.step = max(self.step, int(rec["step"]))
            if self.first_step_t is None:
                self.first_step_t = float(rec["t"])

    # -- injection -------------------------------------------------------------------------

    def _inject(self, index: int, fault: FaultConfig) -> None:
        # stamped before the signal: the coordinator may log the victim's leave before this
        # record is written, and the fault report looks for detection after the fault
        record = {
            "t": round(time.time(), 6),
            "event": ev.FAULT_INJECTED,
            "fault": index,
            "kind": fault.kind,
            "target": fault.target,
            "step": self.step,
            "at_step": fault.at_step,
        }
        pids = getattr(self, f"_inject_{fault.kind}")(fault)
        self.events.write({**record, "pids": pids})

    def _worker_pid(self, name: str) -> list[int]:
        p = self.procs.get(name)
        return [p.popen.pid] if p is not None and p.alive else []

    def _inject_kill(self, fault: FaultConfig) -> list[int]:
        pids = self._worker_pid(fault.target)
        for pid in pids:
            self.procs[fault.target].expected_exit = True
            os.kill(pid, signal.SIGKILL)
        return pids

    def _inject_stop(self, fault: FaultConfig) -> list[int]:
        """A planned departure: SIGTERM makes the worker leave at a step boundary and exit 0
        (not replaced); after ``duration_s`` a new process joins under the same name."""
        pids = self._worker_pid(fault.target)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        if fault.duration_s:
            self.later.append((time.time() + fault.duration_s, "rejoin", fault.target))
        return pids

    def _inject_hang(self, fault: FaultConfig) -> list[int]:
        pids = self._worker_pid(fault.target)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            if fault.duration_s:
                self.later.append((time.time() + fault.duration_s, "cont", pid))
        return pids

    def _inject_region_down(self, fault: FaultConfig) -> list[int]:
        region = fault.target
        victims = [p for p in self.procs.values() if p.region == region and p.alive]
        victims += [c for c in self.coordinators if c.region == region and c.alive]
        for p in victims:
            p.expected_exit = True
            os.kill(p.popen.pid, signal.SIGKILL)
        self.down_regions[region] = time.time() + (fault.duration_s or float("inf"))
        if fault.duration_s:
            self.later.append((time.time() + fault.duration_s, "region_up", region))
        return [p.popen.pid for p in victims]

    def _inject_comm_error(self, fault: FaultConfig) -> list[int]:
        self._post(fault.target, {"kind": "comm_error"})
        return self._worker_pid(fault.target)

    def _inject_delay(self, fault: FaultConfig) -> list[int]:
        self._post(
            fault.target,
            {"kind": "delay", "delay_ms": fault.delay_ms, "duration_s": fault.duration_s},
        )
        if fault.duration_s:
            self.later.append((time.time() + fault.duration_s, "delay_over", fault.target))
        return []

    def _inject_poison_shard(self, fault: FaultConfig) -> list[int]:
        return []  # applied by every loader at its step (see module doc)

    def _post(self, target: str, fault: dict[str, Any]) -> None:
        self.seq += 1
        store = self._chaos_store()
        if store is not None:
            store.set(f"chaos/{target}", json.dumps({**fault, "seq": self.seq}))

    def _chaos_store(self) -> dist.Store | None:
        from datetime import timedelta

        from perdure.runtime.control.store import AuthStore

        for host, port in self.store_addrs:
            try:
                if self._store is None:
                    self._store = AuthStore(host, port, self.token, timedelta(seconds=30))
                return self._store
            except (RuntimeError, dist.DistError):
                self._store = None
        return None

    def _undo(self, what: str, arg: Any) -> None:
        if what == "cont":
            try:
                os.kill(arg, signal.SIGCONT)
            except ProcessLookupError:
                return
            self.events.write({"event": ev.FAULT_ENDED, "kind": "hang", "pid": arg})
        elif what == "rejoin":
            old = self.procs[arg]
            if old.alive:  # still leaving: try again shortly
                self.later.append((time.time() + 0.2, "rejoin", arg))
                return
            self._start_worker(arg, old.region, gen=old.generation + 1)
            self.events.write({"event": ev.FAULT_ENDED, "kind": "stop", "target": arg})
        elif what == "region_up":
            self.down_regions.pop(arg, None)
            self.events.write({"event": ev.FAULT_ENDED, "kind": "region_down", "target": arg})
        elif what == "delay_over":
            self.events.write({"event": ev.FAULT_ENDED, "kind": "delay", "target": arg})

    def _may_replace(self, name: str) -> bool:
        return self.procs[name].region not in self.down_regions


__all__ = ["ChaosLauncher"]
