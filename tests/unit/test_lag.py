"""A member's link lag from its heartbeats' stamps, and when benching it pays. Pure."""

from __future__ import annotations

import pytest

from perdure.runtime.control.lag import LinkLag, bench_pays, excess_over_peers
from perdure.runtime.member.wchaos import DelayedLink

OFFSET = 123.0
"""The sender's clock runs this far behind ours: the floor takes it out."""


def _beats(lag: LinkLag, start: float, n: int, delay: float, every: float = 0.1) -> float:
    t = start
    for _ in range(n):
        lag.sample(sent=t - OFFSET, received_wall=t + delay, arrival=t + delay)
        t += every
    return t


def test_a_steady_link_has_no_lag_whatever_the_clock_offset() -> None:
    lag = LinkLag()
    t = _beats(lag, 0.0, 50, delay=0.002)
    assert lag.lag_s(t, 0.1) == pytest.approx(0.0, abs=1e-9)


def test_a_latency_spike_shows_after_two_late_heartbeats_and_goes_with_them() -> None:
    lag = LinkLag()
    t = _beats(lag, 0.0, 50, delay=0.002)
    t = _beats(lag, t, 1, delay=0.802)
    assert lag.lag_s(t + 0.8, 0.1) == pytest.approx(0.0, abs=1e-9)  # one late line: noise
    t = _beats(lag, t, 1, delay=0.802)
    assert lag.lag_s(t + 0.8, 0.1) == pytest.approx(0.8)
    t = _beats(lag, t, 2, delay=0.002)
    assert lag.lag_s(t, 0.1) == pytest.approx(0.0, abs=1e-9)


def test_silence_is_lag_before_the_next_heartbeat_arrives() -> None:
    lag = LinkLag()
    t = _beats(lag, 0.0, 20, delay=0.0)
    last = t - 0.1
    assert lag.lag_s(last + 0.15, 0.1) == 0.0  # within one and a half intervals
    assert lag.lag_s(last + 1.15, 0.1) == pytest.approx(1.0)


def test_the_floor_forgets_what_left_its_window() -> None:
    lag = LinkLag(window=10)
    t = _beats(lag, 0.0, 10, delay=0.0)
    t = _beats(lag, t, 10, delay=0.5)  # a lasting change of path: the new normal
    assert lag.lag_s(t, 0.1) == pytest.approx(0.0, abs=1e-9)


def test_a_delay_every_member_shares_is_not_one_members_excess() -> None:
    assert excess_over_peers([0.7, 0.7, 0.7], 0) == pytest.approx(0.0)
    assert excess_over_peers([0.0, 2.0, 0.1], 1) == pytest.approx(1.95)


def test_benching_pays_when_waiting_costs_more_than_carrying_the_slots() -> None:
    # 3 members, 0.1 s steps: without one, 0.15 s; with a 0.5 s lag, 0.6 s
    assert bench_pays(0.1, 0.5, members=3, spare=False)
    assert not bench_pays(0.1, 0.04, members=3, spare=False)
    assert bench_pays(0.1, 0.04, members=3, spare=True)  # a spare takes its slots
    assert not bench_pays(0.1, 9.0, members=1, spare=False)  # never the last member


def test_a_delayed_link_sends_in_order_at_the_senders_rate_after_the_latency() -> None:
    sent: list[int] = []
    link = DelayedLink(sent.append)
    for i in range(5):
        link.send(i, 0.25, now=i * 0.1)  # stamped every 0.1 s, 0.25 s late
    assert sent == [0, 1]
    link.send(5, 0.0, now=0.5)  # the latency drops: the queue still goes out first
    assert sent == [0, 1, 2]  # 3 (due 0.55) and 4 (0.65) are still on the link, and 5 after them
    link.send(6, 0.0, now=0.8)
    assert sent == [0, 1, 2, 3, 4, 5, 6]
