"""A base zygote: ``import torch`` once per launcher process, not once per run.

A run's fork server (``zygote.py``) pays torch's imports (~3 s of CPU: torch, what its
deterministic mode imports, perdure's worker) before its first worker. A process that
launches one run after another (a sweep through the Python API, a notebook, a test
suite: several hundred runs) paid them again for every run. The base is a process that
imports them once and then forks a run's zygote on request, in milliseconds; the run's
zygote then imports the task's own modules (``--preload``) and serves the run exactly as
a zygote started on its own does (same protocol, same log, same process title).

Protocol: the launcher and the base share a ``SOCK_SEQPACKET`` socket pair (the base's
end is its stdin). The base sends ``{"ready", "pid"}`` once its imports are done; a
request is one message ``{"run_dir", "preload", "env", "log", "cwd"}`` carrying one file
descriptor (``SCM_RIGHTS``): the run zygote's end of a stream socket pair, over which it
speaks ``zygote.py``'s JSON lines; the base answers ``{"pid"}``.

Lifetimes: the base dies with the launcher (``lifecycle.die_with_parent``), a run's
zygote with the base, a worker with its run's zygote, so killing the launcher still ends
every process of every run. The base exits by itself after ``BASE_IDLE_S`` with no run's
zygote alive, so an idle notebook does not keep torch's memory. Reuse is only safe for
what does not change between runs: the base is keyed by the interpreter, the working
directory and the environment (the run token aside); the task's modules are never
imported in the base (a task edited between two runs is imported afresh by each run's
zygote). perdure's own modules are the launcher's version, as the launcher's are.

Limits: Linux only (``SCM_RIGHTS`` and ``fork``); elsewhere, or when the base cannot
start, a run's zygote is started as its own process (``zygote.Zygote``'s default).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from perdure.launch import zygote as zyg
from perdure.lifecycle import running
from perdure.runtime.entry import TOKEN_ENV

log = logging.getLogger(__name__)

BASE_IDLE_S = 60.0
"""The base exits after this long with no run's zygote alive and no request."""
READY_S = 60.0
"""How long the launcher waits for the base's imports."""
FORK_S = 10.0
"""How long the launcher waits for the base's answer to a request."""
_MSG = 1 << 20


# -- the base (``python -m perdure.launch.zygote_base``) -----------------------------------


def serve_base(argv: Sequence[str] | None = None) -> None:
    """Import, say ready, then fork a run's zygote per request until the launcher goes
    or ``--idle-s`` (the launcher's ``BASE_IDLE_S``) passes with nothing to do."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m perdure.launch.zygote_base")
    ap.add_argument("--idle-s", type=float, default=BASE_IDLE_S, help="Idle time before exit.")
    idle_s = ap.parse_args(argv).idle_s
    from perdure.lifecycle import die_with_parent
    from perdure.proctitle import set_title

    ctl = socket.socket(fileno=os.dup(0))  # the launcher's socket pair, passed as stdin
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # prints go where the base's stderr goes, never into the protocol
    die_with_parent()
    set_title("zygote-base")
    zyg.import_runtime()
    ctl.send(json.dumps({"ready": True, "pid": os.getpid()}).encode())
    children: set[int] = set()
    idle_since = time.monotonic()
    while True:
        readable, _, _ = select.select([ctl], [], [], 0.05)
        if readable and not _answer(ctl, children):
            return  # the launcher is gone (its children die with us)
        _reap(children)
        now = time.monotonic()
        if children or readable:
            idle_since = now
        elif now - idle_since > idle_s:
            return


def _answer(ctl: socket.socket, children: set[int]) -> bool:
    """Fork a run's zygote for one request; False when the launcher has closed its end."""
    try:
        msg, fds, _, _ = socket.recv_fds(ctl, _MSG, 1)
    except OSError:
        return False
    if not msg:
        return False
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        ctl.send(json.dumps({"error": "a request carries one socket"}).encode())
        return True
    gc.freeze()  # see launch/zygote.py: the run's zygote and its workers share these pages
    pid = os.fork()
    if pid == 0:
        _become_run_zygote(json.loads(msg), fds[0], ctl)
    os.close(fds[0])
    children.add(pid)
    ctl.send(json.dumps({"pid": pid}).encode())
    return True


def _reap(children: set[int]) -> None:
    for pid in list(children):
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
        children.discard(pid)


def _become_run_zygote(req: dict[str, Any], sock_fd: int, ctl: socket.socket) -> NoReturn:
    """In the fork: the run's zygote, as ``zygote.serve`` would be with these arguments."""
    code = 0
    try:
        from perdure.lifecycle import die_with_parent
        from perdure.proctitle import set_title

        base = os.getppid()
        ctl.close()
        os.setsid()
        out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.dup2(sock_fd, 0)  # requests in; replies go out on sock_fd itself
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        die_with_parent(base)
        set_title("zygote", run_dir=req.get("run_dir"))
        zyg.serve_run(list(req.get("preload", [])), sock_fd)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# -- the launcher's side -------------------------------------------------------------------


