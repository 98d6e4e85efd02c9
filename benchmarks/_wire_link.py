"""The shaped link of ``bench_wire.py``: tbf on both veth ends, the raw TCP rate, the byte
counters of each namespace's veth, and the peak RSS of the processes of a host.

Not part of perdure: only ``benchmarks/bench_wire.py`` imports this module. The hosts are
the tests' (``tests/netns_support.py``: namespaces on a bridge, addresses of the private
test range 10.231.x.y); everything here acts on them only.
"""

from __future__ import annotations

import bisect
import contextlib
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.netns_support import Hosts, _ip

# -- shaping ------------------------------------------------------------------------------


def tbf_args(rate_mbit: float, burst_kb: int, latency_ms: int) -> list[str]:
    """The qdisc of each shaped device: ``tbf rate R burst B latency L`` at the root."""
    return ["root", "tbf", "rate", f"{rate_mbit:g}mbit", "burst", f"{burst_kb}kb",
            "latency", f"{latency_ms}ms"]  # fmt: skip


def shape(
    hs: Hosts, hosts: list[int], rate_mbit: float, burst_kb: int, latency_ms: int
) -> list[str]:
    """tbf on both ends of each given host's veth pair (``eth0`` inside the namespace,
    its peer on the bridge): every packet between two shaped hosts leaves through one of
    each, so each direction is held to ``rate_mbit``. Returns the commands, for the
    record. ``rate_mbit`` 0: nothing is shaped (the CPU-bound row)."""
    if rate_mbit <= 0:
        return []
    q = tbf_args(rate_mbit, burst_kb, latency_ms)
    done = []
    for i in hosts:
        for dev, ns in (("eth0", hs[i].netns), (hs[i].link, None)):
            pre = ["-n", ns] if ns else []
            subprocess.run(["tc", *pre, "qdisc", "add", "dev", dev, *q], check=True,
                           capture_output=True, text=True, timeout=10)  # fmt: skip
            done.append(" ".join(["tc", *pre, "qdisc", "add", "dev", dev, *q]))
    return done


def qdisc_stats(hs: Hosts, i: int) -> str:
    """``tc -s qdisc`` of host i's eth0 (drops, overlimits), for the record."""
    out = subprocess.run(["tc", "-n", hs[i].netns, "-s", "qdisc", "show", "dev", "eth0"],
                         capture_output=True, text=True, timeout=10)  # fmt: skip
    return out.stdout.strip()


# -- raw TCP rate -------------------------------------------------------------------------

_SINK = """
import socket, sys, time
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
s.settimeout(30)
c, _ = s.accept()
c.settimeout(30)
n, t0 = 0, None
while (b := c.recv(1 << 20)):
    if t0 is None:
        t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""

_SOURCE = """
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + 20
while True:
    try:
        c = socket.create_connection((host, port), timeout=10)
        break
    except OSError:
        if time.monotonic() > end:
            raise
        time.sleep(0.05)
buf = b"\\0" * (1 << 20)
stop = time.monotonic() + seconds
while time.monotonic() < stop:
    c.sendall(buf)
