"""The coordinator's policy, driven with typed events and no processes, sockets or clock."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from perdure import events as ev
from perdure.run_config import RunConfig, with_overrides
from perdure.runtime.control import policy as pol
from perdure.runtime.control import protocol as p
from perdure.runtime.plan import Plan


def make_policy(
    workers: int = 3, slots: int = 6, train: dict[str, Any] | None = None, **cluster: Any
) -> pol.Policy:
    config = with_overrides(
        RunConfig(),
        train={"slots": slots, "global_batch": 2 * slots, "steps": 100, **(train or {})},
        cluster={"regions": [{"name": "r0", "workers": workers}], **cluster},
    )
    settings = pol.Settings(
        config=config,
        run_dir="/run",
        resume=None,
        store_port=1234,
        instance="abcd",
        expected=workers,
    )
    return pol.Policy(settings, now=0.0)


def hello(
    name: str,
    *,
    version: int = p.PROTOCOL_VERSION,
    epoch: int = -1,
    region: str = "r0",
    pid: int = 1,
) -> p.Hello:
    return p.Hello(
        name=name,
        region=region,
        role="worker",
        pid=pid,
        next_step=0,
        has_state=True,
        epoch=epoch,
        mac="x",
        version=version,
    )


class Driver:
    """A policy and the effects it produced, with helpers for the usual sequences."""

    def __init__(self, policy: pol.Policy) -> None:
        self.policy = policy
        self.now = 0.0
        self.conns = 0
        self.out: list[pol.Effect] = []

    def feed(self, event: pol.Event) -> list[pol.Effect]:
        out = self.policy.handle(event)
        self.out += out
        return out

    def admit(self, *names: str, prepared: bool = True, region: str = "r0") -> None:
        for name in names:
            self.conns += 1
            out = self.feed(pol.Joined(self.conns, hello(name, region=region), True, self.now))
            assert any(isinstance(e, pol.Accept) and e.worker == name for e in out), out
            if prepared:
                self.recv(name, p.Heartbeat(next_step=0, prepared=True))

    def recv(self, name: str, msg: p.FromWorker) -> list[pol.Effect]:
        return self.feed(pol.Received(name, msg, self.now))

    def tick(self, dt: float = 0.01) -> list[pol.Effect]:
        self.now += dt
        return self.feed(pol.Tick(self.now))

    def ready(self, *names: str, next_step: int = 0, has_state: bool = True) -> list[pol.Effect]:
        assert self.policy.pending is not None
        epoch = self.policy.pending.epoch
        out: list[pol.Effect] = []
        for n in names:
            out += self.recv(n, p.Ready(epoch=epoch, next_step=next_step, has_state=has_state))
        return out + self.tick()

    def starts(self, out: list[pol.Effect] | None = None) -> dict[str, p.Start]:
        effects = self.out if out is None else out
        return {
            e.to: e.msg for e in effects if isinstance(e, pol.Send) and isinstance(e.msg, p.Start)
        }

    def logged(self, name: str) -> list[dict[str, object]]:
        return [e.record for e in self.out if isinstance(e, pol.Log) and e.record["event"] == name]


def running(workers: int = 3, **kw: Any) -> Driver:
    """A policy whose first epoch (epoch 0) has started with w0..w{n-1}."""
    d = Driver(make_policy(workers, **kw))
    d.admit(*[f"w{i}" for i in range(workers)])
    d.tick()
    assert d.policy.pending is not None and d.policy.pending.epoch == 0
    d.ready(*[f"w{i}" for i in range(workers)])
    assert d.policy.current is not None and d.policy.pending is None
    return d


def test_the_first_epoch_starts_once_every_expected_worker_is_ready() -> None:
    d = Driver(make_policy(3))
    d.admit("w0", "w1")
    assert d.tick() == []  # two of three: wait
    d.admit("w2")
    out = d.tick()
    notices = [e for e in out if isinstance(e, pol.Send)]
    assert {e.to for e in notices} == {"w0", "w1", "w2"}
    first = p.Announce(epoch=0, members=["w0", "w1", "w2"], after=-1, generation=1)
    assert all(e.msg == first for e in notices)
    starts = d.starts(d.ready("w0", "w1", "w2"))
    assert set(starts) == {"w0", "w1", "w2"}
    start = starts["w0"]
    assert Plan.from_dict(start.plan).counts() == [2, 2, 2]
    assert (start.start_step, start.source, start.receivers) == (0, "w0", [])
    assert start.prefix == "pg/0/abcd/"


def test_a_send_that_fails_during_a_start_leads_to_a_new_epoch_without_that_member() -> None:
    """Before the split, a failed send inside the start loop re-entered the state machine:
    the start then overwrote the new pending epoch, and the survivors waited for ever."""
    d = running(3)
    d.recv("w0", p.Heartbeat(next_step=5, prepared=True))
    out = d.feed(pol.Closed("w1", "send failed: broken pipe", d.now))
    assert pol.Disconnect("w1") in out
    pending = d.policy.pending
    assert pending is not None and pending.members == ["w0", "w2"] and pending.after == -1
    assert d.logged(ev.LEAVE)[-1] == {
        "event": ev.LEAVE,
        "worker": "w1",
        "reason": "send failed: broken pipe",
    }
    starts = d.starts(d.ready("w0", "w2", next_step=5))
    assert set(starts) == {"w0", "w2"}
    assert Plan.from_dict(starts["w0"].plan).members == ("w0", "w2")
    assert starts["w0"].epoch == 1 and starts["w0"].start_step == 5


def test_a_death_between_announce_and_start_reannounces_without_it() -> None:
    d = Driver(make_policy(3))
    d.admit("w0", "w1", "w2")
    d.tick()
    d.recv("w0", p.Ready(epoch=0, next_step=0, has_state=True))
    d.feed(pol.Closed("w2", "connection closed (process exited)", d.now))
    pending = d.policy.pending
    assert pending is not None and pending.epoch == 1 and pending.members == ["w0", "w1"]
    # a late ready for the superseded epoch does not count for the new one
    d.recv("w1", p.Ready(epoch=0, next_step=0, has_state=True))
    d.tick()
    assert d.policy.pending is not None and d.starts() == {}
    starts = d.starts(d.ready("w0", "w1"))
    assert set(starts) == {"w0", "w1"} and starts["w1"].epoch == 1


def test_two_deaths_in_one_tick_leave_one_pending_epoch_with_the_survivor() -> None:
    d = running(3)
    d.feed(pol.Closed("w0", "connection closed (process exited)", d.now))
    d.feed(pol.Closed("w2", "connection closed (process exited)", d.now))
    pending = d.policy.pending
    assert pending is not None and pending.members == ["w1"] and pending.epoch == 2
    start = d.starts(d.ready("w1"))["w1"]
    assert Plan.from_dict(start.plan).counts() == [6]
    assert [r["worker"] for r in d.logged(ev.LEAVE)] == ["w0", "w2"]


def test_a_join_racing_a_death_keeps_the_joiner_as_a_receiver() -> None:
    d = running(3)
    d.feed(pol.Closed("w1", "connection closed (process exited)", d.now))
    d.ready("w0", "w2", next_step=3)
    assert d.policy.current is not None and d.policy.current.members == ("w0", "w2")
    d.admit("w1")  # the replacement, under the same name
    d.recv("w0", p.Heartbeat(next_step=4, prepared=True))
    d.tick()
    grow = d.policy.pending
    assert grow is not None and grow.reason == "join" and grow.after >= 5
    assert grow.members == ["w0", "w1", "w2"]
    d.feed(pol.Closed("w2", "connection closed (process exited)", d.now))
    pending = d.policy.pending
    assert pending is not None and pending.members == ["w0", "w1"] and pending.after == -1
    d.recv("w0", p.Ready(epoch=pending.epoch, next_step=6, has_state=True))
    d.recv("w1", p.Ready(epoch=pending.epoch, next_step=0, has_state=False))
    start = d.starts(d.tick())["w1"]
    assert (start.source, start.receivers, start.start_step) == ("w0", ["w1"], 6)


def test_a_planned_join_starts_far_enough_ahead_of_every_member() -> None:
    d = running(2, heartbeat_ms=100)
    for w in ("w0", "w1"):
        d.recv(w, p.Heartbeat(next_step=10, prepared=True, slot_s=0.01))  # 30 ms steps
    d.policy.s = pol.Settings(**{**d.policy.s.__dict__, "expected": 3})
    d.admit("w2")
    d.tick()
    pending = d.policy.pending
    # a heartbeat can be 100 ms late and the notice takes up to another: 200 ms / 30 ms
    assert pending is not None and pending.after == 10 + 1 + pol.boundary_margin(0.03, 0.1)
    assert pol.boundary_margin(0.03, 0.1) == 7


def test_a_slow_member_loses_at_most_max_moves_slots_per_replan_and_regains_them() -> None:
    d = running(3, slots=12, max_slot_moves=2, replan_interval_ms=1000, slow_ratio=2.0)
    for w, s in (("w0", 0.01), ("w1", 0.01), ("w2", 0.05)):
        d.recv(w, p.Heartbeat(next_step=1, prepared=True, slot_s=s))
    assert d.tick(0.5) == [] or d.policy.pending is None  # within the interval: no re-plan
    d.tick(1.0)
    pending = d.policy.pending
    assert pending is not None and pending.reason == "rebalance" and pending.after > 1
    start = d.starts(d.ready("w0", "w1", "w2", next_step=pending.after))["w2"]
    counts = Plan.from_dict(start.plan).counts()
    assert counts == [6, 4, 2]  # two slots moved off w2 (ties go to the first member)
    d.recv("w2", p.Heartbeat(next_step=9, prepared=True, slot_s=0.01))  # recovered
    d.tick(1.5)
    pending = d.policy.pending
    assert pending is not None and pending.plan_counts == [4, 4, 4]  # two moved back


def test_a_dropped_link_reforms_the_same_members_once_no_death_explains_it() -> None:
    d = running(2)
    d.recv("w1", p.Fail(epoch=0, error="Connection closed by peer"))
    assert d.tick(0.01) == [] or d.policy.pending is None
    d.tick(pol.FAIL_SETTLE_S)
    pending = d.policy.pending
    assert pending is not None and pending.members == ["w0", "w1"]
    assert pending.reason == "collective failed"


CKPT = "/run/checkpoints/step-00000040"


def _answered(d: Driver, out: list[pol.Effect], path: str | None, step: int) -> dict[str, p.Start]:
    """The pending epoch asked for the newest checkpoint and started nothing; the starts
    once the coordinator's answer (``path`` at ``step``) came."""
    epoch = d.policy.pending.epoch if d.policy.pending else -1
    assert pol.FindCheckpoint(epoch) in out and d.starts(out) == {}
    d.feed(pol.CheckpointFound(epoch, path, step, d.now))
    return d.starts(d.tick())


