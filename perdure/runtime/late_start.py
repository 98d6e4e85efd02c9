"""A reduction started behind a backward already under way, once a gate passes.

A holder whose overlapped state copy is still out when it begins its last slot of the
redone step (``member/copy_overlap.py``) may enter no collective of the epoch's group
before the copy is served: the group's one comm thread runs every operation in the order
it is given, the same on every rank. It used to compute that slot whole, then pass the
gate, then reduce every bucket after the backward (5-14 ms after the last gate,
traced); waiting at the gate first would leave it idle. Here the slot's backward starts
at once with a :class:`~perdure.runtime.comm.readiness.Readiness`, while a thread of
its own waits at the gate and then starts the reduction, which takes the buckets the
backward has finished at once and the rest as they come: the copy's operations are
still all queued before the reduction's, on every rank.

The reducer must allow it (``CarriedReduction.starts_late``): one whose backward is held
back by a window (its pages handed back as buckets go) needs its reduction started
before the backward writes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from perdure.runtime.comm.group import Abandoned

_SLICE_S = 0.01


class LateStart:
    """Pass ``gate``, then call ``start`` (which returns the reduction's future), on a
    thread of its own; :meth:`cancel` before the start means it never happens."""

    def __init__(self, gate: Callable[[], None], start: Callable[[], Future[Any]]) -> None:
        self._gate, self._start = gate, start
        self._lock = threading.Lock()
        self._cancelled = False
        self.fut: Future[Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="late-start", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._gate()
            with self._lock:
                if not self._cancelled:
                    self.fut = self._start()
        except BaseException as e:  # the gate's failure, raised again by join()
            self.error = e

    def join(self, abort: Callable[[], bool]) -> Future[Any]:
        """The reduction's future once it has started; raise what ended the gate, or
        Abandoned once ``abort`` holds (the gate itself checks it too)."""
        while self._thread.is_alive():
            self._thread.join(_SLICE_S)
            if self._thread.is_alive() and abort():
                raise Abandoned("membership epoch changed while the state copy was served")
        if self.error is not None:
            raise self.error
        assert self.fut is not None, "a late start that neither started nor failed"
        return self.fut

    def cancel(self) -> bool:
        """No start from now on (the pass was abandoned); whether it had started."""
        with self._lock:
            self._cancelled = True
            return self.fut is not None


__all__ = ["LateStart"]
