"""TCP payload bytes crossing a namespace's links, first sends told from resends.

An interface's byte counters (``ip -s link``) count every frame: headers, ACKs, and each
segment TCP sends again after a loss (a tbf queue's drop, a delay line's). What a run
*asks* the network to carry is the payload of each byte's first send. This sniffer reads
every frame on the links whose names start with ``--prefix`` (an ``AF_PACKET`` raw
socket: run it inside the namespace, as root) and counts per link and direction (``out``:
frames the namespace sent on the link; ``in``: frames it received):

- ``wire``: frame bytes (Ethernet and up), what the link counters count;
- ``payload``: TCP payload bytes, resends included;
- ``first``: TCP payload bytes whose sequence range this link and direction had not
  carried before in that connection (a resent range, or the resent part of a segment
  that overlaps one, is left out; sequence numbers are unwrapped past 2**32).

Each emitted line also holds ``conns``: per link and direction, the first-send bytes of
each connection direction (``"SRC:SPORT>DST:DPORT"``), so a reader can tell the data plane
from the control plane by port (the coordinator's channel and store ports are known).

Only IPv4 over Ethernet is parsed (the test regions' links); anything else counts in
``wire`` only. A frame the socket's buffer could not take is lost to the counts:
``drops`` (the kernel's ``PACKET_STATISTICS``) says how many, so a non-zero value makes
every count a lower bound. The pure parts (:func:`parse`, :class:`FirstSend`) are tested
in ``tests/test_tcp_payload.py`` on crafted frames.

    ip netns exec ROUTER python benchmarks/_tcp_payload.py --prefix rv --period 0.25

prints ``ready``, then one JSON line of cumulative counts every ``--period`` seconds, and
a last one when its stdin closes (then it exits).
"""

from __future__ import annotations

import argparse
import bisect
import json
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass, field

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
PACKET_OUTGOING = 4
SOL_PACKET = 263
PACKET_STATISTICS = 6
SEQ_MOD = 1 << 32


@dataclass(frozen=True)
class Segment:
    """One TCP segment's connection (as the frame's direction names it), sequence number
    and payload length."""

    src: bytes
    sport: int
    dst: bytes
    dport: int
    seq: int
    length: int


def parse(frame: bytes | memoryview) -> Segment | None:
    """The TCP segment an Ethernet frame carries, or None (not IPv4, not TCP, a fragment
    past the first, or too short for its headers). The payload's length comes from the IP
    header's total length, so an Ethernet pad is not counted."""
    if len(frame) < 14 + 20:
        return None
    (ethertype,) = struct.unpack_from("!H", frame, 12)
    if ethertype != ETH_P_IP:
        return None
    ver_ihl, total, frag, proto = frame[14], *struct.unpack_from("!H2xH", frame, 16), frame[23]
    ihl = (ver_ihl & 0x0F) * 4
    if ver_ihl >> 4 != 4 or ihl < 20 or proto != 6 or frag & 0x1FFF:
        return None
    if total == 0:  # a segmentation offload's frame may leave it unset: the frame's length
        total = len(frame) - 14
    tcp = 14 + ihl
    if total > len(frame) - 14 or total < ihl + 20:
        return None
    src, dst = bytes(frame[26:30]), bytes(frame[30:34])
    sport, dport, seq = struct.unpack_from("!HHI", frame, tcp)
    doff = (frame[tcp + 12] >> 4) * 4
    if doff < 20 or ihl + doff > total:
        return None
    return Segment(src, sport, dst, dport, seq, total - ihl - doff)


@dataclass
class _Flow:
    raw: int
    """The last sequence number seen, as on the wire (mod 2**32)."""
    pos: int
    """The same, unwrapped (the first one seen is 2**32, so a segment before it stays
    positive)."""
    spans: list[list[int]] = field(default_factory=list)
    """Merged ``[start, end)`` ranges carried so far, sorted, disjoint."""


