"""The embedded lease (a file in the run directory) and the run directory's fence: the
compare-and-swap that lets one coordinator at a time hold the lease, expiry as an
observer's own clock sees it, a fence that never goes down, and writers (a checkpoint
commit, the summary) that a stale generation cannot get past."""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path

import pytest

from perdure import events as ev
from perdure.checkpoint import CheckpointSaveError, save_checkpoint
from perdure.checkpoint.async_save import AsyncCheckpointer
from perdure.run_config import RunConfig
from perdure.runtime.control import policy as pol
from perdure.runtime.control.fence import (
    Fence,
    Fenced,
    current_generation,
    install_fence,
    read_fence,
)
from perdure.runtime.control.lease import (
    SAFETY,
    FileLease,
    Granted,
    LeaseHeld,
    LeaseView,
    Lost,
    acquire_for_primary,
)
from perdure.runtime.control.lease_agent import LeaseAgent
from tests.checkpoint_support import make_state
from tests.fence_support import wait_for

TTL = 1.0
ME = {"instance": "a", "channel": "127.0.0.1:1"}
OTHER = {"instance": "b", "channel": "127.0.0.1:2"}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_first_acquisition_is_generation_one_and_renewals_keep_it(tmp_path: Path) -> None:
    clock = Clock()
    lease = FileLease(tmp_path, TTL, clock=clock)
    got = lease.acquire(LeaseView(), 0, ME)
    assert got == Granted(1, 100.0 + SAFETY * TTL)
    clock.t += 0.3
    assert lease.renew(1) == Granted(1, 100.3 + SAFETY * TTL)
    record = json.loads((tmp_path / "control" / "lease.json").read_text())
    assert record == {"generation": 1, "version": 1, "state": "held", "holder": ME}


def test_an_observer_calls_the_lease_expired_only_after_a_whole_ttl_without_renewal(
    tmp_path: Path,
) -> None:
    clock, watcher = Clock(), Clock()
    holder = FileLease(tmp_path, TTL, clock=clock)
    observer = FileLease(tmp_path, TTL, clock=watcher)
    holder.acquire(LeaseView(), 0, ME)
    for _ in range(5):  # renewed every half TTL: always live
        assert observer.observe().live
        watcher.t += TTL / 2
        holder.renew(1)
    view = observer.observe()
    assert view.live and view.holder == ME
    watcher.t += TTL * 0.99
    assert observer.observe().live  # a first look counts the TTL from itself
    watcher.t += 0.02
    stale = observer.observe()
    assert not stale.live and (stale.generation, stale.state) == (1, "held")


def test_a_takeover_swaps_only_the_stale_lease_and_the_old_holder_then_loses_it(
    tmp_path: Path,
) -> None:
    holder = FileLease(tmp_path, TTL, clock=Clock())
    standby_clock = Clock()
    standby = FileLease(tmp_path, TTL, clock=standby_clock)
    holder.acquire(LeaseView(), 0, ME)
    standby.observe()
    standby_clock.t += 2 * TTL
    stale = standby.observe()
    assert not stale.live
    holder.renew(1)  # the primary renewed after the standby looked: the swap must fail
    lost = standby.acquire(stale, 0, OTHER)
    assert isinstance(lost, Lost) and lost.view.live and lost.view.version == 1
    standby_clock.t += 2 * TTL
    standby.observe()
    standby_clock.t += 2 * TTL
    stale = standby.observe()
    got = standby.acquire(stale, 0, OTHER)
    assert isinstance(got, Granted) and got.generation == 2
    refused = holder.renew(1)
    assert isinstance(refused, Lost) and refused.view.generation == 2
    assert refused.view.holder == OTHER


