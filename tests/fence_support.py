"""Helpers for the split-brain tests (no tests here): a user-space TCP relay that a test
cuts and heals, a run started by hand the way a cluster manager starts one (``perdure
coordinator`` for the primary and the standby, ``perdure worker`` for each worker, real
processes), and a real etcd on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from perdure.events import read_jsonl
from perdure.launch.procs import child_env, python_cmd
from perdure.run_config import RunConfig, to_dict


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Relay:
    """Forwards TCP connections from ``127.0.0.1:port`` to ``target``, byte for byte.
    ``cut()`` closes every connection it carries and refuses new ones (the port is closed:
    "connection refused"), as a partition that resets; ``heal()`` opens the same port
    again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self.cut_now = False
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self._open()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while self.listener is listener:
            try:
                down, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                up = socket.create_connection(self.target, timeout=5)
            except OSError:
                down.close()
                continue
            for s in (down, up):
                s.settimeout(None)
            with self.lock:
                self.conns += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def heal(self) -> None:
        self._open()

    def close(self) -> None:
        self.cut()


class ManualRun:
    """A run started process by process, with the documented commands."""

    def __init__(self, run_dir: Path, config: RunConfig) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = run_dir / "config.json"
        self.config_path.write_text(json.dumps(to_dict(config)))
        self.token = secrets.token_hex(16)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.expected = config.cluster.workers

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = self.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                python_cmd(*args),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(self.token),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def coordinator(self, name: str, *, standby: bool = False, primary: str | None = None) -> str:
        """Start a coordinator; its channel address once it published its ports."""
        ports = self.run_dir / f"{name}.json"
        args = ["coordinator", "--config-json", str(self.config_path), "--run-dir"]
        args += [str(self.run_dir), "--ports-file", str(ports)]
        args += ["--expected-workers", str(self.expected)]
        if standby:
            args.append("--standby")
        if primary:
            args += ["--primary", primary]
        proc = self._spawn(name, args)
        found = wait_for(lambda: _ports(ports, proc.pid), 60, f"{name} ports")
        return f"{found['host']}:{found['channel_port']}"

    def worker(self, name: str, coordinators: list[str]) -> None:
        args = ["worker", "--name", name, "--region", "r0", "--join-timeout-s", "60"]
        for c in coordinators:
            args += ["--coordinator", c]
        self._spawn(name, args)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in read_jsonl(self.run_dir / "events.jsonl")
            if kind is None or e["event"] == kind
        ]

    def wait_step(self, step: int, timeout_s: float = 60) -> None:
        wait_for(lambda: any(m["step"] >= step for m in self.metrics()), timeout_s, f"step {step}")

    def wait_event(self, kind: str, timeout_s: float = 60) -> dict[str, Any]:
        return wait_for(lambda: next(iter(self.events(kind)), None), timeout_s, kind)

    def wait_exit(self, name: str, timeout_s: float = 90) -> int:
        proc = self.procs[name]
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout_s} s") from None

    def stop(self) -> None:
        """Stop what is left (the test's own processes, by pid)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def _ports(path: Path, pid: int) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return found if found.get("pid") == pid else None


def wait_for(probe: Callable[[], Any], timeout_s: float, what: str) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = probe()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s} s")


@contextlib.contextmanager
def etcd_server(data_dir: Path) -> Iterator[str]:
    """A single-member etcd on loopback ports of its own; its client URL. Killed at the
    end. The caller skips when the binary is absent (``shutil.which("etcd")``)."""
    binary = shutil.which("etcd")
    assert binary is not None
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    log = open(data_dir.parent / "etcd.log", "ab")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            binary,
            "--name=test",
            f"--data-dir={data_dir}",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=test={peer_url}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(lambda: _healthy(url) or proc.poll() is not None, 30, "etcd health")
        assert proc.poll() is None, f"etcd exited with {proc.returncode} (see etcd.log)"
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return bool(json.loads(r.read()).get("health") == "true")
    except (OSError, ValueError):
        return False