def test_when_every_replica_is_lost_the_epoch_starts_from_the_newest_checkpoint() -> None:
    d = running(2)
    d.feed(pol.Closed("w0", "gone", d.now))
    d.feed(pol.Closed("w1", "gone", d.now))
    d.admit("w0")
    d.tick()  # "all members lost": re-announced with whoever is alive
    start = _answered(d, d.ready("w0", next_step=0, has_state=False), CKPT, 40)["w0"]
    assert (start.recover, start.reload, start.start_step) == (True, CKPT, 40)


def _only_a_stale_member_left(d: Driver) -> list[pol.Effect]:
    """w0 and w1 committed step 49 and die; w2 holds state of step 10 (it was benched)."""
    for n in ("w0", "w1"):
        d.recv(n, p.Heartbeat(next_step=50, prepared=True))
    d.feed(pol.Closed("w0", "gone", d.now))
    d.feed(pol.Closed("w1", "gone", d.now))
    d.tick()
    return d.ready("w2", next_step=10, has_state=True)


def test_a_live_state_older_than_the_newest_checkpoint_gives_way_to_the_checkpoint() -> None:
    d = running(3)
    start = _answered(d, _only_a_stale_member_left(d), CKPT, 40)["w2"]  # 10 < 50: asked
    assert (start.recover, start.reload, start.start_step) == (True, CKPT, 40)
    [logged] = d.logged(ev.RECOVERED_FROM_CHECKPOINT)
    assert (logged["start_step"], logged["live_step"]) == (40, 10)


