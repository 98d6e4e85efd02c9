"""The coordinator's policy with replica groups (``train.shard_degree = 2``): epochs of
whole groups only, and an epoch whose members lack a shard of the optimizer state is
regrouped from the live workers that hold it, before any checkpoint is considered."""

from __future__ import annotations

from perdure import events as ev
from perdure.run_config import RunConfig, with_overrides
from perdure.runtime.control import policy as pol
from perdure.runtime.control import protocol as p
from tests.unit.test_policy import Driver


def _driver(workers: int, *more: int) -> Driver:
    """A policy over region r0 with ``workers`` workers (and r1, r2, ... with ``more``)."""
    regions = [{"name": f"r{i}", "workers": n} for i, n in enumerate((workers, *more))]
    config = with_overrides(
        RunConfig(),
        train={"slots": 8, "global_batch": 16, "steps": 100, "shard_degree": 2},
        cluster={"regions": regions},
    )
    workers = sum((workers, *more))
    settings = pol.Settings(
        config=config, run_dir="/run", resume=None, store_port=1, instance="x", expected=workers
    )
    return Driver(pol.Policy(settings, now=0.0))


def _ready(d: Driver, name: str, next_step: int, shard: int, has_state: bool = True) -> None:
    assert d.policy.pending is not None
    epoch = d.policy.pending.epoch
    d.recv(name, p.Ready(epoch=epoch, next_step=next_step, has_state=has_state, shard=shard))


def test_an_epoch_takes_whole_groups_and_the_odd_worker_waits_without_a_loop() -> None:
    d = _driver(3)
    d.admit("w0", "w1", "w2")
    d.tick()
    assert d.policy.pending is not None and d.policy.pending.members == ["w0", "w1"]
    d.ready("w0", "w1")
    assert d.policy.current is not None and list(d.policy.current.members) == ["w0", "w1"]
    for _ in range(50):
        for w in ("w0", "w1", "w2"):
            d.recv(w, p.Heartbeat(next_step=0, prepared=True))
        d.tick(0.1)
    assert len(d.logged(ev.EPOCH_ANNOUNCED)) == 1  # w2 waits for a partner: no re-announce


def test_a_member_torn_by_its_partners_death_is_replaced_by_the_holder_of_its_shard() -> None:
    d = _driver(4)
    d.admit("w0", "w1", "w2", "w3")
    d.tick()
    d.ready("w0", "w1", "w2", "w3")  # groups (w0, w1) and (w2, w3): shards 0 1 0 1
    d.feed(pol.Closed("w0", "connection closed (process exited)", d.now))
    assert d.policy.pending is not None and d.policy.pending.members == ["w1", "w2"]
    # w1's update was torn (w0 died during the parameters' exchange): it has no state.
    _ready(d, "w1", 7, -2, has_state=False)
    _ready(d, "w2", 7, 0)
    d.tick()
    pend = d.policy.pending
    assert pend is not None and pend.members == ["w2", "w3"]  # w3 holds shard 1
    assert d.logged(ev.EPOCH_ANNOUNCED)[-1]["reason"] == "optimizer shard regrouped"
    _ready(d, "w2", 7, 0)
    _ready(d, "w3", 7, 1)
    d.tick()
    (started,) = [e for e in d.logged(ev.EPOCH_STARTED) if e["epoch"] == pend.epoch]
    assert (started["start_step"], started["source"], started["receivers"]) == (7, "w2", [])
    assert d.logged(ev.RECOVERED_FROM_CHECKPOINT) == []


def test_a_shard_nobody_alive_holds_sends_the_epoch_to_the_checkpoint() -> None:
    d = _driver(2)
    d.admit("w0", "w1")
    d.tick()
    d.ready("w0", "w1")
    d.feed(pol.Closed("w1", "connection closed (process exited)", d.now))
    d.admit("w1b")  # the replacement
    for _ in range(3):
        d.tick()
    pend = d.policy.pending
    assert pend is not None and sorted(pend.members) == ["w0", "w1b"]
    _ready(d, "w0", 9, 0)
    _ready(d, "w1b", 0, -2, has_state=False)
    out = d.tick()
    assert any(isinstance(e, pol.FindCheckpoint) for e in out)  # shard 1 died with w1
    assert d.policy.current is not None and d.logged(ev.EPOCH_STARTED)[-1]["epoch"] == 0


def test_replica_groups_stay_inside_a_region_and_only_the_leftovers_span_two() -> None:
    """r0 and r1 with three workers each, k = 2: (a0, a1) and (b0, b1) inside their
    regions, and the leftovers a2 and b2 form the one group that spans both."""
    d = _driver(3, 3)
    d.admit("b0", "b1", "b2", region="r1")
    d.admit("a0", "a1", "a2", region="r0")
    d.tick()
    assert d.policy.pending is not None
    assert d.policy.pending.members == ["a0", "a1", "b0", "b1", "a2", "b2"]


def test_a_promoted_spare_takes_the_lost_ranks_shard_and_no_survivor_changes_shard() -> None:
    """Groups (w0, w1) and (w2, w3) hold shards 0 1 0 1. With the spare last, w1's death
    gave w2 and w3 each other's shard (every rank after the lost one moved); in the lost
    rank's place the spare is the only one that needs a shard, from w3."""
    d = _driver(4)
    d.admit("w0", "w1", "w2", "w3")
    d.tick()
    d.ready("w0", "w1", "w2", "w3")
    d.admit("s0")
    d.tick()
    d.feed(pol.Closed("w1", "connection closed (process exited)", d.now))
    pend = d.policy.pending
    assert pend is not None and pend.members == ["w0", "s0", "w2", "w3"]
    for name, shard in (("w0", 0), ("w2", 0), ("w3", 1)):
        _ready(d, name, 7, shard)
    _ready(d, "s0", 0, -2, has_state=False)
    d.tick()
    (started,) = [e for e in d.logged(ev.EPOCH_STARTED) if e["epoch"] == pend.epoch]
    assert (started["start_step"], started["receivers"]) == (7, ["s0"])
    assert [d.policy.workers[m].shard for m in pend.members] == [0, 1, 0, 1]
