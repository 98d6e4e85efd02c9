"""How late a member's link is now, from its heartbeats: the planner's measure of a
latency spike. Pure: the coordinator feeds it stamps and arrival times.

Every heartbeat carries its sender's wall clock when it was stamped (``sent``). Its
one-way delay as seen here, ``received - sent``, is the link's latency plus the offset
between the two clocks; the offset is unknown but steady, so the lowest delay seen over
a window (the *floor*, as LEDBAT takes its base delay) stands for "this link, unloaded",
and the excess over it is the extra latency now. Two more rules make it usable for a
decision:

- the excess of the last **two** heartbeats (the smaller), so that one late line (a busy
  coordinator, a preempted sender) is not a spike;
- *silence* counts too: with no heartbeat for ``s`` seconds where one comes every ``i``,
  the next one is at least ``s - 1.5 i`` late, so a link that stops delivering (or a
  process that stops) is seen as lagging before its next line arrives.

Limits: a link already lagging when its member is admitted has that lag in its floor
until the window forgets it; a step of either wall clock (NTP) shifts every delay, which
the planner tolerates by comparing members with each other (:func:`excess_over_peers`),
not with zero; it measures the control link, a proxy for the data plane's paths.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

WINDOW = 3000
"""Delays the floor is the minimum of (5 minutes of heartbeats at the default 100 ms)."""


class LinkLag:
    """One member's link: the floor of its delays and its recent excess over it."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._mins: deque[tuple[int, float]] = deque()  # (index, delay), increasing delay
        self._recent: deque[float] = deque(maxlen=2)
        self._count = 0
        self.last_arrival: float | None = None

    def sample(self, sent: float, received_wall: float, arrival: float) -> None:
        """A heartbeat stamped at ``sent`` (its sender's wall clock) reached us at
        ``received_wall`` (ours) and at ``arrival`` (our monotonic clock)."""
        delay = received_wall - sent
        i = self._count
        self._count += 1
        while self._mins and self._mins[-1][1] >= delay:
            self._mins.pop()  # a sliding-window minimum: O(1) amortised
        self._mins.append((i, delay))
        while self._mins[0][0] <= i - self.window:
            self._mins.popleft()
        self._recent.append(delay)
        self.last_arrival = arrival

    def lag_s(self, now: float, interval_s: float) -> float:
        """Seconds the link is late now (0: as fast as its floor), at monotonic ``now``."""
        if not self._mins or self.last_arrival is None:
            return 0.0
        floor = self._mins[0][1]
        measured = min(self._recent) - floor
        silence = now - self.last_arrival - 1.5 * interval_s
        return max(0.0, measured, silence)


def excess_over_peers(lags: Sequence[float], i: int) -> float:
    """Member ``i``'s lag over the median of the others': what a spike on its own link
    adds, with whatever delays every member alike (a clock step, a busy coordinator)
    taken out."""
    others = [x for j, x in enumerate(lags) if j != i]
    return lags[i] - (statistics.median(others) if others else 0.0)


def bench_pays(step_s: float, lag_s: float, members: int, spare: bool) -> bool:
    """Whether steps are faster without a member whose link lags ``lag_s``: with it,
    every step waits its lag at least once (its data-plane send); without it, its slots
    go to the others (``members - 1`` of them), unless a warm spare takes its place."""
    if members < 2:
        return False
    without = step_s if spare else step_s * members / (members - 1)
    return step_s + lag_s > without


__all__ = ["WINDOW", "LinkLag", "bench_pays", "excess_over_peers"]
