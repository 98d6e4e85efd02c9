"""The run loop every launcher shares, whatever starts its processes.

It plays the cluster manager's part that is the same everywhere: it starts the
coordinator (and a standby, when the config names one), one process per worker with its
region as a label, optional warm spares, and a replacement for a worker that dies,
applies the crash rules, stops everything at the end and writes ``summary.json`` once the
coordinator reports the run complete. Where and how a process starts is its
:class:`~perdure.launch.spawner.Spawner`'s (``local.py``, ``ray.py``). What is not a
launcher's own job composes with it as monitor hooks (the fault schedule's
``ChaosDriver``, the live view), which it serves through the narrow ``ClusterControl`` and
``Roster`` faces below (``launch/base.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from perdure import events as ev
from perdure.events import Tail, read_jsonl
from perdure.launch.base import MonitorHook, Progress, WorkerState
from perdure.launch.spawner import Proc, RunContext, Spawner
from perdure.launch.store_client import StoreClient
from perdure.run_config import RunConfig, anchored
from perdure.runlog import merge_all, part, writer_id

log = logging.getLogger(__name__)

DRAIN_S = 60.0
"""After SIGTERM or SIGINT, how long the launcher waits for the run to drain (a step
boundary and the final checkpoint) before it stops every process at once."""

MAX_CRASHES = 3
"""A worker that crashes this often without a fault being injected is a bug, not a fault:
the launcher stops instead of replacing it for ever."""

LOG_TAIL_BYTES = 64 * 1024
"""How much of a dead worker's log is searched for its last traceback."""