class _Base:
    """The launcher's handle on one base process."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        """``log_path``: where the base's own output goes (the zygote log of the run that
        started it: an import that fails there is seen in that run's log)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with open(log_path, "ab") as err:
                self.proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "perdure.launch.zygote_base",
                        "--idle-s",
                        f"{BASE_IDLE_S}",
                    ],
                    stdin=theirs.fileno(),
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env=env,
                    start_new_session=True,
                )
        finally:
            theirs.close()
        self.sock = mine
        try:
            self.sock.settimeout(READY_S)
            ready = json.loads(self.sock.recv(_MSG) or b"{}")
        except (OSError, ValueError):
            ready = {}
        if not ready.get("ready"):
            self.close()
            raise OSError("the base zygote closed or was not ready in time")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork_run(self, request: dict[str, Any]) -> tuple[int, socket.socket]:
        """A run's zygote: its pid and the launcher's end of its protocol socket."""
        mine, theirs = socket.socketpair()
        try:
            self.sock.settimeout(FORK_S)
            socket.send_fds(self.sock, [json.dumps(request).encode()], [theirs.fileno()])
            reply = json.loads(self.sock.recv(_MSG) or b"{}")
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        if "pid" not in reply:
            mine.close()
            raise OSError(f"the base zygote refused: {reply.get('error', 'it closed')}")
        return int(reply["pid"]), mine

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)


class _Bases:
    """This process's bases, one per environment; a fork of this process starts anew."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.owner = os.getpid()
        self.by_key: dict[tuple[object, ...], _Base] = {}

    def fork_run(
        self, env: dict[str, str], log_path: Path, request: dict[str, Any]
    ) -> tuple[int, socket.socket]:
        key = (sys.executable, os.getcwd(), tuple(sorted(_stable(env).items())))
        with self.lock:
            if os.getpid() != self.owner:  # a fork of the launcher: the bases are not ours
                self.owner, self.by_key = os.getpid(), {}
            base = self.by_key.get(key)
            if base is not None and base.alive:
                try:
                    return base.fork_run(request)
                except OSError:  # it went idle and exited meanwhile: start another
                    base.close()
            base = self.by_key[key] = _Base(_stable(env), log_path)
            try:
                return base.fork_run(request)
            except OSError:
                del self.by_key[key]
                base.close()
                raise


_BASES = _Bases()


_VOLATILE = frozenset({TOKEN_ENV, "PYTEST_CURRENT_TEST"})
"""Variables that differ from run to run and that no import reads: the run's token, and
the name of the test running now (pytest sets it for each test)."""


def _stable(env: dict[str, str]) -> dict[str, str]:
    """What keys a base and what it is started with: the environment but ``_VOLATILE``
    (a run's zygote still gets the whole environment of its run)."""
    return {k: v for k, v in env.items() if k not in _VOLATILE}


class ForkedZygote:
    """A run's zygote forked by a base: ``zygote.ZygoteProcess`` over a stream socket."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._sock = sock
        self.stdin: zyg.RequestSink | None = _Writer(sock)
        self.stdout: Iterable[bytes] | None = sock.makefile("rb")

    def poll(self) -> int | None:
        if self.returncode is None and not running(self.pid):
            self.returncode = 0  # the base reaped it; its code was the base's to read
            with contextlib.suppress(OSError):
                self._sock.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return zyg.wait_polling(self.poll, f"zygote {self.pid}", timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class _Writer:
    """The request side of the socket; ``close`` tells the run's zygote to end (EOF)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def write(self, data: bytes) -> int:
        self._sock.sendall(data)  # a request line; the zygote reads them as they come
        return len(data)

    def flush(self) -> None:
        """Nothing: every write is sent at once."""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)


def run_zygote(
    env: dict[str, str], log_path: Path, *, run_dir: str | None, preload: Sequence[str]
) -> zyg.Zygote | None:
    """A run's zygote forked from this process's base (started the first time), or None
    where that is not possible (then the caller starts one on its own)."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "send_fds"):
        return None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    request = {
        "run_dir": run_dir,
        "preload": list(preload),
        "env": env,
        "log": str(log_path),
        "cwd": os.getcwd(),
    }
    try:
        pid, sock = _BASES.fork_run(env, log_path, request)
    except (OSError, ValueError) as e:  # ValueError: a reply that is not JSON
        log.warning("no base zygote (%s): the run's zygote starts on its own", e)
        return None
    return zyg.Zygote(
        env, log_path, run_dir=run_dir, preload=preload, started=ForkedZygote(pid, sock)
    )


if __name__ == "__main__":
    serve_base()
