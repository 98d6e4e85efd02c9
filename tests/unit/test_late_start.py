"""A reduction started from a thread once a gate passes (``runtime/late_start.py``): it
starts only after the gate, never after a cancel, and the gate's failure reaches the step."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest

from perdure.runtime.comm.group import Abandoned, CommFailed
from perdure.runtime.late_start import LateStart


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def test_the_reduction_starts_once_the_gate_passes_and_its_future_is_handed_back() -> None:
    opened, order = threading.Event(), []

    def gate() -> None:
        assert opened.wait(10)
        order.append("gate")

    def start() -> Future[Any]:
        order.append("start")
        return _done(7)

    starter = LateStart(gate, start)
    assert order == []  # held at the gate
    opened.set()
    assert starter.join(lambda: False).result() == 7
    assert order == ["gate", "start"]
    assert starter.cancel()  # had started: the pass keeps what the reducer holds


def test_a_gate_that_fails_fails_the_join_and_nothing_starts() -> None:
    started: list[int] = []

    def gate() -> None:
        raise CommFailed("state copy failed")

    starter = LateStart(gate, lambda: started.append(1) or _done(None))  # type: ignore[func-returns-value]
    with pytest.raises(CommFailed, match="state copy failed"):
        starter.join(lambda: False)
    assert started == [] and not starter.cancel()


def test_a_cancel_before_the_gate_passes_means_no_start_and_the_join_leaves_on_abort() -> None:
    opened, started = threading.Event(), []
    starter = LateStart(lambda: opened.wait(10) and None, lambda: started.append(1) or _done(None))  # type: ignore[func-returns-value]
    assert not starter.cancel()
    with pytest.raises(Abandoned):
        starter.join(lambda: True)
    opened.set()
    starter._thread.join(10)
    assert started == [] and starter.fut is None