def last_error(log: Path, since: int = 0) -> str | None:
    """The exception line that ends the last traceback written to ``log`` after byte
    ``since`` (what one process wrote: logs are appended to), or None (killed by a signal,
    or it printed none). Only the last ``LOG_TAIL_BYTES`` are read."""
    try:
        with open(log, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(since, size - LOG_TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    at = text.rfind("Traceback (most recent call last):")
    if at < 0:
        return None
    for line in text[at:].splitlines()[1:]:
        if line and not line[0].isspace():
            return line.strip()
    return None


class RunFailed(RuntimeError):
    """The run stopped on an error every replica reproduces (``run_failed`` in the log);
    the message is its reason, in one line. The summary is written before it is raised."""


class WorkerCrashError(RunFailed):
    """Workers failed in a way a replacement would repeat; the run is stopped. The message
    is one line: the error and the log that holds its traceback."""


class StopRequested(RuntimeError):
    """A second SIGTERM or SIGINT while the run was draining: stop everything now."""


@contextlib.contextmanager
def _on_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Route SIGTERM and SIGINT to ``handler`` while the block runs (main thread only:
    elsewhere Python cannot install handlers, and the caller's own handling applies)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class Supervisor:
    """Runs one training run with ``spawner``'s processes; ``run()`` returns the summary."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: str | Path,
        spawner: Spawner,
        *,
        resume: str | None = None,
        timeout_s: float = 3600.0,
        hooks: list[MonitorHook] | None = None,
        allow_config_change: bool = False,
    ) -> None:
        self.config = anchored(config)  # absolute run.base_dir: workers start anywhere
        self.run_dir = Path(run_dir)
        self.spawner = spawner
        self.resume = resume
        self.allow_config_change = allow_config_change
        """Resume from a checkpoint of another config hash (the workers record it)."""
        self.timeout_s = timeout_s
        self.hooks: list[MonitorHook] = list(hooks or [])
        """Called on every monitor tick, in order (fault injection before the view)."""
        self.token = secrets.token_hex(16)
        self.stop_signal = ""
        """The signal that asked this run to stop early (empty: none)."""
        self.drain_deadline: float | None = None
        self.procs: dict[str, Proc] = {}
        self.coordinators: list[Proc] = []
        self.addresses: list[str] = []
        self.events = part(self.run_dir, "events", writer_id("launcher"))
        self.ctx = RunContext(
            self.config, self.run_dir, self.token, resume, allow_config_change, self.events
        )
        self.started = time.time()
        self.replacements: dict[str, float] = {}
        self.store_addrs: list[tuple[str, int]] = []
        self.crashes: dict[str, int] = {}
        self.startup_errors: dict[str, list[str]] = {}
        """Last error line -> the workers whose start-up ended with it, in order."""
        self._log_start: dict[str, int] = {}
        """Each worker's log size when its current process started (logs are appended)."""
        self._events_tail = Tail(self.run_dir / "events.jsonl", from_end=True)
        self._ended = False
        self.vetoed: set[str] = set()
        self._metrics = Tail(self.run_dir / "metrics.jsonl", from_end=True)
        self._progress = Progress()
        self._store = StoreClient(self.store_addrs, self.token)

    # -- processes -------------------------------------------------------------------------

    def _start_coordinators(self) -> None:
        for started in self.spawner.start_coordinators(self.ctx):
            self.coordinators.append(started.proc)
            self.addresses.append(started.channel)
            self.store_addrs.append(started.store)

    def _start_worker(self, name: str, region: str, role: str = "worker", gen: int = 0) -> None:
        log = self.ctx.log_of(name)
        self._log_start[name] = log.stat().st_size if log.exists() else 0
        popen = self.spawner.start_worker(self.ctx, name, region, role, gen, self.addresses)
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
        """Start everything, wait for the run to end, stop everything; the summary.

        SIGTERM or SIGINT (when this runs in the main thread) asks for a clean stop: the
        coordinator drains the run at a step boundary with a final checkpoint, and the run
        ends as a complete one does. A second signal, or no end within ``DRAIN_S``, stops
        every process at once. The summary is written in every case."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events.write(
            {"event": ev.RUN_START, "run_dir": str(self.run_dir), "resume": self.resume}
        )
        from perdure.launch.summary import write_summary

        try:
            with _on_signals(self._on_signal):
                self._start_coordinators()
                self.spawner.prepare_workers(self.ctx)
                self._start_workers()
                self._monitor()
        finally:
            self._stop_all()
            merge_all(self.run_dir, final=True)  # every writer has stopped: the last lines
            summary = write_summary(self.run_dir, self.config, started=self.started)
            _write_report(self.run_dir)
        if self.stop_signal:
            summary["stopped_by"] = self.stop_signal
        events = [
            e
            for e in read_jsonl(self.run_dir / "events.jsonl")
            if e.get("t", self.started) >= self.started
        ]
        failed = [e for e in events if e["event"] == ev.RUN_FAILED]
        if failed:
            raise RunFailed(f"{failed[-1]['reason']} (see {self.run_dir}/events.jsonl)")
        done = {e.get("final_hash") for e in events if e["event"] == ev.WORKER_DONE}
        if len(done) > 1:
            raise RunFailed(
                "replicas ended with different final hashes (worker_done events in "
                f"{self.run_dir}/events.jsonl): their state is not a function of the steps"
            )
        return summary

    def _on_signal(self, signum: int, frame: Any = None) -> None:
        name = signal.Signals(signum).name
        if self.stop_signal:
            raise StopRequested(f"{name} again while stopping: every process stopped now")
        self.stop_signal = name
        self.drain_deadline = time.monotonic() + DRAIN_S
        for c in self.coordinators:
            if c.alive:
                c.popen.send_signal(signal.SIGTERM)  # the coordinator drains the run

    def _monitor(self) -> None:
        end = time.monotonic() + self.timeout_s
        while time.monotonic() < end:
            if self._run_complete():
                return
            if self.drain_deadline is not None and time.monotonic() > self.drain_deadline:
                raise TimeoutError(
                    f"the run did not stop within {DRAIN_S:g} s of {self.stop_signal}"
                )
            if not self._run_ended():
                self._reap()
            self._tick()
            time.sleep(0.05)
        raise TimeoutError(f"run did not finish within {self.timeout_s} s (see {self.run_dir})")

    def _tick(self) -> None:
        self.spawner.tick(self.ctx)
        for hook in self.hooks:
            hook.tick()

    def _run_complete(self) -> bool:
        """A coordinator exited 0: it saw every member finish. (A standby that never took
        over is stopped afterwards.)

        Each coordinator is polled once: polled twice (exited 0? then: alive?), one that
        exited 0 between the two reads as gone before the run completed, and a complete
        run was reported as failed (seen in CI, with the launcher's thread descheduled
        between the two polls)."""
        codes = [c.popen.poll() for c in self.coordinators]
        if 0 in codes:
            return True
        if codes and None not in codes:
            raise RuntimeError(
                f"every coordinator is gone before the run completed (exit codes {codes}; "
                f"{self.run_dir})"
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
            self.events.write(self._exit_record(p))
            if not p.expected_exit:
                self._crashed(p)
            if delay >= 0 and p.kind == "worker":
                self.replacements[p.name] = time.monotonic() + delay
        now = time.monotonic()
        for name, at in list(self.replacements.items()):
            if now >= at and self._may_replace(name):
                old = self.procs[name]
                del self.replacements[name]
                self._start_worker(name, old.region, gen=old.generation + 1)
                self.events.write({"event": ev.REPLACEMENT_STARTED, "worker": name})

    def _exit_record(self, p: Proc) -> dict[str, Any]:
        """The ``process_exit`` event of a worker that died, with the platform's word on
        what killed it where it has one (Ray: the process died with its actor)."""
        record = {
            "event": ev.PROCESS_EXIT,
            "worker": p.name,
            "code": p.popen.returncode,
            "injected": p.expected_exit,
        }
        cause = self.spawner.exit_cause(p)
        return {**record, "cause": cause} if cause else record

    def _crashed(self, p: Proc) -> None:
        """A worker died with no fault injected into it. Two start-up crashes (before the
        process ever took part in an epoch) that end with the same error line stop the run
        with that line: a replacement would only fail the same way. Otherwise the run gives
        up after ``MAX_CRASHES`` crashes of one worker. Limit: an error whose message varies
        between processes (a pid, a port) is not recognised as the same one."""
        log = self.run_dir / "logs" / f"{p.name}.log"
        error = last_error(log, self._log_start.get(p.name, 0))
        if error is not None and not self._took_part(p):
            seen = self.startup_errors.setdefault(error, [])
            seen.append(p.name)
            if len(seen) >= 2:
                self._give_up(f"{error} (at start-up of {' and '.join(seen)}; see {log})")
        self.crashes[p.name] = self.crashes.get(p.name, 0) + 1
        if self.crashes[p.name] >= MAX_CRASHES:
            self._give_up(f"worker {p.name} crashed {MAX_CRASHES} times: {error} (see {log})")

    def _took_part(self, p: Proc) -> bool:
        """Whether ``p``'s process was a member of a started epoch (it got past start-up)."""
        return any(
            e.get("event") == ev.EPOCH_STARTED
            and e.get("t", 0) >= p.started
            and p.name in e.get("plan", {}).get("members", [])
            for e in read_jsonl(self.run_dir / "events.jsonl")
        )

    def _give_up(self, reason: str) -> None:
        self.events.write({"event": ev.RUN_FAILED, "by": "launcher", "reason": reason})
        raise WorkerCrashError(reason)

    def _may_replace(self, name: str) -> bool:
        return self.procs[name].region not in self.vetoed

    def _stop_all(self) -> None:
        """Stop every process: workers with SIGTERM (they leave), coordinators with SIGINT
        (they stop serving at once; SIGTERM would ask them to drain); SIGKILL after 10 s.
        The spawner goes first (Ray: the handles stop resubmitting) and closes last."""
        procs = [*self.procs.values(), *self.coordinators]
        try:
            self.spawner.before_stop(self.ctx, procs)
            for p in procs:
                if p.alive:
                    p.popen.send_signal(signal.SIGCONT)
                    sig = signal.SIGINT if p.kind == "coordinator" else signal.SIGTERM
                    p.popen.send_signal(sig)
            deadline = time.monotonic() + 10
            for p in procs:
                try:
                    p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait(timeout=5)
        finally:
            self.spawner.close()

    # -- ClusterControl (what fault injection may do; see launch/base.py) ------------------

    def _named(self, name: str) -> Proc | None:
        found = self.procs.get(name) or next((c for c in self.coordinators if c.name == name), None)
        return found if found is not None and found.alive else None

    def signal(self, name: str, sig: int, *, expected_exit: bool = False) -> list[int]:
        p = self._named(name)
        if p is None:
            return []
        p.expected_exit = p.expected_exit or expected_exit
        p.popen.send_signal(sig)  # through the process's own handle: it may run elsewhere
        return [p.popen.pid]

    def processes(self, region: str) -> list[str]:
        procs = [*self.procs.values(), *self.coordinators]
        return [p.name for p in procs if p.region == region and p.alive]

    def post(self, key: str, value: str) -> bool:
        return self._store.set(key, value)

    def restart(self, name: str) -> bool:
        old = self.procs[name]
        if old.alive:
            return False
        self._start_worker(name, old.region, gen=old.generation + 1)
        return True

    def veto_replacements(self, region: str) -> None:
        self.vetoed.add(region)

    def lift_veto(self, region: str) -> None:
        self.vetoed.discard(region)

    def progress(self) -> Progress:
        for rec in self._metrics.read():
            if not isinstance(rec.get("step"), int):
                continue  # an evaluation's line (``eval_step``)
            first = self._progress.first_step_t
            self._progress = Progress(
                step=max(self._progress.step, int(rec["step"])),
                first_step_t=float(rec["t"]) if first is None else first,
            )
        return self._progress

    def log(self, record: dict[str, Any]) -> None:
        self.events.write(record)

    # -- Roster (what the live view shows) -------------------------------------------------

    def regions(self) -> list[str]:
        return [r.name for r in self.config.cluster.regions]

    def workers(self) -> list[WorkerState]:
        return [WorkerState(p.name, p.region, p.alive) for p in self.procs.values()]


def _write_report(run_dir: Path) -> None:
    """RUN_DIR/report.html beside summary.json, on every ending (a failed run's report
    shows where it failed); a report that cannot be written costs one log line."""
    from perdure.report import write_report

    try:
        write_report(run_dir)
    except Exception as e:
        log.warning("report.html not written in %s: %s", run_dir, e)
