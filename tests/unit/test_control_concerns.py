"""The control plane's concerns, each called alone: the pure rules of admission,
membership, planned changes, epoch formation and leadership, with no policy object, no
socket and no clock (the whole state machine is ``test_policy.py``'s)."""

from __future__ import annotations

import pytest

from perdure.runtime.config import ClusterConfig, TrainConfig
from perdure.runtime.control import admission, boundary, epochs, leadership, membership, replan
from perdure.runtime.control import protocol as p
from perdure.runtime.control.detector import PhiAccrual
from perdure.runtime.control.lease import LeaseView
from perdure.runtime.control.state import Member, Pending
from perdure.runtime.plan import Plan, from_counts
from perdure.runtime.shard_plan import ALL, NONE


def member(name: str, *, region: str = "r0", pid: int = 1, beat: float | None = 0.0,
           prepared: bool = True, address: str = "") -> Member:  # fmt: skip
    detector = PhiAccrual(expected_interval_s=0.1, acceptable_pause_s=1.0)
    if beat is not None:
        detector.heartbeat(beat)
    m = Member(name, region, "spare", detector, pid=pid, prepared=prepared)
    m.address = address
    return m


def hello(name: str = "w0", *, pid: int = 7, role: str = "worker",
          version: int = p.PROTOCOL_VERSION, address: str = "") -> p.Hello:  # fmt: skip
    return p.Hello(name=name, region="r0", role=role, pid=pid, next_step=0, has_state=True,
                   epoch=-1, mac="", version=version, address=address)  # fmt: skip


# -- admission -------------------------------------------------------------------------------


def test_a_malformed_hello_is_refused_naming_what_is_wrong() -> None:
    assert admission.malformed(hello(), authentic=False) == "bad run token"
    assert admission.malformed(hello(version=0), authentic=True) == (
        f"protocol version 0, this coordinator speaks {p.PROTOCOL_VERSION}"
    )
    assert admission.malformed(hello("../x"), authentic=True) == (
        f"worker name '../x' must match {admission.NAME.pattern}"
    )
    assert admission.malformed(hello(role="boss"), authentic=True) == (
        "role 'boss' must be worker or spare"
    )
    assert admission.malformed(hello(), authentic=True) is None


def test_a_loopback_data_plane_beside_a_routable_one_is_refused_naming_the_loopback_one() -> None:
    there = member("w1", address="10.0.0.2")
    reason = admission.unroutable(hello("w0", address="127.0.0.1"), [there])
    assert reason is not None and reason.startswith(
        "worker w0 listens for its peers on the loopback address 127.0.0.1, which w1 at "
        "10.0.0.2 cannot reach"
    )
    here = admission.unroutable(hello("w2", address="10.0.0.3"), [member("w9", address="::1")])
    assert here is not None and here.startswith("worker w9 listens for its peers")
    assert admission.unroutable(hello("w3", address="10.0.0.4"), [there]) is None
    assert admission.unroutable(hello("w4"), [member("w9", address="::1")]) is None


def test_a_names_claim_goes_to_the_launchers_pid_then_to_the_one_that_beats() -> None:
    old = member("w0", pid=5, beat=10.0)
    launched_new = admission.claim(hello(pid=7), old, 7, now=10.1, heartbeat_ms=100)
    assert launched_new == admission.Claim(
        evict="its name was claimed by pid 7: pid 5 is not the one the launcher started (7)"
    )
    launched_old = admission.claim(hello(pid=7), old, 5, now=10.1, heartbeat_ms=100)
    assert launched_old.refusal is not None and not launched_old.retry
    assert launched_old.evict is None
    beating = admission.claim(hello(pid=7), old, None, now=10.4, heartbeat_ms=100)
    assert beating == admission.Claim(
        "worker name 'w0' is in use by pid 5, which heartbeats", retry=True
    )
    silent = admission.claim(hello(pid=7), old, None, now=10.6, heartbeat_ms=100)
    assert silent == admission.Claim(evict="its name was claimed by pid 7: no heartbeat for 0.6 s")
    old.alive = False
    assert admission.claim(hello(pid=7), old, None, now=10.1, heartbeat_ms=100) == admission.Claim()


# -- membership ------------------------------------------------------------------------------


def test_the_reform_wait_doubles_per_failure_in_a_row_up_to_its_cap() -> None:
    c = ClusterConfig(reform_backoff_ms=50, reform_backoff_max_ms=300)
    waits = [membership.reform_wait_s(c, n) for n in range(6)]
    assert waits == [0.05, 0.05, 0.1, 0.2, 0.3, 0.3]


