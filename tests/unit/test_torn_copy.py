"""A receiver whose state copy fails after it began writing into its model tensors
(``Trainer.copy_target`` tears the replica, ``Worker._ready`` then reports no state), in
process: no group, a copy that fails where a test says."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from perdure.events import JsonLines
from perdure.runtime.comm.group import CommFailed
from perdure.runtime.comm.swarm import CopyJob
from perdure.runtime.control import protocol as p
from perdure.runtime.member.transfer import StateTransfer
from perdure.runtime.plan import from_counts
from perdure.runtime.replica.trainer import Trainer
from perdure.runtime.shard_plan import ALL
from perdure.runtime.worker import Worker


class _FailingCopy:
    """Fills ``writes`` of the receiver's model tensors (0: none), then fails."""

    def __init__(self, writes: int) -> None:
        self.writes = writes
        self.stats: dict[str, int] = {}

    def copy(self, comm: Any, job: CopyJob) -> None:
        assert job.target is not None
        for name in ("weight", "bias")[: self.writes]:
            job.target(f"model/{name}", (2,), torch.float32).fill_(7.0)
        raise CommFailed("a holder's link dropped during the copy")


def _member_behind() -> Any:
    """A replica at step 41 (it gave up a step its peers committed: it receives)."""
    tr = SimpleNamespace(
        module=torch.nn.Linear(2, 2),
        torn=False,
        gather=None,
        next_step=41,
        held=ALL,
        state_version=3,
        export=lambda: ({}, {}, {}),
        copy_layout=lambda: {},
    )
    tr.copy_target = lambda device: Trainer.copy_target(tr, device)  # type: ignore[arg-type]
    return tr


class _Client:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def wait_start(self, epoch: int) -> None:
        return None


@pytest.mark.parametrize(("writes", "torn"), [(1, True), (2, True), (0, False)])
def test_a_copy_that_fails_after_writing_leaves_a_member_behind_with_no_state_to_offer(
    writes: int, torn: bool, tmp_path: Any
) -> None:
    """Reporting its old state after a copy wrote part of its model could have made that
    mixture the run's state where every holder was lost with the copy; a copy that failed
    before writing leaves its state as it was."""
    tr = _member_behind()
    transfer = StateTransfer(
        name="r1",
        events=JsonLines(tmp_path / "events.jsonl"),
        state_copy=_FailingCopy(writes),
        shard_degree=1,
        timeout=lambda: timedelta(seconds=5),
        should_stop=lambda: False,
    )
    ep = SimpleNamespace(
        plan=from_counts(["r0", "r1"], [4, 4]),
        start=SimpleNamespace(receivers=["r1"], source="r0"),
        comm=SimpleNamespace(device="cpu"),
        runner=SimpleNamespace(first=None),
    )
    with pytest.raises(CommFailed):
        transfer.copy(ep, tr)  # type: ignore[arg-type]
    assert tr.torn is torn

    w = Worker.__new__(Worker)
    w.trainer, w.has_state, w.client = tr, True, _Client()
    w.salvage = SimpleNamespace(held=lambda key: [])
    w._ready(p.Announce(epoch=4, after=-1, members=["r0", "r1"], generation=1))
    [ready] = w.client.sent
    assert ready.has_state is not torn and ready.next_step == 41


def test_a_copy_after_a_failed_one_receives_where_that_ones_late_bytes_cannot_land() -> None:
    """The failed copy's receives may still land (gloo writes whenever the bytes arrive):
    into the storage they were posted with, which the next copy no longer uses."""
    tr = _member_behind()
    before = tr.module.weight.detach().clone()
    late = tr.copy_target("cpu")("model/weight", (2, 2), torch.float32)  # a receive posted
    assert tr.torn and late.data_ptr() == tr.module.weight.data_ptr()  # the first: in place
    target = tr.copy_target("cpu")
    got = target("model/weight", (2, 2), torch.float32)
    assert target("model/weight", (2, 2), torch.float32).data_ptr() == got.data_ptr()  # once
    assert got.data_ptr() == tr.module.weight.data_ptr() != late.data_ptr()
    got.copy_(before)
    late.fill_(7.0)  # the failed copy's bytes, arriving now
    assert torch.equal(tr.module.weight.detach(), before)
    assert isinstance(tr.module.weight, torch.nn.Parameter)


def test_a_copy_into_an_untorn_replica_writes_its_tensors_in_place() -> None:
    tr = _member_behind()
    ptr = tr.module.bias.data_ptr()
    assert tr.copy_target("cpu")("model/bias", (2,), torch.float32).data_ptr() == ptr


def test_a_torn_replica_whose_gather_holds_its_storages_is_received_in_place() -> None:
    """An epoch's parameter gather keeps each parameter's own storage: a new one there
    would be put back by its next free."""
    tr = _member_behind()
    tr.gather, tr.torn = object(), True
    ptr = tr.module.weight.data_ptr()
    assert tr.copy_target("cpu")("model/weight", (2, 2), torch.float32).data_ptr() == ptr
