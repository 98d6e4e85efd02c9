"""Only the data plane's own failures become CommFailed; anything else is a bug, raised."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from perdure.runtime.comm import group
from perdure.runtime.comm.group import Abandoned, Comm, CommFailed, is_collective_failure
from perdure.runtime.comm.reducer import direct_leaders
from perdure.runtime.comm.tiers import Tiers


@pytest.fixture
def comm() -> Iterator[Comm]:
    c = Comm(dist.HashStore(), "pg/0/", 0, 1, timedelta(seconds=5), lambda: False)
    yield c
    c.close()


def _raise(e: BaseException):
    def fn() -> None:
        raise e

    return fn


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [::1]:1"),
        RuntimeError("Connection closed by peer [127.0.0.1]:4242"),
        RuntimeError("Operation timed out!"),
        dist.DistNetworkError("store 127.0.0.1:1 unreachable"),
        TimeoutError("slot gradient not ready within 10 s"),
    ],
)
def test_a_backend_failure_becomes_comm_failed_with_its_cause(comm: Comm, error: Exception) -> None:
    assert is_collective_failure(error)
    with pytest.raises(CommFailed) as info:
        comm.call(_raise(error))
    assert info.value.__cause__ is error and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"),
        ValueError("bad argument"),
        KeyError("slot"),
    ],
)
def test_any_other_exception_is_a_bug_and_says_so(comm: Comm, error: Exception) -> None:
    assert not is_collective_failure(error)
    with pytest.raises(type(error)) as info:
        comm.call(_raise(error))
    assert info.value is error
    assert any("a bug" in n for n in getattr(error, "__notes__", []))


def test_a_changed_epoch_abandons_the_wait(comm: Comm) -> None:
    import threading

    release = threading.Event()
    comm.should_abort = lambda: True
    with pytest.raises(Abandoned):
        comm.call(lambda: release.wait(5))
    release.set()


def test_an_epoch_that_changes_while_its_group_forms_is_abandoned_not_a_crash() -> None:
    """Rank 0 of two forms a group whose peer never comes (its region lost as the epoch
    started): once the epoch changes, the constructor raises Abandoned and the Comm is
    closed; it raised AttributeError, reading the group it had not formed yet, and the
    worker exited (a clean-clone CI: a survivor of a region's loss, whose state then
    lost 95 steps to a checkpoint)."""
    changed = threading.Event()
    threading.Timer(0.05, changed.set).start()
    t0 = time.monotonic()
    with pytest.raises(Abandoned):
        Comm(dist.HashStore(), "pg/0/", 0, 2, timedelta(seconds=1), changed.is_set)
    assert time.monotonic() - t0 < 0.5  # left at the change, not at the group's timeout


def test_a_notice_ends_a_wait_at_once_not_at_its_next_look(
    comm: Comm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wake_waits`` (the membership client's notice: a peer's death announced before
    the collective fails): with a minute between looks at the abort predicate, the wait
    is left as soon as it is woken."""
    monkeypatch.setattr(group, "_SLICE_S", 60.0)
    release, changed = threading.Event(), threading.Event()
    comm.should_abort = changed.is_set
    out: list[str] = []

    def wait() -> None:
        try:
            comm.call(lambda: release.wait(30))
        except Abandoned:
            out.append("abandoned")

    waiter = threading.Thread(target=wait)
    waiter.start()
    end = time.monotonic() + 10
    while not group._WAITS:  # in its wait
        assert time.monotonic() < end
        time.sleep(0.01)
    changed.set()
    group.wake_waits()
    waiter.join(10)
    release.set()
    assert out == ["abandoned"]


def test_an_exchange_given_grace_finishes_after_the_epoch_changes(comm: Comm) -> None:
    """An update's parameter exchange (``shard_group.SYNC_GRACE_S``): the epoch changed
    during it, and it ends well inside its grace, so its result is kept."""
    import time

    comm.should_abort = lambda: True
    assert comm.call(lambda: time.sleep(0.1) or 7, grace_s=2.0) == 7