def test_a_prepared_spare_in_the_lost_members_region_is_promoted_first() -> None:
    lost = member("w0", region="r1")
    spares = [member("s0", region="r0"), member("s2", region="r1"), member("s1", region="r1"),
              member("s3", region="r1", prepared=False)]  # fmt: skip
    picked = membership.pick_spare(spares, lost)
    assert picked is not None and picked.name == "s1"
    assert membership.pick_spare([member("s3", prepared=False)], lost) is None


# -- planned changes -------------------------------------------------------------------------


def test_a_slow_member_gets_its_fair_share_and_the_others_keep_theirs() -> None:
    assert [replan.speed(i, [1.0, 1.0, 4.0], 1.5) for i in range(3)] == [1.0, 1.0, 0.25]


def test_the_boundary_lies_past_every_members_step_by_the_heartbeats_margin() -> None:
    assert boundary.boundary([3, 7, 5], None, 0.1) == 9  # no step time yet: one step of margin
    assert boundary.boundary([3, 7, 5], 0.05, 0.1) == 12  # two heartbeats are four steps
    plan = from_counts(["a", "b"], [2, 4])
    assert boundary.step_s(plan, {"a": 0.5, "b": 0.1}) == 1.0
    assert boundary.step_s(plan, {"a": 0.5, "b": None}) is None
    assert boundary.step_s(plan, {"a": 0.5, "b": None}, partial=True) == 1.0  # a's 2 slots
    assert boundary.step_s(plan, {"a": None, "b": None}, partial=True) is None


def test_bench_out_takes_the_lagging_members_worst_first_while_it_pays() -> None:
    members = ["a", "b", "c", "d"]
    assert replan.to_bench(members, [0.0, 0.0, 0.5, 0.9], 0.2, 0.1, 0) == {"d": 0.9, "c": 0.5}
    assert replan.to_bench(members, [0.0, 0.0, 0.0, 0.1], 0.2, 0.1, 0) == {}
    # a lag under what carrying its slots costs the others is kept
    assert replan.to_bench(["a", "b"], [0.0, 0.3], 0.2, 1.0, 0) == {}
    assert replan.to_bench(["a", "b"], [0.0, 0.3], 0.2, 1.0, 1) == {"b": 0.3}


def test_a_benched_member_is_calm_only_after_the_whole_hold_under_half_the_limit() -> None:
    w = member("w0")
    kw = {"base": 0.0, "limit": 0.2, "hold_s": 1.0}
    assert not replan.calm_long_enough(w, lag_s=0.05, now=0.0, **kw) and w.calm_since == 0.0
    assert not replan.calm_long_enough(w, lag_s=0.05, now=0.5, **kw)
    assert not replan.calm_long_enough(w, lag_s=0.15, now=0.9, **kw) and w.calm_since is None
    assert not replan.calm_long_enough(w, lag_s=0.0, now=1.0, **kw)
    assert replan.calm_long_enough(w, lag_s=0.0, now=2.0, **kw)


# -- epoch formation -------------------------------------------------------------------------


def test_an_epoch_takes_whole_replica_groups_of_at_most_s_members() -> None:
    train = TrainConfig(slots=6, global_batch=12, shard_degree=2)
    assert [epochs.usable(n, train) for n in (1, 2, 5, 9)] == [0, 2, 4, 6]


def test_a_worker_holding_a_missing_shard_replaces_one_holding_a_duplicate() -> None:
    shards = {"a": 0, "b": 0, "c": 1, "d": NONE}
    assert epochs.pick(["a", "b", "c", "d"], 2, shards.__getitem__, 2) == ["a", "c"]
    assert epochs.pick(["a", "b", "c", "d"], 2, shards.__getitem__, 1) == ["a", "b"]
    everything = {"a": ALL, "b": 0, "c": 1}
    assert epochs.pick(["a", "b", "c"], 2, everything.__getitem__, 2) == ["a", "b"]


def test_a_spare_takes_its_lost_members_rank_only_within_its_region() -> None:
    regions = {"a": "r0", "b": "r0", "c": "r1", "s": "r0", "t": "r1"}
    assert epochs.in_their_places(["a", "b", "c"], ["a", "c", "s"], {"b": "s"}, regions) == [
        "a", "s", "c"
    ]  # fmt: skip
    assert epochs.in_their_places(["a", "b", "c"], ["a", "c", "t"], {"b": "t"}, regions) is None


def test_an_epoch_starts_at_the_highest_step_held_and_sends_state_to_the_rest() -> None:
    pend = Pending(3, ["a", "b", "c"], -1, "x", None, 0.0)
    pend.ready = {
        "a": p.Ready(epoch=3, next_step=9, has_state=True),
        "b": p.Ready(epoch=3, next_step=10, has_state=True),
        "c": p.Ready(epoch=3, next_step=0, has_state=False),
    }
    assert epochs.start_of(pend, ["a", "b"]) == (10, "b", ["a", "c"])