@pytest.mark.parametrize("found", [("/run/checkpoints/step-00000005", 5), (None, 0)])
def test_a_live_state_newer_than_every_checkpoint_is_kept(found: tuple[str | None, int]) -> None:
    d = running(3)
    start = _answered(d, _only_a_stale_member_left(d), *found)["w2"]
    assert (start.recover, start.reload, start.start_step) == (False, None, 10)


def test_survivors_up_to_date_start_at_once_without_looking_for_a_checkpoint() -> None:
    d = running(3)
    for n in ("w0", "w1", "w2"):
        d.recv(n, p.Heartbeat(next_step=50, prepared=True))
    d.feed(pol.Closed("w2", "gone", d.now))
    d.tick()
    out = d.ready("w0", "w1", next_step=50)
    assert not [e for e in out if isinstance(e, pol.FindCheckpoint)]
    assert {s.start_step for s in d.starts(out).values()} == {50}


def test_the_run_ends_when_every_member_is_done() -> None:
    d = running(2)
    d.recv("w0", p.Done(next_step=100, final_hash="sha256:aa"))
    assert not d.policy.finished
    d.recv("w1", p.Done(next_step=100, final_hash="sha256:aa"))
    out = d.tick()
    assert pol.Finish() in out and d.policy.finished
    stops = [e.to for e in out if isinstance(e, pol.Send) and isinstance(e.msg, p.Stop)]
    assert sorted(stops) == ["w0", "w1"]
    assert d.logged(ev.WORKER_DONE)[0] == {
        "event": ev.WORKER_DONE,
        "worker": "w0",
        "final_hash": "sha256:aa",
        "step": 100,
    }


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (pol.Joined(1, hello("w0", version=99), True, 0.0), "protocol version 99"),
        (pol.Joined(1, hello("../etc"), True, 0.0), "must match"),
    ],
)
def test_admission_refusals_name_the_rule(event: pol.Joined, reason: str) -> None:
    d = Driver(make_policy(2))
    out = d.feed(event)
    rejects = [e for e in out if isinstance(e, pol.Reject)]
    assert len(rejects) == 1 and reason in rejects[0].reason
    assert d.policy.workers == {}
    assert reason in str(d.logged(ev.REFUSED)[0]["reason"])


