"""Emulated hosts in several regions, with a round-trip time between regions (no tests here).

:func:`regions` makes one bridge per region and a router namespace joined to every
bridge. Hosts of one region talk over their bridge (no added latency); a packet to another
region goes to the router, whose policy routing (by input interface) sends every packet
that arrives from a region's link into a TUN device; ``tests/delay_router.py`` holds it
for half the round trip and writes it back, and the router forwards it on. So the RTT
between any two regions is :meth:`Regions.set_rtt`'s, and zero inside a region (this
kernel has no netem qdisc and no iptables: the delay is made in user space).

Addresses: region ``r`` is ``10.231.<net + r>.0/24`` (a private test range), its hosts
``.1``, ``.2``, ..., the router ``.254``. Every link (veths, bridges, the TUN device) has an
MTU of 65000, so a gradient is few packets for the delay line. The router's own cost
(two system calls and a Python hop per packet) is paid at RTT 0 too: compare runs at
RTT 0 through the same router, not against a bridge. Teardown in ``finally``: the delay
process, every process in the namespaces, the namespaces, veths and bridges.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.netns_support import PREFIX, Host, Hosts, _ip, skip_reason

ROOT = Path(__file__).resolve().parent.parent
MTU = 65000
TABLE = "100"


@dataclass
class Regions(Hosts):
    """Hosts in regions (``region_of[i]`` is host i's region index) and the router."""

    router: str = ""
    tun: str = ""
    bridges: list[str] = field(default_factory=list)
    region_of: list[int] = field(default_factory=list)
    delay: subprocess.Popen[bytes] | None = None
    rtt_ms: float = 0.0

    def in_region(self, r: int) -> list[int]:
        return [i for i, g in enumerate(self.region_of) if g == r]

    def set_rtt(self, rtt_ms: float, timeout_s: float = 20.0) -> None:
        """(Re)start the delay line with a one-way delay of ``rtt_ms / 2``; packets held by
        the previous one are dropped (TCP resends them)."""
        self._stop_delay()
        argv = [sys.executable, "-m", "tests.delay_router", "--tun", self.tun]
        argv += ["--delay-ms", str(rtt_ms / 2)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.delay = subprocess.Popen(
            ["ip", "netns", "exec", self.router, *argv],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self.delay.stdout is not None
        ready, _, _ = select.select([self.delay.stdout], [], [], timeout_s)
        if not ready or not self.delay.stdout.readline().startswith(b"ready"):
            raise RuntimeError(f"the delay line did not start within {timeout_s} s")
        self.rtt_ms = rtt_ms

    def _stop_delay(self) -> None:
        if self.delay is None:
            return
        if self.delay.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.delay.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.delay.wait(timeout=10)
        if self.delay.stdout is not None:
            self.delay.stdout.close()
        self.delay = None

    def close(self) -> None:
        self._stop_delay()
        super().close()  # host processes, host veths and namespaces, the first bridge
        for br in self.bridges:
            _ip("link", "del", br, check=False)
        for r in range(len(self.bridges)):
            _ip("link", "del", f"pdr{self.tag}{r}", check=False)
        if self.router:
            _ip("netns", "del", self.router, check=False)

    def echo_rtts(self, i: int, j: int, count: int = 20, size: int = 64) -> list[float]:
        """Round trips in ms of ``size``-byte messages over one TCP connection from host i
        to an echo server on host j (this machine has no ``ping``); the first one, which
        pays for the connection, is left out."""
        port = 29999
        server = self.start_python(j, _ECHO_SERVER, self.hosts[j].address, str(port))
        try:
            out = subprocess.run(
                ["ip", "netns", "exec", self.hosts[i].netns, sys.executable, "-c",
                 _ECHO_CLIENT, self.hosts[j].address, str(port), str(count + 1), str(size)],
                capture_output=True, text=True, timeout=60, check=True,
            ).stdout  # fmt: skip
        finally:
            server.kill()
            server.wait(timeout=10)
        return [float(x) for x in out.split()][1:]

    def start_python(self, i: int, code: str, *args: str) -> subprocess.Popen[bytes]:
        """``python -c code args`` on host i (killed at teardown if still running)."""
        argv = ["ip", "netns", "exec", self.hosts[i].netns, sys.executable, "-c", code, *args]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc


_ECHO_SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
s.settimeout(30)
c, _ = s.accept()
c.settimeout(30)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1 << 20)):
    c.sendall(b)
"""

_ECHO_CLIENT = """
import socket, sys, time
host, port, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
end = time.monotonic() + 20
while True:
    try:
        c = socket.create_connection((host, port), timeout=10)
        break
    except OSError:
        if time.monotonic() > end:
            raise
        time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
msg = b"x" * size
for _ in range(n):
    t0 = time.perf_counter()
    c.sendall(msg)
    got = 0
    while got < size:
        got += len(c.recv(size - got))
    print(round((time.perf_counter() - t0) * 1000, 3))
"""


def _sysctl(ns: str, *settings: str) -> None:
    cmd = ["ip", "netns", "exec", ns, "sysctl", "-qw", *settings]
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


def _build_router(rs: Regions, n_regions: int) -> None:
    _ip("netns", "add", rs.router)
    _ip("-n", rs.router, "link", "set", "lo", "up")
    _sysctl(rs.router, "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0")  # fmt: skip
    _ip("-n", rs.router, "tuntap", "add", "dev", rs.tun, "mode", "tun")
    _ip("-n", rs.router, "link", "set", rs.tun, "mtu", str(MTU), "up")
    _ip("-n", rs.router, "route", "add", "default", "dev", rs.tun, "table", TABLE)
    for r in range(n_regions):
        br, link, inner = rs.bridges[r], f"pdr{rs.tag}{r}", f"rv{r}"
        _ip("link", "add", br, "type", "bridge")
        _ip("link", "set", br, "mtu", str(MTU), "up")
        _ip("link", "add", link, "mtu", str(MTU), "type", "veth", "peer", "name", inner,
            "mtu", str(MTU), "netns", rs.router)  # fmt: skip
        _ip("link", "set", link, "master", br, "up")
        _ip("-n", rs.router, "addr", "add", f"{PREFIX}.{rs.net + r}.254/24", "dev", inner)
        _ip("-n", rs.router, "link", "set", inner, "up")
        _ip("-n", rs.router, "rule", "add", "iif", inner, "table", TABLE, "pref", str(1000 + r))


def _add_host(rs: Regions, r: int, k: int) -> None:
    i = len(rs.hosts)
    h = Host(i, f"perdure-{rs.tag}-{i}", f"pdv{rs.tag}{i}", f"{PREFIX}.{rs.net + r}.{k + 1}")
    rs.hosts.append(h)
    rs.region_of.append(r)
    _ip("netns", "add", h.netns)
    _ip("link", "add", h.link, "mtu", str(MTU), "type", "veth", "peer", "name", "eth0",
        "mtu", str(MTU), "netns", h.netns)  # fmt: skip
    _ip("link", "set", h.link, "master", rs.bridges[r], "up")
    _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
    _ip("-n", h.netns, "link", "set", "eth0", "up")
    _ip("-n", h.netns, "link", "set", "lo", "up")
    _ip("-n", h.netns, "route", "add", f"{PREFIX}.0.0/16", "via", f"{PREFIX}.{rs.net + r}.254")


@contextlib.contextmanager
def regions(per_region: Sequence[int], rtt_ms: float = 0.0) -> Iterator[Regions]:
    """Hosts in ``len(per_region)`` regions (``per_region[r]`` hosts in region r, listed
    region by region), ``rtt_ms`` between regions; skips where namespaces cannot be made."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    n = len(per_region)
    rs = Regions(tag=tag, net=secrets.randbelow(250 - n) + 1, bridge=f"pdb{tag}0")
    rs.router, rs.tun = f"perdure-{tag}-router", f"pdt{tag}"
    rs.bridges = [f"pdb{tag}{r}" for r in range(n)]
    try:
        _build_router(rs, n)
        for r, count in enumerate(per_region):
            for k in range(count):
                _add_host(rs, r, k)
        rs.set_rtt(rtt_ms)
        yield rs
    finally:
        rs.close()