def test_the_new_plan_keeps_announced_counts_then_the_running_ranges() -> None:
    pend = Pending(1, ["a", "b"], 5, "rebalance", [4, 2], 0.0)
    assert epochs.plan_for(pend, None, 6) == from_counts(["a", "b"], [4, 2])
    same = Pending(1, ["a", "b"], 5, "join", None, 0.0)
    running = Plan(("a", "b"), ((0, 1), (1, 6)))
    assert epochs.plan_for(same, running, 6) == running
    assert epochs.plan_for(same, None, 6) == from_counts(["a", "b"], [3, 3])


# -- leadership ------------------------------------------------------------------------------


def test_a_retry_names_why_this_coordinator_does_not_lead() -> None:
    view = LeaseView(generation=4, state="held", live=True)
    assert leadership.wait_reason(fenced=True, generation=3, view=view) == (
        "fenced out: generation 3 was superseded"
    )
    assert leadership.wait_reason(fenced=False, generation=0, view=view) == (
        "standby: the primary holds the run's lease (generation 4)"
    )
    assert leadership.wait_reason(fenced=False, generation=2, view=None) == (
        "the lease of generation 2 lapsed; renewing it"
    )


@pytest.mark.parametrize(
    ("view", "busy", "since", "probes"),
    [
        (LeaseView(generation=1, state="held", live=False), False, 1.0, True),
        (LeaseView(generation=1, state="held", live=True), False, 1.0, False),
        (LeaseView(generation=1, state="held", live=False), True, 1.0, False),
        (LeaseView(generation=1, state="held", live=False), False, 0.4, False),
        (LeaseView(generation=1, state="ended", live=False), False, 1.0, False),
    ],
)
def test_a_standby_probes_only_an_expired_lease_at_most_every_half_ttl(
    view: LeaseView, busy: bool, since: float, probes: bool
) -> None:
    assert leadership.should_probe(view, busy=busy, since_probe_s=since, ttl_s=1.0) is probes


def test_a_primary_renews_before_its_first_epoch_and_while_anyone_is_connected() -> None:
    assert leadership.wants_lease(served=False, connected=0)
    assert leadership.wants_lease(served=True, connected=1)
    assert not leadership.wants_lease(served=True, connected=0)


def test_a_save_in_flight_is_given_up_only_when_the_next_epoch_re_forms_at_once() -> None:
    """A planned change (a join at a boundary) lets every member reach the boundary and
    finish the save; a loss (``after = -1``) does not wait for a rank that may be gone."""
    from perdure.runtime.control import protocol as proto
    from perdure.runtime.control.client import Identity, MembershipClient

    c = MembershipClient(
        Identity("w", "r", "worker"),
        [("127.0.0.1", 1)],
        "t",
        timeout_s=1.0,
        progress=lambda: (0, True),
    )
    c.epoch_no = 3
    assert not c.save_must_stop()
    c.announce = proto.Announce(epoch=4, members=["w", "x"], after=150, generation=1)
    assert c.should_stop(150) and not c.save_must_stop()
    c.announce = proto.Announce(epoch=5, members=["w"], after=-1, generation=1)
    assert c.should_stop(140) and c.save_must_stop()
    c.announce, c.lost = None, True
    assert c.save_must_stop()


def test_the_client_tells_of_each_notice_but_not_of_a_channel_it_left() -> None:
    """``on_notice`` (the worker wakes its collectives' waits with it): an announcement,
    a stop and the coordinator's loss call it; a message on a channel the worker has left
    does not."""
    from perdure.runtime.control import protocol as proto
    from perdure.runtime.control.client import Identity, MembershipClient

    c = MembershipClient(
        Identity("w", "r", "worker"), [("127.0.0.1", 1)], "t", timeout_s=1.0,
        progress=lambda: (0, True),
    )  # fmt: skip
    calls: list[int] = []
    c.on_notice = lambda: calls.append(1)
    line, old = object(), object()
    c.line, c.generation = line, 1  # type: ignore[assignment]
    c._on_message(proto.Announce(epoch=4, members=["w"], after=-1, generation=1), line=line)
    assert len(calls) == 1
    c._on_message(proto.Stop(reason="done"), line=old)  # type: ignore[arg-type]
    assert len(calls) == 1
    c._on_message(proto.Stop(reason="done"), line=line)  # type: ignore[arg-type]
    assert len(calls) == 2
    c._on_lost(line)  # type: ignore[arg-type]
    assert len(calls) == 3
