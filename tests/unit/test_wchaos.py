"""The worker's side of in-process faults: it applies what the launcher posts, and never
dies of a value it reads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from perdure import events as ev
from perdure.chaos.config import ChaosConfig, FaultConfig
from perdure.runtime.member.wchaos import ChaosState


class Store:
    """The two store calls the worker makes, over a dict; counts them."""

    def __init__(self, values: dict[str, Any] | None = None) -> None:
        self.values = {k: v if isinstance(v, bytes) else json.dumps(v).encode()
                       for k, v in (values or {}).items()}  # fmt: skip
        self.calls = 0

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        self.calls += 1
        return self.values[key]


class Log:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)


def _poll(state: ChaosState, store: Store, log: Log | None = None) -> None:
    state.poll(store, "a-0", "a", log)  # type: ignore[arg-type]


def test_a_delay_and_a_comm_error_are_applied_once() -> None:
    state = ChaosState()
    store = Store({
        "chaos/a": {"kind": "delay", "seq": 1, "delay_ms": 250, "duration_s": 60},
        "chaos/a-0": {"kind": "comm_error", "seq": 2},
    })  # fmt: skip
    _poll(state, store)
    assert state.delay_s() == 0.25
    assert state.take_comm_error() is True
    _poll(state, store)  # the same seq again: already applied
    assert state.take_comm_error() is False


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"\xff\xfe",
        json.dumps([1, 2]).encode(),
        json.dumps({"kind": "meteor", "seq": 1}).encode(),
        json.dumps({"kind": ["delay"], "seq": 1}).encode(),
        json.dumps({"kind": "comm_error"}).encode(),
        json.dumps({"kind": "comm_error", "seq": True}).encode(),
        json.dumps({"kind": "delay", "seq": 1, "delay_ms": -5}).encode(),
        json.dumps({"kind": "delay", "seq": 1, "delay_ms": 5, "duration_s": "2"}).encode(),
        b'{"kind": "delay", "seq": 1, "delay_ms": 5, "duration_s": NaN}',
        json.dumps({"kind": "comm_error", "seq": 1, "extra": 1}).encode(),
    ],
)
def test_a_bad_value_is_ignored_and_logged_once(raw: bytes) -> None:
    state, log = ChaosState(), Log()
    store = Store({"chaos/a-0": raw})
    for _ in range(3):  # every heartbeat reads it again
        _poll(state, store, log)
    assert state.delay_s() == 0.0 and state.take_comm_error() is False
    (rec,) = log.records
    assert rec["event"] == ev.FAULT_REJECTED and rec["key"] == "chaos/a-0" and rec["reason"]


def test_a_good_value_after_a_bad_one_is_applied() -> None:
    state, log = ChaosState(), Log()
    store = Store({"chaos/a-0": b"garbage"})
    _poll(state, store, log)
    store.values["chaos/a-0"] = json.dumps({"kind": "comm_error", "seq": 3}).encode()
    _poll(state, store, None)
    assert state.take_comm_error() is True and len(log.records) == 1


def _schedule(*faults: dict[str, Any]) -> ChaosConfig:
    return ChaosConfig(faults=[FaultConfig(at_step=1, **f) for f in faults])


def test_armed_with_no_in_process_fault_it_never_touches_the_store() -> None:
    state, store = ChaosState(), Store({"chaos/a-0": {"kind": "comm_error", "seq": 1}})
    state.arm(_schedule({"kind": "kill", "target": "a-0"}))
    _poll(state, store)
    assert store.calls == 0 and state.take_comm_error() is False


def test_armed_it_polls_only_the_keys_its_schedule_posts_to() -> None:
    state = ChaosState()
    store = Store({"chaos/a": {"kind": "delay", "seq": 1, "delay_ms": 100}})
    state.arm(_schedule({"kind": "delay", "target": "a", "delay_ms": 100},
                        {"kind": "comm_error", "target": "b-0"}))  # fmt: skip
    _poll(state, store)
    assert store.calls == 2 and state.delay_s() == 0.1  # check and get of chaos/a only
