"""benchmarks/_tcp_payload.py's pure parts on crafted frames: the parser and the
first-send count (no namespaces, no raw socket)."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _tcp_payload import Counts, FirstSend, Segment, parse

SRC, DST = bytes([10, 231, 1, 1]), bytes([10, 231, 2, 1])


def frame(seq: int, payload: int, *, proto: int = 6, ethertype: int = 0x0800, ihl: int = 20,
          doff: int = 20, frag: int = 0x4000, pad: int = 0, sport: int = 5000,
          dport: int = 6000, total: int | None = None) -> bytes:  # fmt: skip
    """An Ethernet frame holding one IPv4 TCP segment of ``payload`` bytes."""
    eth = b"\x02" * 6 + b"\x04" * 6 + struct.pack("!H", ethertype)
    length = ihl + doff + payload if total is None else total
    ip = struct.pack("!BBHHHBBH4s4s", 0x40 | ihl // 4, 0, length, 1, frag, 64, proto, 0, SRC,
                     DST) + b"\x00" * (ihl - 20)  # fmt: skip
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, (doff // 4) << 4, 0x18, 65535, 0, 0)
    return eth + ip + tcp + b"\x00" * (doff - 20) + b"x" * payload + b"\x00" * pad


def seg(seq: int, length: int) -> Segment:
    return Segment(SRC, 5000, DST, 6000, seq, length)


def test_a_tcp_frame_parses_to_its_connection_sequence_and_payload_length() -> None:
    assert parse(frame(1234, 1000)) == Segment(SRC, 5000, DST, 6000, 1234, 1000)


def test_options_in_either_header_are_not_payload() -> None:
    assert parse(frame(7, 100, ihl=28, doff=32)) == Segment(SRC, 5000, DST, 6000, 7, 100)


def test_an_ethernet_pad_is_not_payload() -> None:
    got = parse(frame(9, 0, pad=6))
    assert got is not None and got.length == 0


def test_an_unset_total_length_takes_the_frames() -> None:
    got = parse(frame(9, 300, total=0))
    assert got is not None and got.length == 300


def test_frames_that_are_not_a_whole_ipv4_tcp_segment_give_none() -> None:
    assert parse(frame(1, 10, proto=17)) is None  # UDP
    assert parse(frame(1, 10, ethertype=0x86DD)) is None  # IPv6
    assert parse(frame(1, 10, frag=0x0010)) is None  # a later fragment
    assert parse(frame(1, 10)[:40]) is None  # cut inside the TCP header
    assert parse(frame(1, 10, total=4000)) is None  # claims more than the frame holds
    assert parse(b"\x00" * 20) is None


def test_a_resent_segment_counts_no_new_bytes() -> None:
    f = FirstSend()
    assert [f.add(seg(100, 50)), f.add(seg(150, 50)), f.add(seg(100, 50))] == [50, 50, 0]


def test_a_segment_overlapping_seen_ranges_counts_only_its_new_part() -> None:
    f = FirstSend()
    assert f.add(seg(100, 50)) == 50
    assert f.add(seg(200, 50)) == 50  # a gap [150, 200): the segment before was lost
    assert f.add(seg(120, 150)) == 70  # [120, 270): new are [150, 200) and [250, 270)
    assert f.flows[(SRC, 5000, DST, 6000)].spans == [[1 << 32, (1 << 32) + 170]]
    assert f.add(seg(90, 10)) == 10  # before the first segment seen
    assert f.add(seg(95, 175)) == 0  # [95, 270): seen
    assert f.add(seg(95, 200)) == 25  # [270, 295) new


def test_connections_and_their_directions_are_counted_apart() -> None:
    f = FirstSend()
    assert f.add(seg(100, 50)) == 50
    assert f.add(Segment(DST, 6000, SRC, 5000, 100, 50)) == 50
    assert f.add(Segment(SRC, 5001, DST, 6000, 100, 50)) == 50


def test_sequence_numbers_are_unwrapped_past_two_to_the_32() -> None:
    f = FirstSend()
    top = (1 << 32) - 100
    assert f.add(seg(top, 100)) == 100
    assert f.add(seg(0, 100)) == 100  # wrapped: the next 100 bytes, not a resend
    assert f.add(seg(top + 50, 100)) == 0  # spans the wrap: all seen
    assert f.add(seg(100, 10)) == 10


def test_empty_segments_count_nothing() -> None:
    f = FirstSend()
    assert f.add(seg(100, 0)) == 0
    assert f.flows == {}


def test_counts_add_frames_wire_bytes_payload_and_first_sends() -> None:
    c = Counts()
    a, b = frame(1000, 500), frame(1500, 500)
    for fr in (a, b, a, frame(0, 0), frame(1, 10, proto=17)):
        c.add(fr)
    assert c.to_dict() == {
        "wire": 2 * len(a) + len(b) + len(frame(0, 0)) + len(frame(1, 10, proto=17)),
        "payload": 1500,
        "first": 1000,
        "frames": 5,
    }


def test_counts_keep_each_connections_first_sends_apart() -> None:
    """What tells the data plane from the control plane: first sends by connection."""
    c = Counts()
    for fr in (frame(1000, 500), frame(1000, 500), frame(1, 40, sport=29700, dport=41000)):
        c.add(fr)
    assert c.conns == {"10.231.1.1:5000>10.231.2.1:6000": 500,
                       "10.231.1.1:29700>10.231.2.1:41000": 40}  # fmt: skip