def _race(run_dir: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    got = FileLease(run_dir, TTL).acquire(LeaseView(), 0, {"pid": "x"})
    queue.put(isinstance(got, Granted))


def test_of_many_processes_racing_for_a_fresh_lease_exactly_one_wins(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), queue)) for _ in range(8)]
    for proc in procs:
        proc.start()
    wins = [queue.get(timeout=30) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert sorted(wins) == [False] * 7 + [True]
    assert json.loads((tmp_path / "control" / "lease.json").read_text())["generation"] == 1


def test_a_primary_starts_above_the_fence_and_after_a_run_that_ended(tmp_path: Path) -> None:
    install_fence(tmp_path, 3, OTHER)  # a previous launch in this directory reached 3
    lease = FileLease(tmp_path, TTL)
    got = acquire_for_primary(lease, tmp_path, ME)
    assert got.generation == 4 and current_generation(tmp_path) == 4
    lease.end(4)
    again = acquire_for_primary(FileLease(tmp_path, TTL), tmp_path, ME)
    assert again.generation == 5 and read_fence(tmp_path)["holder"] == ME  # type: ignore[index]


def test_a_primary_refuses_to_start_while_another_keeps_renewing(tmp_path: Path) -> None:
    other = FileLease(tmp_path, TTL)
    other.acquire(LeaseView(), 0, OTHER)
    clock = Clock()

    def sleep(s: float) -> None:
        clock.t += s
        other.renew(1)

    with pytest.raises(LeaseHeld, match=r"generation 1, pid None on None, channel 127\.0\.0\.1:2"):
        acquire_for_primary(
            FileLease(tmp_path, TTL, clock=clock), tmp_path, ME, clock=clock, sleep=sleep
        )


def test_a_primary_takes_a_lease_its_crashed_predecessor_left_after_it_expires(
    tmp_path: Path,
) -> None:
    FileLease(tmp_path, TTL).acquire(LeaseView(), 0, OTHER)  # then it crashed
    clock = Clock()

    def sleep(s: float) -> None:
        clock.t += s

    got = acquire_for_primary(
        FileLease(tmp_path, TTL, clock=clock), tmp_path, ME, clock=clock, sleep=sleep
    )
    assert got.generation == 2 and clock.t - 100.0 >= TTL


def test_the_fence_never_goes_down_and_refuses_older_writers(tmp_path: Path) -> None:
    assert current_generation(tmp_path) == 0
    assert install_fence(tmp_path, 2, ME)
    assert not install_fence(tmp_path, 1, OTHER)  # a delayed installer changes nothing
    assert read_fence(tmp_path)["holder"] == ME  # type: ignore[index]
    fence = Fence(tmp_path)
    fence.check(2, "metrics")
    fence.check(3, "metrics")  # a newer writer is not held back
    with pytest.raises(Fenced, match=r"metrics refused: .* generation 1, but .*fence.json is at"):
        fence.check(1, "metrics")


def test_a_corrupt_fence_is_an_error_naming_the_file_not_a_guess(tmp_path: Path) -> None:
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "fence.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"fence.json: not a fence record"):
        Fence(tmp_path).check(1, "metrics")


def test_a_checkpoint_of_a_fenced_generation_is_never_committed(tmp_path: Path) -> None:
    install_fence(tmp_path, 2, OTHER)
    fence = Fence(tmp_path)
    root = tmp_path / "checkpoints"
    ckpt = AsyncCheckpointer(
        root,
        RunConfig().checkpoint,
        before_commit=lambda: fence.check(1, "checkpoint commit"),
    )
    ckpt.save(make_state(step=10))
    with pytest.raises(CheckpointSaveError, match="Fenced: checkpoint commit refused"):
        ckpt.wait()
    ckpt.close()
    assert not (root / "step-000000010").exists()
    assert list(root.iterdir()) == []  # its temporary directory is removed, too
    # the newer generation commits
    path = save_checkpoint(root, make_state(step=10))
    assert path.name == "step-000000010"


def test_a_summary_for_a_fenced_generation_is_refused(tmp_path: Path) -> None:
    from perdure.launch.summary import write_summary

    (tmp_path / "events.jsonl").write_text(
        json.dumps({"t": 1.0, "event": ev.RUN_END, "next_step": 5, "generation": 1}) + "\n"
    )
    s = write_summary(tmp_path, RunConfig(), started=0.0)
    assert s["generation"] == 1 and (tmp_path / "summary.json").exists()
    (tmp_path / "summary.json").unlink()
    install_fence(tmp_path, 2, OTHER)
    with pytest.raises(Fenced, match="summary refused"):
        write_summary(tmp_path, RunConfig(), started=0.0)
    assert not (tmp_path / "summary.json").exists()


class _GatedRenewals:
    """The file lease, with renewals that wait for the test (a slow store)."""

    def __init__(self, inner: FileLease) -> None:
        self.inner, self.ttl_s = inner, inner.ttl_s
        self.gate, self.entered = threading.Event(), threading.Event()
        self.renewals = self.observations = 0

    def observe(self) -> LeaseView:
        self.observations += 1
        return self.inner.observe()

    def acquire(self, expect: LeaseView, floor: int, holder: dict) -> Granted | Lost:
        return self.inner.acquire(expect, floor, holder)

    def renew(self, generation: int) -> Granted | Lost:
        self.renewals += 1
        self.entered.set()
        self.gate.wait(10)
        return self.inner.renew(generation)

    def end(self, generation: int) -> None:
        self.inner.end(generation)

    def close(self) -> None:
        pass


def test_the_lease_agent_stops_renewing_when_told_even_with_a_renewal_in_flight(
    tmp_path: Path,
) -> None:
    inner = FileLease(tmp_path, 0.5)
    inner.acquire(LeaseView(), 0, ME)
    store = _GatedRenewals(inner)
    events: list[pol.Event] = []
    agent = LeaseAgent(store, tmp_path, ME, events.append, generation=1)
    try:
        assert store.entered.wait(10)
        agent.submit(pol.WatchLease())  # while the renewal is in flight
        store.gate.set()
        wait_for(lambda: store.observations >= 3, 10, "observations")
        assert store.renewals == 1
        kinds = [type(e) for e in events]
        assert kinds[0] is pol.LeaseGranted and set(kinds[1:]) == {pol.LeaseObserved}
        agent.submit(pol.EndLease(1))
    finally:
        agent.close()
    assert json.loads((tmp_path / "control" / "lease.json").read_text())["state"] == "ended"
