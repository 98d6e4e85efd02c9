"""A user-space delay line for a TUN device: every packet read is written back after a
fixed one-way delay (no tests here; started by ``tests/netns_regions.py``).

This kernel has no netem qdisc, so cross-region latency is made here: the router
namespace routes every packet that arrives from a region's link into the TUN device
(policy routing by input interface); this process reads it, holds it for ``--delay-ms``
and writes it back, and the kernel forwards it on by its destination. A packet crosses the
router once per direction, so the round trip between two regions is twice the delay.

One FIFO for all flows with a constant delay keeps the order of every flow. The queue is
bounded (``--queue`` packets): past it a packet is dropped, as a router's full buffer
drops, and TCP retransmits. Limits: Python's timer granularity and the machine's load add
jitter (tenths of a millisecond idle, more when the cores are shared), and every packet
costs two system calls, so large MTUs (few packets per gradient) keep its own cost small.
The process stops when its parent dies (``PR_SET_PDEATHSIG``) or on SIGTERM.

    python -m tests.delay_router --tun NAME --delay-ms 25
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import os
import select
import signal
import struct
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
PR_SET_PDEATHSIG = 1


def open_tun(name: str) -> int:
    """Attach to the (persistent) TUN device ``name``: raw IP packets, no header."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class DelayLine:
    """Packets in, the same packets out ``delay_s`` later, in order, at most ``limit``
    held at once (the rest dropped and counted)."""

    def __init__(self, fd: int, delay_s: float, limit: int) -> None:
        self.fd, self.delay_s, self.limit = fd, delay_s, limit
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.cond = threading.Condition()
        self.stopped = False
        self.dropped = 0

    def read_forever(self) -> None:
        """Read packets (select with a timeout, so a stop is seen) and queue them."""
        while not self.stopped:
            ready, _, _ = select.select([self.fd], [], [], 0.5)
            if not ready:
                continue
            packet = os.read(self.fd, 65536)
            with self.cond:
                if len(self.queue) >= self.limit:
                    self.dropped += 1
                    continue
                self.queue.append((time.monotonic() + self.delay_s, packet))
                self.cond.notify()

    def write_forever(self) -> None:
        """Write each packet back when its time comes."""
        while True:
            with self.cond:
                while not self.queue and not self.stopped:
                    self.cond.wait(0.5)
                if self.stopped:
                    return
                due, packet = self.queue[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self.cond.wait(wait)  # a new packet wakes us early: due is unchanged
                    continue
                self.queue.popleft()
            try:
                os.write(self.fd, packet)
            except OSError:
                self.dropped += 1  # e.g. no route back yet: the kernel refuses it

    def stop(self, *_: object) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tun", required=True)
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--queue", type=int, default=8192)
    args = ap.parse_args(argv)
    with_libc = ctypes.CDLL(None, use_errno=True)
    with_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    line = DelayLine(open_tun(args.tun), args.delay_ms / 1000.0, args.queue)
    signal.signal(signal.SIGTERM, line.stop)
    writer = threading.Thread(target=line.write_forever, daemon=True)
    writer.start()
    print("ready", flush=True)
    line.read_forever()
    writer.join(timeout=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
