"""Emulated hosts for multi-host tests: network namespaces on a bridge (no tests here).

:func:`hosts` makes ``n`` network namespaces, each with one veth pair plugged into a
bridge of its own and an address ``10.231.<net>.<i + 1>/24`` of a private test range
(never any other address; the bridge itself has none, so the machine's own network never
sees them). Every name carries a random tag, so parallel tests never meet, and teardown
runs in ``finally``: every process in the namespaces is killed, then the namespaces, the
veths and the bridge are deleted, whatever the test did. Where namespaces cannot be made
(not root, no iproute2, no permission) the test is skipped with the reason.

All namespaces share this machine's file system: a run directory under ``tmp_path`` is
the "shared storage" of a cluster. Partitions are made with routes (:meth:`Hosts.cut`:
``ip route add prohibit`` on both sides, so only that path is cut) or by a link going
down (:meth:`Hosts.link_down`: the host loses the network); this kernel has no netem
qdisc and no iptables, so latency is not emulated here.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

PREFIX = "10.231"
"""The private test range: every address here is ``10.231.x.y``."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def skip_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`) to make network namespaces"
    if os.geteuid() != 0:
        return "needs root to make network namespaces and veth pairs"
    name = f"pdprobe{secrets.token_hex(3)}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class Host:
    """One emulated host: a namespace, its veth (the root side is ``link``), an address."""

    index: int
    netns: str
    link: str
    address: str


@dataclass
class Hosts:
    """The emulated hosts of one test, and the processes started on them."""

    tag: str
    net: int
    bridge: str
    hosts: list[Host] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _cuts: set[tuple[int, int]] = field(default_factory=set)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def start(
        self,
        i: int,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: Path,
        log: Path,
    ) -> subprocess.Popen[bytes]:
        """Run ``argv`` on host ``i`` (``ip netns exec``: the process is the command), its
        output appended to ``log``; it is killed at teardown if still running."""
        log.parent.mkdir(parents=True, exist_ok=True)
        out: IO[bytes]
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[i].netns, *argv],
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def pids(self, i: int) -> list[int]:
        """Every process in host ``i``'s namespace (all of them started by this test)."""
        out = _ip("netns", "pids", self.hosts[i].netns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, i: int) -> list[int]:
        """SIGKILL every process of host ``i`` (a host lost with everything on it)."""
        pids = self.pids(i)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def cut(self, i: int, j: int) -> None:
        """Cut the path between hosts ``i`` and ``j`` only (both directions): each
        refuses to route to the other; every other path stays up."""
        for a, b in ((i, j), (j, i)):
            self._route("add", a, b)
        self._cuts.add((min(i, j), max(i, j)))

    def heal(self, i: int, j: int) -> None:
        """Undo :meth:`cut`."""
        for a, b in ((i, j), (j, i)):
            self._route("del", a, b)
        self._cuts.discard((min(i, j), max(i, j)))

    def _route(self, op: str, a: int, b: int) -> None:
        ns, to = self.hosts[a].netns, self.hosts[b].address
        _ip("-n", ns, "route", op, "prohibit", f"{to}/32")

    def link_down(self, i: int) -> None:
        """Host ``i``'s cable pulled: its veth goes down, it reaches nobody."""
        _ip("link", "set", self.hosts[i].link, "down")

    def link_up(self, i: int) -> None:
        _ip("link", "set", self.hosts[i].link, "up")

    def listeners(self, i: int) -> list[str]:
        """``ADDRESS:PORT`` of every listening TCP socket in host ``i``'s namespace, read
        from ``/proc/<pid>/net/tcp`` and ``tcp6`` of a process inside it (each network
        namespace has its own tables)."""
        pids = self.pids(i)
        if not pids:
            return []
        found = []
        for name in ("tcp", "tcp6"):
            with contextlib.suppress(OSError):
                found += _listening(Path(f"/proc/{pids[0]}/net/{name}").read_text())
        return found

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for i in range(len(self.hosts)):
            self.kill_host(i)  # anything else left inside (none expected)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for h in self.hosts:
            _ip("link", "del", h.link, check=False)
            _ip("netns", "del", h.netns, check=False)
        _ip("link", "del", self.bridge, check=False)


def _listening(table: str) -> list[str]:
    """The LISTEN (state 0A) sockets of a /proc/net/tcp table as ``address:port``."""
    out = []
    for line in table.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 4 or parts[3] != "0A":
            continue
        addr_hex, port_hex = parts[1].split(":")
        out.append(f"{_address(addr_hex)}:{int(port_hex, 16)}")
    return out


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ".".join(str(b) for b in reversed(raw))  # little-endian u32
    import ipaddress

    words = [raw[k : k + 4][::-1] for k in range(0, 16, 4)]
    return str(ipaddress.IPv6Address(b"".join(words)))


@contextlib.contextmanager
def hosts(n: int) -> Iterator[Hosts]:
    """``n`` emulated hosts on one bridge; skips the test where they cannot be made."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    hs = Hosts(tag=tag, net=secrets.randbelow(250) + 1, bridge=f"pdb{tag}")
    try:
        _ip("link", "add", hs.bridge, "type", "bridge")
        _ip("link", "set", hs.bridge, "up")
        for i in range(n):
            h = Host(i, f"perdure-{tag}-{i}", f"pdv{tag}{i}", f"{PREFIX}.{hs.net}.{i + 1}")
            hs.hosts.append(h)
            _ip("netns", "add", h.netns)
            _ip("link", "add", h.link, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _ip("link", "set", h.link, "master", hs.bridge, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        _wait_reachable(hs)
        yield hs
    finally:
        hs.close()


def _wait_reachable(hs: Hosts, timeout_s: float = 10.0) -> None:
    """The bridge forwards once its ports leave the learning state (immediately here,
    with STP off); ping each host from the first to be sure."""
    if shutil.which("ping") is None:
        return
    end = time.monotonic() + timeout_s
    for h in hs.hosts[1:]:
        while True:
            ok = subprocess.run(
                ["ip", "netns", "exec", hs.hosts[0].netns, "ping", "-c1", "-W1", h.address],
                capture_output=True,
                timeout=10,
            ).returncode
            if ok == 0:
                break
            if time.monotonic() > end:
                raise RuntimeError(f"host {h.address} is not reachable on bridge {hs.bridge}")
            time.sleep(0.1)
