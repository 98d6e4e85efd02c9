"""The lease rules of the coordinator's policy, driven with typed events: no store, no
sockets, no clock. One control plane, never two: a standby takes over only once the
primary's lease expired and no serving primary answers its probe; an old primary that
sees a newer generation fences itself out; a primary whose lease ran out coordinates
nothing."""

from __future__ import annotations

import math
from typing import Any

from perdure import events as ev
from perdure.run_config import RunConfig, with_overrides
from perdure.runtime.control import policy as pol
from perdure.runtime.control import protocol as p
from perdure.runtime.control.lease import LeaseView
from tests.unit.test_policy import Driver, hello

TTL = 2.0
PRIMARY = {"instance": "p1", "channel": "10.0.0.1:7000", "role": "primary"}


def make(
    *, standby: bool = False, lease_until: float = math.inf, workers: int = 2, **cluster: Any
) -> Driver:
    config = with_overrides(
        RunConfig(),
        train={"slots": 4, "global_batch": 8, "steps": 100},
        cluster={
            "regions": [{"name": "r0", "workers": workers}],
            "lease_ttl_ms": int(TTL * 1000),
            **cluster,
        },
    )
    settings = pol.Settings(
        config=config,
        run_dir="/run",
        resume=None,
        store_port=1234,
        instance="abcd",
        expected=workers,
        standby=standby,
    )
    return Driver(pol.Policy(settings, now=0.0, lease_until=lease_until))


def held(generation: int = 1, *, live: bool, version: int = 3) -> LeaseView:
    return LeaseView(generation, version, "held", live, PRIMARY)


def knock(d: Driver, name: str, generation: int = 0, authentic: bool = True) -> list[pol.Effect]:
    d.conns += 1
    h = p.Hello(**{**hello(name).__dict__, "generation": generation})
    return d.feed(pol.Joined(d.conns, h, authentic, d.now))


def of(out: list[pol.Effect], kind: type) -> list[Any]:
    return [e for e in out if isinstance(e, kind)]


def sends(out: list[pol.Effect], kind: type) -> list[Any]:
    return [e.msg for e in out if isinstance(e, pol.Send) and isinstance(e.msg, kind)]


def start_epoch(d: Driver, *names: str, next_step: int = 0) -> None:
    for n in names:
        assert of(knock(d, n), pol.Accept), n
        d.recv(n, p.Heartbeat(next_step=next_step, prepared=True))
    d.tick(1.0)
    d.ready(*names, next_step=next_step)
    assert d.policy.current is not None


def take_over(d: Driver) -> None:
    """Drive a standby through expiry, a failed probe and a grant of generation 2."""
    d.feed(pol.LeaseObserved(held(live=False), d.now))
    d.feed(pol.PrimaryProbed(False, "no answer: connection refused", d.now))
    d.feed(pol.LeaseGranted(2, d.now + 10, d.now))


def test_a_standby_does_not_take_over_while_the_primarys_lease_is_live() -> None:
    d = make(standby=True)
    for _ in range(10):
        d.now += TTL
        out = d.feed(pol.LeaseObserved(held(live=True), d.now))
        assert not of(out, pol.ProbePrimary) and not of(out, pol.AcquireLease)
    # a worker cut from the primary reaches the standby: told to retry, not admitted
    out = knock(d, "w0", generation=1) + knock(d, "w0", generation=1)
    rejects = of(out, pol.Reject)
    assert len(rejects) == 2 and all(r.retry for r in rejects)
    assert "the primary holds the run's lease (generation 1)" in rejects[0].reason
    assert not of(out, pol.Accept) and d.policy.workers == {}
    assert len(d.logged(ev.REFUSED)) == 1  # once per worker, not once per retry
    assert not sends(d.tick(5.0), p.Announce) and not d.logged(ev.COORDINATOR_TAKEOVER)
    assert d.policy.generation == 0 and not d.policy.serving


