"""Whether this coordinator may coordinate: the run's lease and the fence, as decisions.

One control plane, never two: the policy coordinates only while it holds the run's lease
(``control/lease.py``), under its *generation*, carried by every welcome, announcement and
start. The lease's I/O happens outside (the server's lease agent); its answers arrive as
events (:class:`~events.LeaseGranted`, ...), and :class:`Leadership` decides:

- A primary renews (:class:`~events.HoldLease`) while it coordinates: before its first
  epoch, and while at least one worker is connected. One that reaches no worker stops
  renewing (:class:`~events.WatchLease`), so a standby that does reach them can take over;
  a worker that knocks before then makes it renew again. When its own view of the lease
  runs out, it stops coordinating at once (:meth:`Leadership.lapse`): it drops every
  worker (they stop stepping and look for a coordinator) and refuses hellos with "retry"
  until it renews.
- A standby takes over only when the primary is known dead: the store shows the lease
  expired, *and* its own probe of the primary's channel gets no answer from a serving
  coordinator (dead, hung, cut off, or unable to reach the store itself). A worker that
  reaches the standby is no such proof: it is told to retry, and goes back to the primary.
  Then it acquires the lease (:class:`~events.AcquireLease`, a compare-and-swap that fails
  if the primary renewed meanwhile) and rebuilds its view from the workers' hellos.
- A coordinator that sees a newer generation (in the store, or in a worker's hello) is
  fenced out (:meth:`Leadership.fence`): it logs ``coordinator_fenced``, drops its workers
  and stops, writing nothing else.
"""

from __future__ import annotations

import math

from perdure import events as ev
from perdure.runtime.control.events import (
    AcquireLease,
    Disconnect,
    Finish,
    HoldLease,
    LeaseGranted,
    LeaseLost,
    LeaseObserved,
    LeaseUnavailable,
    PrimaryProbed,
    ProbePrimary,
    WatchLease,
)
from perdure.runtime.control.lease import LeaseView
from perdure.runtime.control.state import Board

LeaseEvent = LeaseGranted | LeaseObserved | LeaseLost | LeaseUnavailable | PrimaryProbed


def wants_lease(served: bool, connected: int) -> bool:
    """Whether a leading coordinator renews: before the first epoch of its generation, or
    with a worker connected. One that reaches nobody lets its lease run out."""
    return not served or connected > 0


def should_probe(view: LeaseView, *, busy: bool, since_probe_s: float, ttl_s: float) -> bool:
    """Whether a standby probes the primary now: the store shows the lease held but
    expired, no probe or acquisition is under way, and half a TTL passed since the last."""
    return view.state == "held" and not view.live and not busy and since_probe_s >= ttl_s / 2


def wait_reason(*, fenced: bool, generation: int, view: LeaseView | None) -> str:
    """Why a hello is told to retry while this coordinator does not lead."""
    if fenced:
        return f"fenced out: generation {generation} was superseded"
    if generation == 0:
        g = view.generation if view else 0
        return f"standby: the primary holds the run's lease (generation {g})"
    return f"the lease of generation {generation} lapsed; renewing it"


