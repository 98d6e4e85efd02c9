"""The overlapped state copy's parts (``runtime/member/copy_overlap.py``): the committed offer, the
mode an epoch's start implies, and the holder's server thread as the step's gate sees it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from perdure.runtime.comm.group import Abandoned, CommFailed
from perdure.runtime.comm.swarm import CopyJob
from perdure.runtime.member.copy_overlap import CopyServer, committed_offer, is_overlapped
from perdure.runtime.plan import Plan, idle_plan, make_plan
from tests.buffer_task import BufferLM


def test_a_committed_offer_clones_the_buffers_a_forward_moves_and_serves_parameters_in_place() -> (
    None
):
    """A holder computes the step while it serves: a slot's forward moves the buffers in
    place (and the engine puts them back after the slot), so the offer holds their
    committed values; parameters are only written by the update, after the copy, so the
    offer is the parameters themselves (no second copy of the state)."""
    model = BufferLM(d=4)
    state = ({k: v.detach() for k, v in model.state_dict().items()}, {"state": {}}, {"x": 1})
    snap, optim, extra = committed_offer(state, list(model.parameters()))
    assert (optim, extra) == (state[1], state[2])
    params = {k for k, _ in model.named_parameters()}
    assert {k for k in snap if k not in params} == {
        "bn1.running_mean",
        "bn1.running_var",
        "bn1.num_batches_tracked",
        "bn2.running_mean",
        "bn2.running_var",
        "bn2.num_batches_tracked",
        "tally.seen",
        "tally.scale",
    }
    before = {k: v.clone() for k, v in snap.items()}
    model.train()
    model(torch.randint(0, 256, (3, 5)))  # moves every buffer in place
    assert not torch.equal(model.tally.scale, before["tally.scale"])
    for k, v in snap.items():
        assert torch.equal(v, before[k]), k
        shares = v.data_ptr() == model.state_dict()[k].data_ptr()
        assert shares == (k in params), k


def test_an_epoch_overlaps_its_copy_only_where_its_first_step_leaves_every_receiver_idle() -> None:
    plan = make_plan(["a", "s", "b"], 6)
    idle = idle_plan(plan, [set(), set(), set()], ["s"])
    assert is_overlapped(idle, ["s"])
    assert not is_overlapped(idle, [])  # nothing to copy
    assert not is_overlapped(None, ["s"])  # the epoch's plan from the first step on
    assert not is_overlapped(plan, ["s"])  # the receiver has slots: a blocking copy
    late = Plan(("a", "s", "b"), ((0, 3), (3, 4), (4, 6)))  # redo_plan's: one slot, late
    assert not is_overlapped(late, ["s"])


class _Comm:
    closed = False

    def close(self) -> None:
        self.closed = True


class _Copy:
    """A StateCopy whose copy waits for ``go`` and then returns None or raises ``error``."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.go = threading.Event()
        self.error = error
        self.stats = {"bytes_sent": 7, "ranges_sent": 1}

    def copy(self, comm: Any, job: CopyJob) -> None:
        assert self.go.wait(10)
        if self.error is not None:
            raise self.error


JOB = CopyJob(receivers=(1,), source=0, shard_degree=1, layout={})


def test_a_holders_gate_opens_once_its_copy_is_served_and_reports_what_it_sent() -> None:
    """The copy's group is the epoch's own: served, it stays open for the step's
    reduction (only an epoch that ends first closes it, ``close``)."""
    comm, copy = _Comm(), _Copy()
    server = CopyServer(comm, copy, JOB, step=3)  # type: ignore[arg-type]
    copy.go.set()
    sent = server.wait(lambda: False)
    assert (sent["bytes_sent"], sent["ranges_sent"]) == (7, 1) and sent["seconds"] >= 0
    assert not comm.closed
    server.close()
    assert comm.closed


def test_a_copy_that_fails_fails_the_step_at_its_gate() -> None:
    copy = _Copy(CommFailed("peer closed"))
    server = CopyServer(_Comm(), copy, JOB, step=3)  # type: ignore[arg-type]
    copy.go.set()
    with pytest.raises(CommFailed, match="peer closed"):
        server.wait(lambda: False)


def test_a_gate_waiting_for_a_copy_leaves_when_the_epoch_changes() -> None:
    copy = _Copy()
    server = CopyServer(_Comm(), copy, JOB, step=3)  # type: ignore[arg-type]
    with pytest.raises(Abandoned):
        server.wait(lambda: True)
    server.close()
    copy.go.set()


def test_a_copy_served_in_full_reports_it_without_a_wait_and_one_still_out_reports_nothing() -> (
    None
):
    """An epoch that ends before a holder's gate still records a copy that was served
    (``StateTransfer.settle``): ``finished`` says so without waiting, says nothing of a
    copy still under way or one that failed, and reports one served within its wait."""
    out, done, failed = _Copy(), _Copy(), _Copy(CommFailed("peer closed"))
    servers = [CopyServer(_Comm(), c, JOB, step=3) for c in (out, done, failed)]  # type: ignore[arg-type]
    done.go.set()
    failed.go.set()
    for s in servers[1:]:
        s._thread.join(10)
    assert servers[0].finished() is None
    got = servers[1].finished()
    assert got is not None and (got["bytes_sent"], got["ranges_sent"]) == (7, 1)
    assert servers[2].finished() is None
    assert servers[2].finished(0.05) is None  # a failed copy: nothing, however long
    # one still on its way is given the wait it is offered: served meanwhile, reported
    assert servers[0].finished(0.01) is None
    threading.Timer(0.05, out.go.set).start()
    late = servers[0].finished(10)
    assert late is not None and (late["bytes_sent"], late["ranges_sent"]) == (7, 1)
    servers[0].close()
