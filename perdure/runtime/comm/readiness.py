"""How much of a slot buffer is final, for a reduction that streams behind backward, and
how far ahead of the reduction the backward may write (its window)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from perdure.runtime.comm.group import Abandoned

_SLICE_S = 0.01


class Readiness:
    """How much of a slot buffer is final, for a reduction that streams behind backward.

    Only a prefix counts: the reduction reads the buffer front to back, and a prefix is
    final once every parameter laid out in it has its gradient.

    The other direction is a window: a reduction that hands the pages of its finished
    buckets back (``comm/pages.py``) :meth:`allow`\\ s the backward to write up to an
    offset, and the backward asks for :meth:`room` before it writes a gradient, so that a
    rank holds the buckets in flight, not the whole buffer. The window never deadlocks:
    the backward goes on at once while the reduction waits for a prefix (a gradient may
    come out of order), once the reduction has :meth:`close`\\ d, and once ``abort`` says
    the step is abandoned (the reduction's thread may never run).
    """

    def __init__(self, abort: Callable[[], bool] = lambda: False) -> None:
        self._cond = threading.Condition()
        self._upto = 0
        self._limit = math.inf
        self._starved = False
        self._closed = False
        self._abort = abort

    # -- the backward's side -------------------------------------------------------------

    def advance(self, upto: int) -> None:
        with self._cond:
            if upto > self._upto:
                self._upto = upto
                self._cond.notify_all()

    def room(self, upto: int) -> None:
        """Block while writing ``[.., upto)`` would run past the window (see the class)."""
        with self._cond:
            while upto > self._limit and not (self._starved or self._closed):
                if self._abort():
                    return
                self._cond.wait(_SLICE_S)

    # -- the reduction's side ------------------------------------------------------------

    def allow(self, limit: float) -> None:
        """The backward may write up to ``limit`` (math.inf: anywhere)."""
        with self._cond:
            self._limit = limit
            self._cond.notify_all()

    def close(self) -> None:
        """The reduction reads no more: the backward is never held again."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait(self, upto: int, should_abort: Callable[[], bool], timeout_s: float) -> None:
        """Block until ``[0, upto)`` is final; raise if the step is abandoned or times out."""
        end = time.monotonic() + timeout_s
        with self._cond:
            try:
                while self._upto < upto:
                    if not self._starved:
                        self._starved = True
                        self._cond.notify_all()
                    if should_abort():
                        raise Abandoned("step abandoned while its gradient was being computed")
                    if time.monotonic() > end:
                        raise TimeoutError(f"slot gradient not ready within {timeout_s} s")
                    self._cond.wait(_SLICE_S)
            finally:
                self._starved = False