def test_a_heartbeating_name_cannot_be_taken_but_a_dead_one_can() -> None:
    d = Driver(make_policy(2))
    d.admit("w0")
    out = d.feed(pol.Joined(9, hello("w0", pid=2), True, 0.0))
    rejects = [e for e in out if isinstance(e, pol.Reject)]
    assert [(e.reason, e.retry) for e in rejects] == [
        ("worker name 'w0' is in use by pid 1, which heartbeats", True)
    ]
    d.feed(pol.Closed("w0", "gone", 0.0))
    assert any(isinstance(e, pol.Accept) for e in d.feed(pol.Joined(10, hello("w0"), True, 0.0)))


def test_a_name_held_by_a_member_that_does_not_heartbeat_goes_to_the_newcomer() -> None:
    d = Driver(make_policy(2, heartbeat_ms=100))
    d.admit("w0")  # a stale process with the token: admitted, then silent
    d.now = pol.CLAIM_SILENCE_BEATS * 0.1 + 0.05
    out = d.feed(pol.Joined(9, hello("w0", pid=2), True, d.now))
    assert any(isinstance(e, pol.Accept) and e.worker == "w0" for e in out)
    (leave,) = d.logged(ev.LEAVE)
    assert leave["reason"] == "its name was claimed by pid 2: no heartbeat for 0.6 s"
    assert d.policy.workers["w0"].pid == 2 and d.policy.workers["w0"].alive


def test_the_launchers_pid_settles_a_contested_name_either_way() -> None:
    d = Driver(make_policy(2))
    d.admit("w0")  # pid 1 holds the name and beats, but the launcher started pid 7
    out = d.feed(pol.Joined(9, hello("w0", pid=7), True, d.now, launched_pid=7))
    assert any(isinstance(e, pol.Accept) for e in out)
    assert "not the one the launcher started (7)" in str(d.logged(ev.LEAVE)[0]["reason"])
    out = d.feed(pol.Joined(10, hello("w0", pid=8), True, d.now, launched_pid=7))
    rejects = [e for e in out if isinstance(e, pol.Reject)]
    assert [(e.reason, e.retry) for e in rejects] == [
        (
            "worker name 'w0' belongs to pid 7, the one the launcher started; "
            "this process (pid 8) is not it",
            False,
        )
    ]
    assert d.policy.workers["w0"].pid == 7 and d.policy.workers["w0"].alive


def test_a_stranger_is_counted_not_logged() -> None:
    d = Driver(make_policy(2))
    out = d.feed(pol.Joined(1, hello("w0"), False, 0.0))
    assert out == [pol.CountRefusal(1, "bad run token")]
    assert d.logged(ev.REFUSED) == []


def test_a_hung_worker_is_declared_dead_by_phi_and_nobody_else_is() -> None:
    d = running(2, heartbeat_ms=100, acceptable_pause_ms=1000, phi_threshold=10.0)
    for _ in range(30):
        d.now += 0.1
        for w in ("w0", "w1"):
            d.recv(w, p.Heartbeat(next_step=1, prepared=True))
        d.tick(0.0)
    for _ in range(40):  # w1 stops beating
        d.now += 0.1
        d.recv("w0", p.Heartbeat(next_step=1, prepared=True))
        d.tick(0.0)
    leaves = d.logged(ev.LEAVE)
    assert [r["worker"] for r in leaves] == ["w1"] and "phi" in str(leaves[0]["reason"])


