"""The coordinator's store keeps torch's ``HashStore`` semantics without torch: the same
operations give the same answers as ``HashStore`` (the rendezvous of gloo and NCCL rely on
them through ``AuthStore``)."""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from perdure.runtime.control.store_memory import MemoryStore, StoreTimeout, StoreValueError

_KEYS = ["a", "b", "c"]
_VALUES = [b"", b"x", b"7", b"-3", b"yz"]


def _apply(store: object, op: tuple) -> object:
    name, *args = op
    if name == "add":
        key, n = args
        try:
            return store.add(key, n)  # type: ignore[attr-defined]
        except (StoreValueError, RuntimeError, ValueError):
            return "not a number"
    if name == "get":
        return store.get(args[0]) if store.check([args[0]]) else None  # type: ignore[attr-defined]
    return getattr(store, name)(*args)


def _ops(rng: random.Random, n: int) -> list[tuple]:
    ops: list[tuple] = []
    for _ in range(n):
        kind = rng.choice(["set", "add", "compare_set", "check", "delete_key", "get", "num_keys"])
        key = rng.choice(_KEYS)
        if kind == "set":
            ops.append(("set", key, rng.choice(_VALUES)))
        elif kind == "add":
            ops.append(("add", key, rng.randint(-5, 5)))
        elif kind == "compare_set":
            ops.append(("compare_set", key, rng.choice(_VALUES), rng.choice(_VALUES)))
        elif kind == "check":
            ops.append(("check", rng.sample(_KEYS, rng.randint(1, 3))))
        elif kind in ("delete_key", "get"):
            ops.append((kind, key))
        else:
            ops.append(("num_keys",))
    return ops


@pytest.mark.parametrize("seed", range(20))
def test_a_sequence_of_operations_answers_as_torchs_hash_store(seed: int) -> None:
    ops = _ops(random.Random(seed), 60)
    mine, theirs = MemoryStore(), dist.HashStore()
    for op in ops:
        if op[0] == "add" and _apply(mine, ("check", [op[1]])):
            # HashStore's add of a non-number is undefined behaviour (std::stoll): the
            # server answers it with an error; compare only additions to numbers
            try:
                int(mine.get(op[1]))
            except ValueError:
                continue
        got, want = _apply(mine, op), _apply(theirs, op)
        assert got == want, (op, got, want)


def test_an_add_to_a_value_that_is_not_a_number_names_the_key() -> None:
    store = MemoryStore()
    store.set("k", b"abc")
    with pytest.raises(StoreValueError, match=r"'k'.*not a decimal integer"):
        store.add("k", 1)


def test_a_wait_returns_when_another_thread_sets_the_last_key() -> None:
    store = MemoryStore()
    store.set("a", b"1")
    threading.Timer(0.05, store.set, args=("b", b"2")).start()
    start = time.monotonic()
    store.wait(["a", "b"], timeout_s=5)
    assert time.monotonic() - start < 4


def test_a_wait_for_a_missing_key_times_out_naming_it() -> None:
    store = MemoryStore()
    with pytest.raises(StoreTimeout, match="'gone'"):
        store.wait(["gone"], timeout_s=0.05)
    hs = dist.HashStore()
    with pytest.raises(dist.DistStoreError):  # HashStore does the same
        hs.wait(["gone"], timedelta(milliseconds=50))
