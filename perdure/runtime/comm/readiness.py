"""How much of a slot buffer is final, for a reduction that streams behind backward."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from perdure.runtime.comm.group import Abandoned


class Readiness:
    """How much of a slot buffer is final, for a reduction that streams behind backward.

    Only a prefix counts: the reduction reads the buffer front to back, and a prefix is
    final once every parameter laid out in it has its gradient.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._upto = 0

    def advance(self, upto: int) -> None:
        with self._cond:
            if upto > self._upto:
                self._upto = upto
                self._cond.notify_all()

    def wait(self, upto: int, should_abort: Callable[[], bool], timeout_s: float) -> None:
        """Block until ``[0, upto)`` is final; raise if the step is abandoned or times out."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._upto < upto:
                if should_abort():
                    raise Abandoned("step abandoned while its gradient was being computed")
                if time.monotonic() > end:
                    raise TimeoutError(f"slot gradient not ready within {timeout_s} s")
                self._cond.wait(0.01)
