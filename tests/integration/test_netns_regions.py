"""The region fixture: the delay router adds the round trip asked for between regions, and
nothing inside a region."""

from __future__ import annotations

import statistics

from tests.netns_regions import regions


def test_the_delay_router_adds_the_asked_round_trip_between_regions_and_none_inside_one() -> None:
    with regions([2, 1], rtt_ms=30.0) as rs:
        across = rs.echo_rtts(0, 2, count=10)
        within = rs.echo_rtts(0, 1, count=10)
        assert min(across) >= 30.0 and statistics.median(across) < 30.0 + 10.0, across
        assert statistics.median(within) < 5.0, within
        rs.set_rtt(0.0)
        assert statistics.median(rs.echo_rtts(0, 2, count=10)) < 5.0