class Leadership:
    """The lease's state as this coordinator knows it, and what it does about it."""

    def __init__(self, board: Board, lease_until: float) -> None:
        """``lease_until``: when the primary's initial grant runs out (local clock)."""
        s = board.s
        self.b = board
        self.ttl_s = s.config.cluster.lease_ttl_ms / 1000
        board.generation = 0 if s.standby else s.generation
        self.lease_until = -math.inf if s.standby else lease_until
        self.holding = board.generation > 0
        """The lease agent renews (else it only reads the store)."""
        self.fenced = False
        self.took_over = False
        self.rebuild = False
        """The lease lapsed and came back: rebuild the view from hellos, as a standby."""
        self.store_ok = True
        self.view: LeaseView | None = None
        self.seen_live = False
        self.probing = False
        self.last_probe = -math.inf
        self.probe_detail = ""
        self.acquiring = False
        self.primary_channel = ""
        """Where the last holder's channel was (a lease record may vanish with its lease)."""

    @property
    def leading(self) -> bool:
        """This coordinator holds a lease it may act on, now."""
        b = self.b
        return not self.fenced and b.generation > 0 and b.now < self.lease_until

    @property
    def serving(self) -> bool:
        """What its challenge tells a prober: it leads, or could renew (its store answers)."""
        return not self.fenced and self.b.generation > 0 and (self.leading or self.store_ok)

    def wait_reason(self) -> str:
        """Why a worker is told to retry now; a primary whose lease lapsed renews again (a
        worker knocks: worth coordinating again)."""
        if not self.fenced and self.b.generation > 0 and not self.holding:
            self.hold()
        return wait_reason(fenced=self.fenced, generation=self.b.generation, view=self.view)

    def hold(self) -> None:
        self.holding = True
        self.b.out.append(HoldLease(self.b.generation))

    def keep(self) -> None:
        """Renew while coordinating (see :func:`wants_lease`), else only watch the store."""
        wants = wants_lease(self.b.served, len(self.b.alive()))
        if wants and not self.holding:
            self.hold()
        elif not wants and self.holding:
            self.holding = False
            self.b.out.append(WatchLease())

    def lapse(self) -> None:
        """The lease ran out (local view): stop coordinating before anyone can take over.
        Every worker is dropped, so it stops stepping and looks for a coordinator."""
        b = self.b
        dropped = [w.name for w in b.alive()]
        b.log(ev.LEASE_LAPSED, generation=b.generation, workers=dropped)
        for name in dropped:
            b.workers[name].alive = False
            b.out.append(Disconnect(name))
        b.current, b.pending, b.fail_at = None, None, None
        self.rebuild, b.served = True, False

    def fence(self, newer: int, why: str) -> None:
        """A newer generation exists: drop every worker (they find its holder) and stop.
        The fencing record is the last thing this coordinator writes."""
        if self.fenced:
            return
        b = self.b
        self.fenced, b.finished = True, True
        b.log(ev.COORDINATOR_FENCED, generation=b.generation, newer=newer, reason=why)
        for w in b.alive():
            w.alive = False
            b.out.append(Disconnect(w.name))
        b.current, b.pending = None, None
        b.out.append(Finish())

    def on_event(self, e: LeaseEvent, was_leading: bool) -> None:
        if self.fenced:
            return
        if isinstance(e, LeaseUnavailable):
            if self.store_ok:
                self.b.log(ev.LEASE_UNAVAILABLE, generation=self.b.generation, error=e.error)
            self.store_ok, self.acquiring = False, False
            return
        if isinstance(e, PrimaryProbed):
            self._on_probe(e)
            return
        self.store_ok = True
        if isinstance(e, LeaseGranted):
            self._on_granted(e, was_leading)
            return
        self.view = e.view
        self.seen_live = self.seen_live or e.view.live
        self.primary_channel = str(e.view.holder.get("channel") or self.primary_channel)
        if isinstance(e, LeaseLost):
            self.acquiring = False
        if self.b.generation > 0 and e.view.generation > self.b.generation:
            self.fence(e.view.generation, "the lease store holds a newer generation")
        elif self.b.generation == 0 and isinstance(e, LeaseObserved):
            self._watch_primary(e.view)

    def _watch_primary(self, view: LeaseView) -> None:
        """A standby's turn: the run ended (stop too), or the lease expired (probe)."""
        b = self.b
        if view.state == "ended" and self.seen_live:
            b.finished = True  # the run ended under the primary: nothing to stand by for
            b.out.append(Finish())
        elif should_probe(
            view,
            busy=self.probing or self.acquiring,
            since_probe_s=b.now - self.last_probe,
            ttl_s=self.ttl_s,
        ):
            self.probing = True
            b.out.append(ProbePrimary(self.primary_channel))

    def _on_probe(self, e: PrimaryProbed) -> None:
        self.probing, self.last_probe = False, e.now
        view = self.view
        if e.serving or view is None or view.live or self.b.generation > 0 or self.acquiring:
            return
        self.acquiring, self.probe_detail = True, e.detail
        self.b.out.append(AcquireLease(view))

    def _on_granted(self, e: LeaseGranted, was_leading: bool) -> None:
        b = self.b
        if e.generation < b.generation:
            return  # an answer to an older request
        if e.generation > b.generation:
            previous = self.view.generation if self.view else b.generation
            b.generation, self.acquiring, self.holding = e.generation, False, True
            b.served, self.took_over = False, True
            b.log(
                ev.COORDINATOR_TAKEOVER,
                by="standby",
                generation=e.generation,
                previous=previous,
                probe=self.probe_detail,
            )
        elif not was_leading:
            b.log(ev.LEASE_REGAINED, generation=b.generation)
        self.lease_until = e.until