def test_an_exchange_given_grace_is_left_once_the_grace_is_over(comm: Comm) -> None:
    import threading
    import time

    release = threading.Event()
    comm.should_abort = lambda: True
    t0 = time.monotonic()
    with pytest.raises(Abandoned):
        comm.call(lambda: release.wait(5), grace_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 5
    release.set()


@pytest.mark.parametrize("flags", [(True, False), (False, True), (False, False), (True, True)])
def test_any_rank_gives_every_rank_the_same_answer(flags: tuple[bool, bool]) -> None:
    """The final-save choice (``Worker._finish``): a member that received the state at the
    last step has not saved it while its peers have; all must save, or none."""
    import concurrent.futures as cf

    store = dist.HashStore()

    def rank(r: int) -> bool:
        c = Comm(store, "pg/any/", r, 2, timedelta(seconds=10), lambda: False)
        try:
            return c.any_rank(flags[r])
        finally:
            c.close()

    with cf.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(rank, (0, 1)))
    assert answers == [any(flags)] * 2


def test_any_rank_of_one_rank_is_its_own_flag(comm: Comm) -> None:
    assert comm.any_rank(True) and not comm.any_rank(False)


class _Group:
    """Stands in for a process group: records the thread that drops it."""

    def __init__(self, dropped: list[str], done: threading.Event) -> None:
        self.dropped, self.done = dropped, done

    def __del__(self) -> None:
        self.dropped.append(threading.current_thread().name)
        self.done.set()


def test_a_closed_comm_drops_its_group_off_the_callers_thread_and_refuses_later_use() -> None:
    """Dropping a gloo group takes ~0.02 s (joins its threads): not on the caller's path."""
    c = Comm(dist.HashStore(), "pg/0/", 0, 1, timedelta(seconds=5), lambda: False)
    dropped: list[str] = []
    done = threading.Event()
    c.pg = _Group(dropped, done)
    c.close()
    assert done.wait(5) and dropped == ["pg-drop"]
    with pytest.raises(CommFailed, match="process group closed"):
        c.pg.allreduce([])
    c.close()  # again: nothing more to drop
    assert dropped == ["pg-drop"]


def test_a_group_also_held_in_a_cycle_is_destroyed_on_the_drop_thread_not_the_collectors() -> None:
    """An abandoned operation's exception holds the group in a traceback cycle: the
    collector frees it on whichever thread allocates next, and ran the group's destructor
    there (20-30 ms, on a kill's critical path). The drop thread waits for those
    references to go and destroys it itself."""
    c = Comm(dist.HashStore(), "pg/0/", 0, 1, timedelta(seconds=5), lambda: False)
    dropped: list[str] = []
    done = threading.Event()
    group = _Group(dropped, done)
    cycle: dict[str, Any] = {"pg": group}
    cycle["self"] = cycle
    c.pg = group
    del group
    c.close()
    time.sleep(0.1)  # the drop thread polls: the group outlives close while the cycle lives
    assert not done.is_set()
    del cycle
    gc.collect()  # on this thread, as a gen-0 collection would run it
    assert done.wait(5) and dropped == ["pg-drop"]


def test_a_closed_comm_drops_its_region_and_leader_groups_on_the_drop_thread_too() -> None:
    c = Comm(dist.HashStore(), "pg/0/", 0, 1, timedelta(seconds=5), lambda: False)
    dropped: list[str] = []
    local, cross = threading.Event(), threading.Event()
    c.tiers = Tiers(local=_Group(dropped, local), cross=_Group(dropped, cross), regions=("a",))
    c.close()
    assert local.wait(5) and cross.wait(5) and dropped == ["pg-drop", "pg-drop"]
    assert c.tiers is None


def test_the_outer_step_combines_regions_by_ring_and_the_step_directly_unless_told() -> None:
    assert direct_leaders("auto", diloco=False)
    assert not direct_leaders("auto", diloco=True)
    assert direct_leaders("direct", diloco=True) and direct_leaders("direct", diloco=False)
    assert not direct_leaders("ring", diloco=False) and not direct_leaders("ring", diloco=True)