def test_an_abort_stops_every_worker_once_with_the_reason() -> None:
    d = running(2)
    out = d.recv("w0", p.Abort(reason="step 3: non-finite update"))
    stops = [e for e in out if isinstance(e, pol.Send) and isinstance(e.msg, p.Stop)]
    assert sorted(e.to for e in stops) == ["w0", "w1"]
    assert all("non-finite update" in e.msg.reason for e in stops)
    assert pol.Finish() in out and d.policy.finished
    assert d.recv("w1", p.Abort(reason="the same")) == []  # reported once
    assert [r["reason"] for r in d.logged(ev.RUN_FAILED)] == ["step 3: non-finite update"]


def test_a_drain_stops_every_member_at_one_boundary_and_ends_the_run_when_all_are_done() -> None:
    d = running(2, heartbeat_ms=100)
    for w in ("w0", "w1"):
        d.recv(w, p.Heartbeat(next_step=10, prepared=True, slot_s=0.05))  # 0.1 s steps
    out = d.feed(pol.DrainRequested("SIGTERM", d.now))
    drains = {e.to: e.msg for e in out if isinstance(e, pol.Send) and isinstance(e.msg, p.Drain)}
    assert set(drains) == {"w0", "w1"}
    step = drains["w0"].step
    assert step == 10 + 1 + pol.boundary_margin(0.1, 0.1) and drains["w1"].step == step
    d.admit("w9")  # a joiner while draining is not planned in
    for _ in range(20):
        for w in ("w0", "w1", "w9"):
            d.recv(w, p.Heartbeat(next_step=11, prepared=True, slot_s=0.05))
        d.tick(0.1)
    assert d.policy.pending is None
    for w in ("w0", "w1"):
        d.recv(w, p.Done(next_step=step, final_hash="sha256:aa"))
    out = d.tick()
    assert pol.Finish() in out
    stops = [e.msg for e in out if isinstance(e, pol.Send) and isinstance(e.msg, p.Stop)]
    assert stops and all(m.reason == "run stopped: SIGTERM" for m in stops)
    assert d.logged(ev.RUN_DRAINING)[0]["step"] == step


def test_a_member_that_joins_during_a_drain_is_told_where_to_stop() -> None:
    d = running(3)
    d.feed(pol.DrainRequested("SIGINT", d.now))
    d.feed(pol.Closed("w2", "gone", d.now))
    out = d.ready("w0", "w1", next_step=2)
    sent = [(e.to, type(e.msg).__name__) for e in out if isinstance(e, pol.Send)]
    assert ("w0", "Start") in sent and ("w0", "Drain") in sent
    assert sent.index(("w0", "Start")) < sent.index(("w0", "Drain"))


def test_a_drain_before_the_first_epoch_ends_the_run_at_once() -> None:
    d = Driver(make_policy(3))
    d.admit("w0")
    out = d.feed(pol.DrainRequested("SIGTERM", 0.0))
    assert pol.Finish() in out and d.policy.finished


def _fail_and_reform(d: Driver, epoch: int) -> float:
    """A collective of ``epoch`` fails with nobody lost; the seconds until the same
    members are re-announced (ticked in 10 ms steps)."""
    d.recv("w0", p.Fail(epoch=epoch, error="Connection refused"))
    waited = 0.0
    while d.policy.pending is None and not d.policy.finished:
        d.tick(0.01)
        waited += 0.01
    if d.policy.pending is not None:
        d.ready("w0", "w1", next_step=0)
    return waited


def test_repeated_collective_failures_back_off_exponentially_then_stop_the_run_with_the_cause() -> (
    None
):
    d = running(2, reform_backoff_ms=50, reform_backoff_max_ms=300, max_reform_failures=5)
    waits = [_fail_and_reform(d, e) for e in range(5)]
    # 50, 100, 200, then capped at 300 ms (each seen on the first 10 ms tick past it)
    assert waits[:4] == pytest.approx([0.055, 0.105, 0.205, 0.305], abs=0.006)
    assert d.policy.finished and d.policy.epoch == 4  # no fifth re-formation
    (failed,) = d.logged(ev.RUN_FAILED)
    assert failed["reason"] == (
        "the data plane failed 5 times in a row with no member lost and no step committed; "
        "last error: w0: Connection refused"
    )
    stops = [e for e in d.out if isinstance(e, pol.Send) and isinstance(e.msg, p.Stop)]
    assert sorted(e.to for e in stops) == ["w0", "w1"]