c.close()
"""


def tcp_rate_mbit(hs: Hosts, src: int, dst: int, port: int, seconds: float = 3.0) -> float:
    """A plain socket copy from host ``src`` to host ``dst`` for ``seconds``: the
    receiver's bytes over the time from its first byte to the end, in Mbit/s."""
    sink = subprocess.Popen(
        ["ip", "netns", "exec", hs[dst].netns, sys.executable, "-c", _SINK, hs[dst].address,
         str(port)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        subprocess.run(
            ["ip", "netns", "exec", hs[src].netns, sys.executable, "-c", _SOURCE,
             hs[dst].address, str(port), str(seconds)],
            check=True, capture_output=True, timeout=seconds + 60,
        )  # fmt: skip
        out, _ = sink.communicate(timeout=60)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait(timeout=10)
    n, dt = out.split()
    return int(n) * 8 / float(dt) / 1e6


# -- byte counters ------------------------------------------------------------------------

_SAMPLER = """
import sys, time
out = open(sys.argv[1], "w", buffering=1)
base = "/sys/class/net/eth0/statistics/"
tx, rx = open(base + "tx_bytes"), open(base + "rx_bytes")
while True:
    tx.seek(0); rx.seek(0)
    out.write(f"{time.time():.6f} {tx.read().strip()} {rx.read().strip()}\\n")
    time.sleep(float(sys.argv[2]))
"""


@dataclass
class Counters:
    """A sampler process in each host's namespace writes ``time tx rx`` of its own
    ``eth0`` (``/sys/class/net/eth0/statistics`` as that namespace sees it) every
    ``period_s``; bytes over a wall-clock window are read off the samples, interpolated."""

    files: dict[int, Path]
    pids: set[int] = field(default_factory=set)

    @classmethod
    def start(cls, hs: Hosts, hosts: list[int], tmp: Path, env: dict[str, str],
              period_s: float = 0.02) -> Counters:  # fmt: skip
        files = {i: tmp / f"counters-{i}.txt" for i in hosts}
        c = cls(files)
        for i, f in files.items():
            argv = [sys.executable, "-c", _SAMPLER, str(f), str(period_s)]
            c.pids.add(hs.start(i, argv, env=env, cwd=tmp, log=tmp / f"sampler-{i}.log").pid)
        end = time.monotonic() + 20
        while not all(f.exists() and f.stat().st_size for f in files.values()):
            if time.monotonic() > end:
                raise RuntimeError("the byte-counter samplers did not start within 20 s")
            time.sleep(0.05)
        return c

    def samples(self, i: int) -> list[tuple[float, int, int]]:
        rows = []
        for line in self.files[i].read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
        return rows

    def window(self, i: int, t0: float, t1: float) -> dict[str, float]:
        """tx and rx bytes of host i's eth0 between wall-clock times t0 and t1."""
        s = self.samples(i)
        return {k: at(s, t1, col) - at(s, t0, col) for k, col in (("tx", 1), ("rx", 2))}


def at(samples: list[tuple[float, int, int]], t: float, col: int) -> float:
    """Counter ``col`` at time t, linearly interpolated between the samples around it."""
    times = [s[0] for s in samples]
    j = bisect.bisect_left(times, t)
    if j == 0:
        return float(samples[0][col])
    if j >= len(samples):
        return float(samples[-1][col])
    (ta, *a), (tb, *b) = samples[j - 1], samples[j]
    va, vb = a[col - 1], b[col - 1]
    return va + (vb - va) * (t - ta) / (tb - ta) if tb > ta else float(vb)


# -- peak RSS -----------------------------------------------------------------------------


def vm_hwm_kb(pid: int) -> int | None:
    """The peak resident set (VmHWM) of a live process, in KiB."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return None


class PeakRss(threading.Thread):
    """Polls VmHWM (monotone: the peak so far) of every process in the given hosts'
    namespaces, but the ``exclude`` pids (the counter samplers), and keeps each
    process's last reading: a process's peak as of its last poll before it exits."""

    def __init__(self, hs: Hosts, hosts: list[int], exclude: set[int], period_s: float = 0.25):
        super().__init__(daemon=True)
        self.hs, self.hosts, self.exclude, self.period_s = hs, hosts, exclude, period_s
        self.peaks: dict[int, dict[int, tuple[int, str]]] = {i: {} for i in hosts}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.poll()
            self._halt.wait(self.period_s)

    def poll(self) -> None:
        for i in self.hosts:
            out = _ip("netns", "pids", self.hs[i].netns, check=False).stdout
            for pid in (int(p) for p in out.split()):
                if pid in self.exclude:
                    continue
                kb = vm_hwm_kb(pid)
                if kb is not None:
                    self.peaks[i][pid] = (kb, _cmd(pid))

    def stop(self) -> dict[int, dict[str, Any]]:
        """The largest process peak per host, its command line, and how many processes."""
        self._halt.set()
        self.join(timeout=10)
        out = {}
        for i, procs in self.peaks.items():
            if procs:
                pid, (kb, cmd) = max(procs.items(), key=lambda kv: kv[1][0])
                out[i] = {"peak_rss_mb": kb / 1024, "pid": pid, "cmd": cmd, "procs": len(procs)}
        return out


def _cmd(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    return ""
