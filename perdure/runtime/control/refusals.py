"""Refused connections, counted: one ``refused`` record per interval, not one per peer.

Whoever can reach a port can open connections to it; a line in ``events.jsonl`` per refused
connection would let any of them grow the run's log without bound (and slow the writer
that every member's records go through). So the doors of a run (the control channel, the
store) count what they turn away before authentication, by reason, and the coordinator
writes one record per door per ``INTERVAL_S`` at most, with the counts. Refusals of a peer
that proved the run token (a duplicate name, a protocol version, the run is over) are not
counted here: those are few, meaningful, and logged one by one by the policy.

Limit: the reasons are bounded (``MAX_REASONS`` distinct texts per record, the rest summed
under ``OTHER``), so a peer that varies its garbage cannot grow one record either.
"""

from __future__ import annotations

import threading
from typing import Any

from perdure import events as ev

INTERVAL_S = 1.0
"""At most one record per door per this many seconds."""
MAX_REASONS = 8
"""Distinct reasons in one record; further ones are summed under ``OTHER``."""
MAX_REASON_CHARS = 160
OTHER = "other reasons"


class Refusals:
    """A thread-safe tally of one door's refusals since its last record."""

    def __init__(self, door: str, interval_s: float = INTERVAL_S) -> None:
        self.door = door
        self.interval_s = interval_s
        self.total = 0
        """Every refusal since this door opened (for tests and the final record)."""
        self._lock = threading.Lock()
        self._reasons: dict[str, int] = {}
        self._since: float | None = None

    def note(self, reason: str, now: float) -> None:
        """Count one refused connection (``now``: a monotonic clock's reading)."""
        reason = reason[:MAX_REASON_CHARS]
        with self._lock:
            self.total += 1
            if self._since is None:
                self._since = now
            if reason not in self._reasons and len(self._reasons) >= MAX_REASONS:
                reason = OTHER
            self._reasons[reason] = self._reasons.get(reason, 0) + 1

    def take(self, now: float, *, final: bool = False) -> dict[str, Any] | None:
        """The record of the refusals counted since the last one, once ``interval_s`` has
        passed since the first of them (``final``: now, whatever the time); else None."""
        with self._lock:
            if self._since is None or (not final and now - self._since < self.interval_s):
                return None
            reasons, since = self._reasons, self._since
            self._reasons, self._since = {}, None
        count = sum(reasons.values())
        top = max(reasons, key=lambda r: reasons[r])
        return {
            "event": ev.REFUSED,
            "worker": None,
            "door": self.door,
            "count": count,
            "reason": top,
            "reasons": reasons,
            "over_s": round(max(0.0, now - since), 3),
        }


__all__ = ["INTERVAL_S", "Refusals"]