def test_a_committed_step_resets_the_backoff() -> None:
    d = running(2, reform_backoff_ms=50, reform_backoff_max_ms=5000, max_reform_failures=3)
    assert _fail_and_reform(d, 0) == pytest.approx(0.055, abs=0.006)
    assert _fail_and_reform(d, 1) == pytest.approx(0.105, abs=0.006)
    d.recv("w0", p.Heartbeat(next_step=1, prepared=True))  # a step committed in epoch 2
    assert _fail_and_reform(d, 2) == pytest.approx(0.055, abs=0.006)
    assert not d.policy.finished


def _hello_at(name: str, address: str) -> p.Hello:
    return dataclasses.replace(hello(name), address=address)


def test_a_loopback_data_plane_mixed_with_remote_peers_is_refused_naming_both() -> None:
    d = Driver(make_policy(3))
    d.feed(pol.Joined(1, _hello_at("w0", "127.0.0.1"), True, 0.0))
    out = d.feed(pol.Joined(2, _hello_at("w1", "10.231.0.3"), True, 0.0))
    (reject,) = [e for e in out if isinstance(e, pol.Reject)]
    assert reject.reason.startswith(
        "worker w0 listens for its peers on the loopback address 127.0.0.1, which w1 at "
        "10.231.0.3 cannot reach: start w0 with --host or --interface"
    )
    assert d.logged(ev.REFUSED)[-1]["reason"] == reject.reason
    # workers that all use loopback (one host) or all network addresses are admitted
    for i, addr in enumerate(("127.0.0.1", "10.231.0.4")):
        d2 = Driver(make_policy(3))
        d2.feed(pol.Joined(1, _hello_at("w0", addr), True, 0.0))
        out = d2.feed(pol.Joined(2, _hello_at("w1", addr), True, 0.0))
        assert any(isinstance(e, pol.Accept) for e in out), (i, out)


# -- bench-out -------------------------------------------------------------------------------


def _beats(d: Driver, seconds: float, late: dict[str, float] | None = None, step: int = 5) -> None:
    """Heartbeats from every member every 0.1 s for ``seconds``, each ``late[w]`` late
    (its sender's clock is 50 s behind the coordinator's: only changes of delay count)."""
    late = late or {}
    for _ in range(round(seconds / 0.1)):
        d.now += 0.1
        for w in sorted(d.policy.workers):
            sent = d.now - 50.0 - late.get(w, 0.0)
            beat = p.Heartbeat(next_step=step, prepared=True, slot_s=0.01, sent=sent)
            d.feed(pol.Received(w, beat, d.now, wall=d.now))
        d.tick(0.0)


def test_a_member_whose_link_lags_leaves_the_collective_at_once_and_comes_back_after() -> None:
    d = running(3, slots=6, replan_interval_ms=1000)
    _beats(d, 1.0)
    assert d.policy.pending is None
    _beats(d, 0.2, late={"w2": 0.8})  # two heartbeats 0.8 s late
    pending = d.policy.pending
    assert pending is not None and pending.reason == "bench" and pending.after == -1
    assert pending.members == ["w0", "w1"]
    (benched,) = d.logged(ev.MEMBER_BENCHED)
    assert benched["worker"] == "w2" and benched["lag_s"] == pytest.approx(0.8)
    assert d.logged(ev.LEAVE) == []  # not evicted: still admitted, idle
    d.ready("w0", "w1", next_step=5)
    _beats(d, 0.9, late={"w2": 0.8})
    assert d.policy.pending is None  # still late: stays out
    _beats(d, 1.2)  # back to speed for more than replan_interval_ms
    pending = d.policy.pending
    assert pending is not None and pending.reason == "unbench"
    assert pending.members == ["w0", "w1", "w2"] and pending.after > 5
    assert [e["worker"] for e in d.logged(ev.MEMBER_UNBENCHED)] == ["w2"]
    d.recv("w2", p.Ready(epoch=pending.epoch, next_step=5, has_state=True))
    start = d.starts(d.ready("w0", "w1", next_step=pending.after))["w2"]
    assert start.receivers == ["w2"]  # behind the others: it receives the state


def test_a_member_back_to_speed_near_the_end_stays_benched_and_is_stopped_with_the_run() -> None:
    """Seen in a multi-host run: the unbench boundary (step 125 of 120) came after the
    members' last step, so they reported done, then started the announced epoch with the
    benched member as a receiver at the last step; it waited for its peers' final save
    and the run never ended. A boundary at or past the end plans nothing."""
    d = running(3, slots=6, replan_interval_ms=1000)  # steps = 100
    _beats(d, 1.0, step=95)
    _beats(d, 0.2, late={"w2": 0.8}, step=95)
    assert d.policy.pending is not None and d.policy.pending.reason == "bench"
    d.ready("w0", "w1", next_step=95)
    _beats(d, 3.0, step=99)  # back to speed for long enough, but the boundary is past 100
    assert d.policy.pending is None and d.policy.epoch == 1
    assert d.logged(ev.MEMBER_UNBENCHED) == [] and d.policy.workers["w2"].role == "benched"
    for w in ("w0", "w1"):
        d.recv(w, p.Done(next_step=100, final_hash="sha256:x"))
    d.tick()
    assert d.policy.finished and [e["next_step"] for e in d.logged(ev.RUN_END)] == [100]
    stops = [e.to for e in d.out if isinstance(e, pol.Send) and isinstance(e.msg, p.Stop)]
    assert sorted(stops) == ["w0", "w1", "w2"]