def test_a_standby_takes_over_an_expired_lease_only_when_no_serving_primary_answers() -> None:
    d = make(standby=True)
    d.feed(pol.LeaseObserved(held(live=True), d.now))
    d.now += TTL
    out = d.feed(pol.LeaseObserved(held(live=False), d.now))
    assert of(out, pol.ProbePrimary) == [pol.ProbePrimary("10.0.0.1:7000")]
    # the primary answers as serving (alive, with no worker for now): no takeover
    out = d.feed(pol.PrimaryProbed(True, "10.0.0.1:7000 serves generation 1", d.now))
    assert not of(out, pol.AcquireLease)
    assert not of(d.feed(pol.LeaseObserved(held(live=False), d.now + 0.1)), pol.ProbePrimary)
    d.now += TTL / 2  # the next probe, paced
    assert of(d.feed(pol.LeaseObserved(held(live=False), d.now)), pol.ProbePrimary)
    out = d.feed(pol.PrimaryProbed(False, "no answer: connection refused", d.now))
    assert of(out, pol.AcquireLease) == [pol.AcquireLease(held(live=False))]
    d.feed(pol.LeaseGranted(2, d.now + 10, d.now))
    assert d.logged(ev.COORDINATOR_TAKEOVER) == [
        {
            "event": ev.COORDINATOR_TAKEOVER,
            "by": "standby",
            "generation": 2,
            "previous": 1,
            "probe": "no answer: connection refused",
        }
    ]
    accepted = of(knock(d, "w0", generation=1), pol.Accept)
    assert accepted and accepted[0].welcome.generation == 2
    d.recv("w0", p.Heartbeat(next_step=7, prepared=True))
    announces = sends(d.tick(1.0), p.Announce)
    assert [(a.generation, a.members) for a in announces] == [(2, ["w0"])]
    # what the workers still alive hold is compared with the newest checkpoint first (the
    # lost members' progress is not known here): the newer of the two is where it starts
    out = d.ready("w0", next_step=7)
    assert of(out, pol.FindCheckpoint) and d.starts(out) == {}
    d.feed(pol.CheckpointFound(of(out, pol.FindCheckpoint)[0].epoch, "/run/ck/5", 5, d.now))
    starts = d.starts(d.tick())
    assert starts["w0"].generation == 2 and starts["w0"].start_step == 7
    assert not starts["w0"].recover


def test_a_standby_that_loses_the_race_for_the_lease_keeps_standing_by() -> None:
    d = make(standby=True)
    d.feed(pol.LeaseObserved(held(live=False), d.now))
    d.feed(pol.PrimaryProbed(False, "no answer", d.now))
    out = d.feed(pol.LeaseLost(held(1, live=True, version=4), d.now))  # the primary renewed
    assert not of(out, pol.Finish) and not d.policy.fenced and d.policy.generation == 0
    assert of(knock(d, "w0", generation=1), pol.Reject)[0].retry


def test_an_old_primary_that_sees_a_newer_generation_is_fenced_out_and_writes_nothing() -> None:
    d = make()
    start_epoch(d, "w0", "w1")
    d.out = []
    out = d.feed(pol.LeaseObserved(held(2, live=True), d.now))
    assert d.logged(ev.COORDINATOR_FENCED) == [
        {
            "event": ev.COORDINATOR_FENCED,
            "generation": 1,
            "newer": 2,
            "reason": "the lease store holds a newer generation",
        }
    ]
    assert sorted(e.worker for e in of(out, pol.Disconnect)) == ["w0", "w1"]
    assert pol.Finish() in out and d.policy.fenced and not d.policy.serving
    assert [type(e) for e in out] == [pol.Log, pol.Disconnect, pol.Disconnect, pol.Finish]
    # from now on: no admission, no epoch, no log line
    later = knock(d, "w0", generation=2) + d.tick(1.0) + d.tick(1.0)
    assert of(later, pol.Reject)[0].retry and not of(later, pol.Accept)
    assert not sends(later, p.Announce) and not of(later, pol.HoldLease)


def test_a_hello_of_a_newer_generation_fences_the_old_primary_but_only_if_authentic() -> None:
    d = make()
    start_epoch(d, "w0", "w1")
    out = knock(d, "w9", generation=7, authentic=False)
    assert "bad run token" in of(out, pol.CountRefusal)[0].reason and not d.policy.fenced
    out = knock(d, "w9", generation=2)
    assert d.policy.fenced and pol.Finish() in out
    assert d.logged(ev.COORDINATOR_FENCED)[0]["reason"] == "worker w9 follows generation 2"
    assert of(out, pol.Reject)[0].retry  # the worker goes on to the newer coordinator


