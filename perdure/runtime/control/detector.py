"""Phi-accrual failure detection (Hayashibara et al. 2004, as used by Akka and Cassandra).

Instead of a fixed timeout, the detector keeps the recent inter-arrival times of a peer's
heartbeats and reports ``phi = -log10(P(a heartbeat arrives later than now))`` under a
normal model of those intervals. A threshold of 8 to 12 is common practice. Like Akka, the
model's mean is shifted by an *acceptable pause*: a latency spike shorter than that pause
keeps phi low, so a slow peer is not mistaken for a dead one. The detection horizon is
about ``acceptable_pause + mean + a few standard deviations``.
"""

from __future__ import annotations

import math
from collections import deque


class PhiAccrual:
    """Suspicion level of one peer from the arrival times of its heartbeats."""

    def __init__(
        self,
        *,
        expected_interval_s: float,
        acceptable_pause_s: float,
        window: int = 200,
        min_std_s: float = 0.05,
    ) -> None:
        self.acceptable_pause_s = acceptable_pause_s
        self.min_std_s = min_std_s
        self.intervals: deque[float] = deque(maxlen=window)
        self.intervals.extend([expected_interval_s, expected_interval_s * 1.5])
        self.last: float | None = None

    def heartbeat(self, now: float) -> None:
        if self.last is not None:
            self.intervals.append(now - self.last)
        self.last = now

    def phi(self, now: float) -> float:
        if self.last is None:
            return 0.0
        n = len(self.intervals)
        mean = sum(self.intervals) / n
        var = sum((x - mean) ** 2 for x in self.intervals) / n
        std = max(math.sqrt(var), self.min_std_s)
        elapsed = now - self.last
        y = (elapsed - (mean + self.acceptable_pause_s)) / std
        # Logistic approximation of the normal tail used by Akka: P(X > y) = 1 / (1 + e^z),
        # so phi = log10(1 + e^z), computed without overflow.
        z = y * (1.5976 + 0.070566 * y * y)
        ln = z + math.log1p(math.exp(-z)) if z > 0 else math.log1p(math.exp(z))
        return ln / math.log(10)

    def horizon_s(self, threshold: float) -> float:
        """Silence after which phi crosses ``threshold`` (for logs and tests)."""
        lo, hi = 0.0, 3600.0
        last = self.last or 0.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if self.phi(last + mid) >= threshold:
                hi = mid
            else:
                lo = mid
        return hi