def test_a_rebalance_is_not_planned_past_the_runs_end() -> None:
    d = running(3, slots=6, replan_interval_ms=1, slow_ratio=1.5)
    for w, slot_s in (("w0", 0.01), ("w1", 0.01), ("w2", 0.05)):  # w2 five times slower
        d.recv(w, p.Heartbeat(next_step=99, prepared=True, slot_s=slot_s))
    d.tick()
    assert d.policy.pending is None and d.policy.epoch == 0
    for w, slot_s in (("w0", 0.01), ("w1", 0.01), ("w2", 0.05)):  # earlier in the run: it does
        d.recv(w, p.Heartbeat(next_step=50, prepared=True, slot_s=slot_s))
    d.tick()
    pending = d.policy.pending
    assert pending is not None and pending.reason == "rebalance" and pending.after < 100


def test_a_lag_every_member_shares_benches_nobody() -> None:
    d = running(3, slots=6)
    _beats(d, 1.0)
    _beats(d, 1.0, late={w: 0.9 for w in ("w0", "w1", "w2")})  # e.g. a clock step
    assert d.policy.pending is None and d.logged(ev.MEMBER_BENCHED) == []


def test_a_silent_pair_of_members_leaves_in_one_epoch_and_a_spare_takes_a_place() -> None:
    d = running(4, slots=8)
    d.admit("s0")  # past the expected count: a warm spare
    _beats(d, 1.0)
    for _ in range(8):  # w2 and w3 go silent for 0.8 s
        d.now += 0.1
        for w in ("w0", "w1", "s0"):
            beat = p.Heartbeat(next_step=5, prepared=True, slot_s=0.01, sent=d.now - 50.0)
            d.feed(pol.Received(w, beat, d.now, wall=d.now))
        d.tick(0.0)
        if d.policy.pending is not None:
            break
    pending = d.policy.pending
    assert pending is not None and pending.reason == "bench"
    assert [e["worker"] for e in d.logged(ev.MEMBER_BENCHED)] == ["w2", "w3"]
    assert [e["worker"] for e in d.logged(ev.SPARE_PROMOTED)] == ["s0"]
    assert pending.members == ["s0", "w0", "w1"]


def test_with_bench_lag_ms_zero_a_lagging_member_stays_in() -> None:
    d = running(3, slots=6, bench_lag_ms=0)
    _beats(d, 1.0)
    _beats(d, 1.0, late={"w2": 2.0})
    assert d.logged(ev.MEMBER_BENCHED) == []


def test_a_promoted_spare_takes_the_lost_members_rank_and_every_survivor_keeps_its_slots() -> None:
    """Survivors keep their slot ranges, so the slots they finished before the death are
    salvaged and only the lost member's range is computed again (by the spare, the only
    receiver). Before, the spare went last and every rank after the lost one moved."""
    d = running(3, slots=6)
    d.admit("s0")  # past the expected count: a warm spare
    d.tick()
    assert [e["worker"] for e in d.logged(ev.BECAME_SPARE)] == ["s0"]
    d.recv("w0", p.Heartbeat(next_step=5, prepared=True))
    d.feed(pol.Closed("w1", "connection closed (process exited)", d.now))
    pending = d.policy.pending
    assert pending is not None and pending.members == ["w0", "s0", "w2"]
    assert [e["worker"] for e in d.logged(ev.SPARE_PROMOTED)] == ["s0"]
    d.ready("w0", "w2", next_step=5)
    d.ready("s0", next_step=0, has_state=False)
    start = d.starts()["w2"]
    assert Plan.from_dict(start.plan).ranges == ((0, 2), (2, 4), (4, 6))
    assert (start.start_step, start.receivers) == (5, ["s0"])


