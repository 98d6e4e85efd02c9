"""A worker's epoch start when the run's store fails (``Worker._run_epoch``), in process:
no coordinator, no group, only the worker's handling of what the store raised."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from perdure.runtime.control import protocol as p
from perdure.runtime.plan import from_counts
from perdure.runtime.worker import Worker


class _Client:
    epoch_no = 5

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def should_stop(self, step: int | None) -> bool:
        return False


@pytest.mark.parametrize("error", [dist.DistNetworkError, dist.DistStoreError])
def test_an_unreachable_store_at_an_epochs_start_is_reported_not_raised(
    error: type[Exception],
) -> None:
    """The coordinator (and its store) died as the epoch started: the member reports the
    failure and keeps its state for the standby; the error ended the process before, and
    the state of the run's last survivor with it (seen in a clean-clone CI)."""
    w = Worker.__new__(Worker)
    w.name, w.client, w.shards = "r1-0", _Client(), None
    w.trainer = SimpleNamespace(next_step=399)

    def unreachable(timeout_s: float | None = None) -> Any:
        raise error("store 127.0.0.1:33167 unreachable: [Errno 111] Connection refused")

    w._store = unreachable  # type: ignore[method-assign]
    plan = from_counts(["r1-0", "r0-1"], [4, 4])
    start = p.Start(epoch=5, plan=plan.to_dict(), start_step=399, source="r1-0",
                    receivers=["r0-1"], recover=False, reload=None, prefix="pg/5/x/",
                    generation=1)  # fmt: skip
    w._run_epoch(start)
    [fail] = w.client.sent
    assert isinstance(fail, p.Fail) and fail.epoch == 5 and "unreachable" in fail.error
    assert w.trainer.next_step == 399  # the state is kept
