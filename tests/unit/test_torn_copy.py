"""A receiver's state while a copy writes into it (``StateTransfer.copy``'s ``writing``,
``Worker._torn_by_copy``), in process: no group, a copy that fails where a test says."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from perdure.events import JsonLines
from perdure.runtime.comm.group import CommFailed
from perdure.runtime.comm.swarm import CopyJob
from perdure.runtime.member.transfer import StateTransfer
from perdure.runtime.plan import from_counts
from perdure.runtime.worker import Worker


class _FailingCopy:
    """Fails after filling ``writes`` of the receiver's tensors (0: before any)."""

    def __init__(self, writes: int) -> None:
        self.writes = writes
        self.stats: dict[str, int] = {}

    def copy(self, comm: Any, job: CopyJob) -> None:
        for i in range(self.writes):
            assert job.target is not None
            job.target(f"model/w{i}", (2,), torch.float32).fill_(7.0)
        raise CommFailed("a holder's link dropped during the copy")


def _epoch(receivers: list[str]) -> Any:
    plan = from_counts(["r0", "r1"], [4, 4])
    start = SimpleNamespace(receivers=receivers, source="r0")
    runner = SimpleNamespace(first=None)
    return SimpleNamespace(plan=plan, start=start, comm=SimpleNamespace(device="cpu"),
                           runner=runner, number=3)  # fmt: skip


def _trainer() -> Any:
    tensors = {f"model/w{i}": torch.zeros(2) for i in range(3)}
    return SimpleNamespace(
        next_step=41,
        export=lambda: ({}, {}, {}),
        copy_layout=lambda: {},
        copy_target=lambda device: lambda key, shape, dtype: tensors[key],
        module=torch.nn.Linear(1, 1),
    )


def _transfer(writes: int, tmp_path: Any) -> StateTransfer:
    return StateTransfer(
        name="r1",
        events=JsonLines(tmp_path / "events.jsonl"),
        state_copy=_FailingCopy(writes),
        shard_degree=1,
        timeout=lambda: timedelta(seconds=5),
        should_stop=lambda: False,
    )


@pytest.mark.parametrize("writes", [0, 1, 3])
def test_a_receiver_is_told_once_before_the_copy_first_writes_its_tensors(
    writes: int, tmp_path: Any
) -> None:
    told: list[str] = []
    with pytest.raises(CommFailed):
        _transfer(writes, tmp_path).copy(_epoch(["r1"]), _trainer(), lambda: told.append("w"))
    assert told == (["w"] if writes else [])


def _member_behind(writes: int, tmp_path: Any) -> Worker:
    w = Worker.__new__(Worker)
    w.name, w.shards, w.has_state = "r1", None, True
    w.trainer = _trainer()
    w.transfer = _transfer(writes, tmp_path)
    return w


@pytest.mark.parametrize(("writes", "kept"), [(1, False), (0, True)], ids=["halfway", "before"])
def test_a_member_whose_copy_fails_halfway_offers_no_state_afterwards(
    writes: int, kept: bool, tmp_path: Any
) -> None:
    """It gave up a step its peers committed, so it receives; the copy wrote part of its
    model and failed. Reporting its old state after that (has_state) could have made the
    mixture the run's state where every holder was lost with the copy. A copy that failed
    before writing leaves its state as it was."""
    w = _member_behind(writes, tmp_path)
    ep = _epoch(["r1"])
    ep.start.recover = False
    with pytest.raises(CommFailed):
        w._transfer(ep)
    assert w.has_state is kept
