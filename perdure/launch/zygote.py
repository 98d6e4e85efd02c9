"""A fork server for workers: ``import torch`` once, fork per worker.

Starting a worker costs ~2-3 s of CPU before it does anything useful, most of it ``import
torch``. N workers on one machine pay it N times at the start of a run; and on a machine
whose cores the survivors are using, a replacement's start-up either slows them or, niced,
takes seconds of wall time during which the run is a member short. The zygote is a process
started first that imports torch and perdure's worker, then waits; a worker is a ``fork``
of it (copy-on-write, no imports) that becomes ``perdure worker`` in a new session with its
own log. It also imports the task's module (``task.entry``'s, given as ``--preload``) so
that a replacement does not pay for it either: a model written with ``transformers``
costs seconds more of imports than torch alone. The task is still *built* in each worker,
seeded, after the fork: only module code runs in the zygote, no model is made.
The same idea as ``multiprocessing``'s forkserver and PyTorch's fork-started DataLoader
workers: the zygote never runs a torch op, so no thread pool or device state is forked.

Every object the zygote holds is frozen (``gc.freeze``) before it forks, as Python's docs
advise for a fork server: a worker's collections never traverse, and so never write and
copy, the pages it shares with the zygote. Measured here (a child of a process that
imported torch and the worker): a full collection in the child copied 74 MB of them in
0.13 s of CPU, and a SIGKILL took 10 ms to close the child's sockets; frozen, 2 MB, 0.4 ms
and 6.6 ms. A killed worker is detected when its sockets close.

Protocol: JSON lines. The launcher writes ``{"id", "spec", "env", "log", "cwd"}`` on the
zygote's stdin; the zygote answers ``{"id", "pid"}`` and, when a child exits, ``{"exit":
pid, "code": code}`` (negative: killed by that signal, as ``subprocess`` reports it).

Limits: the zygote must outlive its children to report their exit codes; if it dies, a
child that ends afterwards reports code -1. Linux and macOS only (``fork``). A task module
that starts threads or opens a device when imported would be forked in that state: such
a task sets ``cluster.preload_task = false``. A module that fails to import is reported in
the zygote's log and left to the workers, which fail on it with their own traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

if TYPE_CHECKING:
    from perdure.runtime.entry import WorkerSpec

UNKNOWN_EXIT = -1

_protocol_fd = 1
"""Where the zygote writes its replies: its original stdout, moved aside by ``serve`` so
that whatever an imported module prints goes to the log instead of into the protocol."""


# -- the server (``python -m perdure.launch.zygote``) --------------------------------------


def serve(argv: Sequence[str] | None = None) -> None:
    """Import, then fork on request. The launcher starts it before any worker and waits
    for it, so the imports run once, at normal priority, on an otherwise idle machine."""
    args = _parser().parse_args(argv)
    protocol = os.dup(1)
    os.dup2(2, 1)  # prints (from torch, perdure or the task's module) go to the log
    from perdure.lifecycle import die_with_parent
    from perdure.proctitle import set_title

    die_with_parent()  # the launcher's pid is in the environment
    set_title("zygote", run_dir=args.run_dir)
    import_runtime()
    serve_run(args.preload, protocol)


def import_runtime() -> None:
    """What every worker imports before its first step, imported once here."""
    # torch itself, and what its first use_deterministic_algorithms call imports (~1.5 s)
    import torch._inductor.config  # noqa: F401

    # and the reducers ``make_reducer`` imports when a member's first epoch starts: a spare
    # promoted after a kill imported them on the kill's critical path (0.015-0.03 s here,
    # their source compiled where no bytecode is cached: PYTHONDONTWRITEBYTECODE)
    import perdure.runtime.comm.carried
    import perdure.runtime.comm.chain
    import perdure.runtime.comm.exact
    import perdure.runtime.comm.streamed
    import perdure.runtime.entry
    import perdure.runtime.worker  # noqa: F401
    from perdure.config.build import prepare
    from perdure.run_config.compose import RunConfig

    prepare(RunConfig)  # the annotations a worker's config is built from (16 ms each)

    # What a worker's start-up asked of the system after its fork, answered once here:
    # ``platform.platform()`` (a checkpoint's provenance) ran ``uname -p`` in a subprocess
    # at each start (1.3-1.5 ms, 1 ms of it the child's CPU); Python caches the answer,
    # so the forks inherit it. The codec of a connect by host name and fsspec's local
    # file system were imported at a worker's first use (2-4 ms).
    import encodings.idna  # noqa: F401
    import platform

    import fsspec.implementations.local  # noqa: F401

    platform.platform()


def serve_run(modules: Sequence[str], protocol_fd: int) -> None:
    """Preload the task's ``modules``, say ready on ``protocol_fd``, then fork a worker
    for each request read from stdin until the launcher closes it (fd 0)."""
    global _protocol_fd
    _protocol_fd = protocol_fd
    preloaded = [m for m in modules if preload(m)]
    from perdure.provenance import pin_commit

    for module in preloaded:  # the commit of the code the workers will run (provenance.py)
        pin_commit(module)
    _reply({"ready": True, "pid": os.getpid(), "preloaded": preloaded})
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:
                return  # the launcher is gone; children live on in their own sessions
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                _reply({"id": req["id"], "pid": _fork(req)})
        _reap()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m perdure.launch.zygote")
    ap.add_argument("--run-dir", default=None, help="The run directory (names the process).")
    ap.add_argument(
        "--preload", action="append", default=[], help="A module to import before forking."
    )
    return ap


def preload(module: str) -> bool:
    """Import ``module`` as the task's factory would be imported (the working directory on
    ``sys.path``, as ``runtime/replica/task.resolve`` puts it); False, with the traceback
    on stderr (the zygote's log), if it fails."""
    t0 = time.monotonic()
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        importlib.import_module(module)
    except Exception:
        print(f"zygote: could not preload {module!r}; the workers import it:", file=sys.stderr)
        traceback.print_exc()
        return False
    print(f"zygote: preloaded {module!r} in {time.monotonic() - t0:.2f} s", file=sys.stderr)
    return True


def _reply(msg: dict[str, Any]) -> None:
    os.write(_protocol_fd, (json.dumps(msg) + "\n").encode())


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(req: dict[str, Any]) -> int:
    me = os.getpid()
    gc.freeze()
    pid = os.fork()
    if pid == 0:
        _child(req, me)
    return pid


def _child(req: dict[str, Any], zygote: int) -> NoReturn:
    code = 1
    try:
        from perdure.lifecycle import PARENT_ENV, die_with_parent

        die_with_parent(zygote)  # a worker ends with its zygote, which ends with the launcher
        os.setsid()
        if _protocol_fd != 1:
            os.close(_protocol_fd)  # the zygote's replies are not the worker's to write
        out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(null, 0)
        os.close(out)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ[PARENT_ENV] = str(zygote)
        os.chdir(req["cwd"])
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if "argv" in req:  # a perdure command (the run's coordinator), not a worker
            import runpy

            # what `python -m perdure ARGV` would run, without the interpreter's start-up
            sys.argv = ["perdure", *req["argv"]]
            runpy.run_module("perdure", run_name="__main__", alter_sys=True)
        else:
            from perdure.runtime.entry import WorkerSpec, run_worker

            code = run_worker(WorkerSpec(**req["spec"]))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# -- the launcher's side -------------------------------------------------------------------


class RequestSink(Protocol):
    """Where the launcher writes requests (a pipe, or a socket's sending side)."""

    def write(self, data: bytes, /) -> int: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class ZygoteProcess(Protocol):
    """What :class:`Zygote` needs of the fork server's process: a ``subprocess.Popen``
    with pipes, or a zygote forked by a base (``zygote_base.py``)."""

    @property
    def stdin(self) -> RequestSink | None: ...
    @property
    def stdout(self) -> Iterable[bytes] | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def kill(self) -> None: ...


class Zygote:
    """The launcher's handle on a fork server; ``spawn`` returns a Popen-like process."""

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        *,
        run_dir: str | None = None,
        preload: Sequence[str] = (),
        started: ZygoteProcess | None = None,
    ) -> None:
        """``started``: a zygote another process forked for this run
        (``zygote_base.py``); by default it is started here, a new Python process."""
        log.parent.mkdir(parents=True, exist_ok=True)
        if started is not None:
            self.proc: ZygoteProcess = started
        else:
            cmd = [sys.executable, "-m", "perdure.launch.zygote"]
            if run_dir:
                cmd += ["--run-dir", run_dir]
            for module in preload:
                cmd += ["--preload", module]
            with open(log, "ab") as err:
                self.proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    env=env,
                    start_new_session=True,
                )
        self._cond = threading.Condition()
        self._ready = False
        self.preloaded: list[str] = []
        """The modules the zygote imported for the task (``--preload`` that succeeded)."""
        self._pids: dict[int, int] = {}
        self.exits: dict[int, int] = {}
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    @property
    def ready(self) -> bool:
        return self._ready and self.alive

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the imports are done (or the zygote died, or the timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or not self.alive, timeout_s)
        return self.ready

    def spawn(
        self, spec: WorkerSpec, env: dict[str, str], log: Path, timeout_s: float = 10.0
    ) -> ForkedProcess | None:
        """Fork a worker that runs ``spec``; None if the zygote is not ready."""
        return self._fork({"spec": spec.to_dict()}, env, log, timeout_s)

    def spawn_command(
        self, argv: Sequence[str], env: dict[str, str], log: Path, timeout_s: float = 10.0
    ) -> ForkedProcess | None:
        """Fork a process that runs ``perdure ARGV`` (the run's coordinators: their Python
        start-up and imports, ~0.7 s of CPU each, are the zygote's); None if not ready."""
        return self._fork({"argv": list(argv)}, env, log, timeout_s)

    def _fork(
        self, what: dict[str, Any], env: dict[str, str], log: Path, timeout_s: float
    ) -> ForkedProcess | None:
        if not self.ready or self.proc.stdin is None:
            return None
        with self._cond:
            self._next_id += 1
            rid = self._next_id
        req = {"id": rid, **what, "env": env, "log": str(log), "cwd": os.getcwd()}
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        with self._cond:
            if not self._cond.wait_for(lambda: rid in self._pids or not self.alive, timeout_s):
                raise TimeoutError(f"the zygote did not fork within {timeout_s} s")
            pid = self._pids.get(rid)
        return None if pid is None else ForkedProcess(pid, self)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid in self.exits:
                return self.exits[pid]
        if self.alive:
            return None
        return UNKNOWN_EXIT if not _exists(pid) else None

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue  # not a reply (serve keeps stdout for replies; a bug if seen)
            with self._cond:
                if msg.get("ready"):
                    self._ready = True
                    self.preloaded = list(msg.get("preloaded", []))
                elif "exit" in msg:
                    self.exits[int(msg["exit"])] = int(msg["code"])
                else:
                    self._pids[int(msg["id"])] = int(msg["pid"])
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()


class ForkedProcess:
    """The parts of ``subprocess.Popen`` the launcher uses, for a zygote's child."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return wait_polling(self.poll, f"pid {self.pid}", timeout)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def wait_polling(poll: Callable[[], int | None], what: str, timeout: float | None) -> int:
    """``Popen.wait`` for a process this one cannot ``waitpid`` (another's child): poll
    every 20 ms until ``poll`` gives its code; ``subprocess.TimeoutExpired`` at ``timeout``."""
    end = None if timeout is None else time.monotonic() + timeout
    while (code := poll()) is None:
        if end is not None and time.monotonic() > end:
            raise subprocess.TimeoutExpired(what, timeout or 0.0)
        time.sleep(0.02)
    return code


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    serve()
