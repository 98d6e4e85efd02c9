"""The keys of the run's store, in the coordinator's memory, without torch.

The coordinator serves the store that process groups rendezvous through
(``store.StoreServer``). It kept the keys in torch's ``HashStore``, which made the
coordinator import torch only for a dictionary: ~1.5-2.5 s of CPU at every start (a run's
coordinator, a region's standby, a replacement after a region loss), the largest share of
its start-up. This is the same store in plain Python, with ``HashStore``'s semantics as
the clients (``AuthStore``, and through it gloo's and NCCL's rendezvous) rely on them:

- ``add`` keeps an integer as its decimal ASCII text and returns the new value; a missing
  key counts from 0;
- ``compare_set`` sets the desired value when the key holds the expected one, or is
  missing and the expected value is empty; it returns the value the key holds afterwards
  (the expected value when the key is missing and nothing was set);
- ``wait`` returns when every key exists and raises :class:`StoreTimeout` at its deadline.

Every operation holds one lock for a dictionary access; waiters sleep on a condition
that every write notifies, so a wait costs no CPU while it waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

__all__ = ["MemoryStore", "StoreTimeout", "StoreValueError"]


class StoreTimeout(Exception):
    """A wait that reached its deadline before every key existed."""


class StoreValueError(Exception):
    """An ``add`` to a key whose value is not a decimal integer."""


class MemoryStore:
    """Keys and byte values, safe to use from the server's client threads at once."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition(threading.Lock())

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = bytes(value)
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        """The value of ``key``; the server waits for it first (``KeyError`` if absent)."""
        with self._changed:
            return self._data[key]

    def add(self, key: str, n: int) -> int:
        with self._changed:
            old = self._data.get(key, b"0")
            try:
                value = int(old.decode("ascii")) + n
            except (UnicodeDecodeError, ValueError):
                raise StoreValueError(
                    f"add to key {key!r}: its value is not a decimal integer ({old[:40]!r})"
                ) from None
            self._data[key] = str(value).encode("ascii")
            self._changed.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._changed:
            current = self._data.get(key)
            if (current is None and not expected) or current == expected:
                self._data[key] = bytes(desired)
                self._changed.notify_all()
                return bytes(desired)
            return bytes(expected) if current is None else current

    def check(self, keys: Sequence[str]) -> bool:
        with self._changed:
            return all(k in self._data for k in keys)

    def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        with self._changed:
            while not all(k in self._data for k in keys):
                left = end - time.monotonic()
                if left <= 0:
                    missing = [k for k in keys if k not in self._data]
                    raise StoreTimeout(
                        f"wait timeout after {timeout_s * 1000:.0f} ms for keys {missing[:4]}"
                    )
                self._changed.wait(left)

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._changed:
            return len(self._data)