class FirstSend:
    """Payload bytes per connection direction not carried before: :meth:`add` returns a
    segment's new bytes (its length less its overlap with the ranges already seen)."""

    def __init__(self) -> None:
        self.flows: dict[tuple[bytes, int, bytes, int], _Flow] = {}

    def _unwrap(self, key: tuple[bytes, int, bytes, int], seq: int) -> tuple[_Flow, int]:
        flow = self.flows.get(key)
        if flow is None:
            flow = self.flows[key] = _Flow(raw=seq, pos=SEQ_MOD)
            return flow, SEQ_MOD
        delta = (seq - flow.raw + SEQ_MOD // 2) % SEQ_MOD - SEQ_MOD // 2
        pos = flow.pos + delta
        if delta > 0:
            flow.raw, flow.pos = seq, pos
        return flow, pos

    def add(self, seg: Segment) -> int:
        if seg.length <= 0:
            return 0
        flow, a = self._unwrap((seg.src, seg.sport, seg.dst, seg.dport), seg.seq)
        b = a + seg.length
        spans = flow.spans
        # the spans that touch or overlap [a, b): merge them with it
        i = bisect.bisect_left(spans, [a, a])
        if i > 0 and spans[i - 1][1] >= a:
            i -= 1
        j, covered = i, 0
        lo, hi = a, b
        while j < len(spans) and spans[j][0] <= b:
            s, e = spans[j]
            covered += max(0, min(e, b) - max(s, a))
            lo, hi = min(lo, s), max(hi, e)
            j += 1
        spans[i:j] = [[lo, hi]]
        return seg.length - covered


@dataclass
class Counts:
    """One link and direction's cumulative counts."""

    wire: int = 0
    payload: int = 0
    first: int = 0
    frames: int = 0
    seen: FirstSend = field(default_factory=FirstSend)
    conns: dict[str, int] = field(default_factory=dict)
    """First-send bytes per connection direction, ``"SRC:SPORT>DST:DPORT"``."""

    def add(self, frame: bytes | memoryview) -> None:
        self.frames += 1
        self.wire += len(frame)
        seg = parse(frame)
        if seg is not None:
            self.payload += seg.length
            new = self.seen.add(seg)
            self.first += new
            if new:
                key = f"{_ip(seg.src)}:{seg.sport}>{_ip(seg.dst)}:{seg.dport}"
                self.conns[key] = self.conns.get(key, 0) + new

    def to_dict(self) -> dict[str, int]:
        return {"wire": self.wire, "payload": self.payload, "first": self.first,
                "frames": self.frames}  # fmt: skip


def _ip(raw: bytes) -> str:
    return ".".join(str(b) for b in raw)


def sniff(prefix: str, period_s: float) -> None:
    """The command line's loop (see the module's doc)."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: root, a bigger buffer
    buf = bytearray(1 << 18)
    counts: dict[tuple[str, str], Counts] = {}
    drops = 0

    def emit() -> None:
        nonlocal drops
        stats = sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)
        drops += struct.unpack("II", stats)[1]  # reset by each read
        links: dict[str, dict[str, dict[str, int]]] = {}
        conns: dict[str, dict[str, dict[str, int]]] = {}
        for (link, way), c in sorted(counts.items()):
            links.setdefault(link, {})[way] = c.to_dict()
            conns.setdefault(link, {})[way] = dict(c.conns)
        line = {"t": time.time(), "drops": drops, "links": links, "conns": conns}
        print(json.dumps(line), flush=True)

    print("ready", flush=True)
    next_emit = time.monotonic() + period_s
    while True:
        wait = max(0.0, next_emit - time.monotonic())
        ready, _, _ = select.select([sock, sys.stdin], [], [], wait)
        if sys.stdin in ready and not sys.stdin.readline():
            emit()
            return
        if sock in ready:
            while True:
                try:
                    n, addr = sock.recvfrom_into(buf, len(buf), socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                if not addr[0].startswith(prefix):
                    continue
                way = "out" if addr[2] == PACKET_OUTGOING else "in"
                key = (addr[0], way)
                if key not in counts:
                    counts[key] = Counts()
                counts[key].add(memoryview(buf)[:n])
                if time.monotonic() >= next_emit:
                    break
        if time.monotonic() >= next_emit:
            emit()
            next_emit += period_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", required=True, help="the links' name prefix (e.g. rv)")
    ap.add_argument("--period", type=float, default=0.25, help="seconds between lines")
    a = ap.parse_args(argv)
    sniff(a.prefix, a.period)
    return 0


if __name__ == "__main__":
    sys.exit(main())