def test_a_spare_from_another_region_is_ordered_with_its_region() -> None:
    config = with_overrides(
        RunConfig(),
        train={"slots": 6, "global_batch": 12, "steps": 100},
        cluster={"regions": [{"name": "r0", "workers": 3}, {"name": "r1", "workers": 0}]},
    )
    settings = pol.Settings(
        config=config, run_dir="/run", resume=None, store_port=1, instance="x", expected=3
    )
    d = Driver(pol.Policy(settings, now=0.0))
    d.admit("w0", "w1", "w2")
    d.tick()
    d.ready("w0", "w1", "w2")
    d.admit("s0", region="r1")
    d.tick()
    d.feed(pol.Closed("w0", "connection closed (process exited)", d.now))
    assert [e["worker"] for e in d.logged(ev.SPARE_PROMOTED)] == ["s0"]
    pending = d.policy.pending
    assert pending is not None and pending.members == ["w1", "w2", "s0"]


def _spare_replaces_w1(train: dict[str, Any] | None = None) -> p.Start:
    """w0 and w2 report their own slots of step 5 finished (``kept``) when w1 dies; the
    spare s0 takes w1's rank and receives state. The spare's Start."""
    d = running(3, slots=6, train=train)
    d.admit("s0")
    d.tick()
    d.recv("w0", p.Heartbeat(next_step=5, prepared=True))
    d.feed(pol.Closed("w1", "connection closed (process exited)", d.now))
    epoch = d.policy.pending.epoch if d.policy.pending else -1
    for name, kept in (("w0", [0, 1]), ("w2", [4, 5])):
        d.recv(name, p.Ready(epoch=epoch, next_step=5, has_state=True, kept=kept))
    d.recv("s0", p.Ready(epoch=epoch, next_step=0, has_state=False, kept=[]))
    d.tick()
    start = d.starts()["s0"]
    assert Plan.from_dict(start.plan).ranges == ((0, 2), (2, 4), (4, 6))
    assert d.logged(ev.EPOCH_STARTED)[-1].get("first") == start.first
    return start


def test_a_step_redone_after_a_death_is_planned_from_the_slots_the_survivors_kept() -> None:
    """A copy that blocks (the chain): the spare starts late, so the redone step gives it
    one slot and the survivors the rest beside their own; the epoch's plan, from step 6
    on, stays the even one."""
    start = _spare_replaces_w1({"reduction": "chain"})
    assert start.first is not None
    assert Plan.from_dict(start.first).ranges == ((0, 3), (3, 4), (4, 6))


def test_a_spare_that_copies_behind_the_first_step_has_no_slot_of_it() -> None:
    """The default (the exact reduction, streamed exponents): the spare copies while the
    survivors compute step 5 (``copy_rule.overlaps``), so that step gives it no slot and
    the survivors every slot, each beside the ones it kept (``plan.idle_plan``)."""
    start = _spare_replaces_w1()
    assert start.first is not None
    assert Plan.from_dict(start.first).ranges == ((0, 3), (3, 3), (3, 6))


def test_a_redo_nobody_kept_slots_of_follows_the_epochs_plan() -> None:
    d = running(3, slots=6)
    d.feed(pol.Closed("w1", "connection closed (process exited)", d.now))
    d.ready("w0", "w2", next_step=5)
    assert d.starts()["w0"].first is None
    assert "first" not in d.logged(ev.EPOCH_STARTED)[-1]


def test_a_leave_whose_boundary_lies_past_the_runs_end_announces_nothing() -> None:
    d = running(3, slots=6)
    for w in ("w0", "w1", "w2"):
        d.recv(w, p.Heartbeat(next_step=98, prepared=True))  # of 100 steps
    d.recv("w1", p.Leave())
    assert d.policy.pending is None and d.logged(ev.EPOCH_ANNOUNCED)[-1]["reason"] == "start"


def test_a_gracefully_leaving_worker_that_exits_before_its_epoch_starts_aborts_nothing() -> None:
    """Its exit used to announce a second epoch ``after = -1``: the members gave up the
    step in flight, and one caught between the reduction and its update received state."""
    d = running(3, slots=6)
    for w in ("w0", "w1", "w2"):
        d.recv(w, p.Heartbeat(next_step=5, prepared=True))
    d.recv("w1", p.Leave())
    pending = d.policy.pending
    assert pending is not None and pending.members == ["w0", "w2"]
    assert pending.after == 7  # past the last reported step, with one step of margin
    d.feed(pol.Closed("w1", "connection closed (process exited)", d.now))
    assert d.policy.pending is pending
    assert [e["reason"] for e in d.logged(ev.EPOCH_ANNOUNCED)][-1] == "w1 left gracefully"
    starts = d.starts(d.ready("w0", "w2", next_step=7))
    assert starts["w0"].start_step == 7 and starts["w0"].receivers == []