def test_a_primary_whose_lease_ran_out_drops_its_workers_and_coordinates_nothing() -> None:
    d = make(lease_until=5.0)
    start_epoch(d, "w0", "w1")
    d.now = 5.0  # the first event after the deadline: heartbeats from both members
    out = d.recv("w0", p.Heartbeat(next_step=3, prepared=True))
    assert d.logged(ev.LEASE_LAPSED) == [
        {"event": ev.LEASE_LAPSED, "generation": 1, "workers": ["w0", "w1"]}
    ]
    assert sorted(e.worker for e in of(out, pol.Disconnect)) == ["w0", "w1"]
    # the closed connections arrive next: no announcement from a coordinator without lease
    for w in ("w0", "w1"):
        out += d.feed(pol.Closed(w, "connection closed", d.now))
    out += d.tick(1.0)
    assert not sends(out, p.Announce) and not d.logged(ev.EPOCH_ANNOUNCED)[1:]
    # a worker knocks: told to retry while the agent (still renewing) gets the lease back
    out = knock(d, "w0", generation=1)
    assert of(out, pol.Reject)[0].retry and not of(out, pol.Accept)
    d.feed(pol.LeaseGranted(1, d.now + 10, d.now))
    assert d.logged(ev.LEASE_REGAINED) == [{"event": ev.LEASE_REGAINED, "generation": 1}]
    start_epoch(d, "w0", "w1", next_step=3)
    assert d.logged(ev.EPOCH_STARTED)[-1]["reason"] == "lease regained"


def test_a_primary_with_no_worker_stops_renewing_and_renews_when_one_knocks() -> None:
    d = make(lease_until=50.0)
    out = d.tick(1.0)
    assert not of(out, pol.WatchLease)  # before the first epoch it keeps its lease
    start_epoch(d, "w0", "w1")
    assert not of(d.tick(), pol.WatchLease)
    for w in ("w0", "w1"):
        d.feed(pol.Closed(w, "connection closed", d.now))
    out = d.tick()
    assert of(out, pol.WatchLease) == [pol.WatchLease()]
    out = knock(d, "w0", generation=1)  # back while the grant lasts: admitted, renewing
    assert of(out, pol.Accept) and of(d.tick(), pol.HoldLease) == [pol.HoldLease(1)]
    d.feed(pol.Closed("w0", "connection closed", d.now))
    assert of(d.tick(), pol.WatchLease)
    d.now = 50.0
    d.tick(0.0)
    assert d.logged(ev.LEASE_LAPSED)[0]["workers"] == []
    assert d.policy.serving  # alive, its store answers: a standby's probe finds it
    out = knock(d, "w0", generation=1)  # after the lapse: retry, and renew first
    assert of(out, pol.Reject)[0].retry and of(out, pol.HoldLease) == [pol.HoldLease(1)]


def test_the_end_of_the_run_is_marked_in_the_lease_and_a_standby_then_stops() -> None:
    d = make()
    start_epoch(d, "w0", "w1")
    for w in ("w0", "w1"):
        d.recv(w, p.Done(next_step=100, final_hash="sha256:aa"))
    out = d.tick()
    assert out[-2:] == [pol.EndLease(1), pol.Finish()]
    assert d.logged(ev.RUN_END)[0]["generation"] == 1
    s = make(standby=True)
    ended = LeaseView(1, 9, "ended", False, PRIMARY)
    assert not of(s.feed(pol.LeaseObserved(ended, 0.0)), pol.Finish)  # an earlier run's
    s.feed(pol.LeaseObserved(held(live=True), 1.0))
    assert of(s.feed(pol.LeaseObserved(ended, 2.0)), pol.Finish) and s.policy.finished


def test_an_unreachable_lease_store_is_logged_once_and_the_primary_stops_serving() -> None:
    d = make(lease_until=5.0, workers=1)
    start_epoch(d, "w0")
    for _ in range(3):
        d.feed(pol.LeaseUnavailable("LeaseStoreError: timed out", d.now))
    assert len(d.logged(ev.LEASE_UNAVAILABLE)) == 1
    assert d.policy.leading and d.policy.serving  # still within its grant
    d.tick(5.0)
    assert not d.policy.leading and not d.policy.serving  # a standby may now take over
    d.feed(pol.LeaseGranted(1, d.now + 10, d.now))
    assert d.policy.leading and d.policy.serving


def test_a_standby_that_took_over_fences_itself_when_a_newer_one_appears() -> None:
    d = make(standby=True)
    take_over(d)
    assert d.policy.generation == 2 and d.policy.leading
    d.feed(pol.LeaseLost(held(3, live=True), d.now))
    assert d.policy.fenced and d.logged(ev.COORDINATOR_FENCED)[0]["newer"] == 3
