"""The overlapped state copy: holders serve their committed state from a background thread
while they compute the epoch's first step; a receiver copies it, then joins that step.

Where ``copy_rule.overlaps`` allows it, the coordinator plans the epoch's first step (step
``s``, the start step) with no slot on any receiver (``plan.idle_plan``). Then:

- a *holder* builds its offer from its committed state (after step ``s - 1``), starts a
  :class:`CopyServer` and begins step ``s`` at once: its slots' forwards and backwards run
  while the server sends ranges on the epoch's group (its comm thread: the copy's
  messages never interleave with the step's collectives, which come after the gate);
- a *receiver* copies on that group in its own main thread (it has nothing else to
  do), adopts the state of step ``s - 1``, and enters step ``s`` with no
  slot: its part in the reduction adds nothing, and it applies the step's update from the
  reduced sum like every member. So it catches up on the step it missed by taking part in
  its reduction, not by a second copy, and the run never waits for a step it already did.

Snapshot consistency. A holder serves tensors it will mutate in step ``s``, so the step
must not mutate what the copy has not sent yet. The optimizer's update is the only write
to the parameters and the optimizer state in a step, and it comes after the reduction; a
holder waits for its server to finish (:meth:`CopyServer.wait`, the step runner's
``gate``) before it enters the reduction, the step's first collective on the epoch's
group. The buffers are the exception: a slot's forward moves them and the engine puts
them back after the slot (docs/architecture.md, "Buffers"), so a range read mid-forward
would be torn: the offer holds clones of every model tensor that is not a parameter
(:func:`committed_offer`; buffers are small). The parameters and optimizer tensors are
served in place: no second copy of the state, whatever its size. Waiting before the
reduction costs nothing a receiver would not cost anyway: the reduction cannot complete
without the receiver, which enters it only once its copy is in.

Cost: the step's slots are computed by the holders alone (S / (W - r) each instead of
S / W), and its reduction starts once the copy is done: a copy shorter than the holders'
compute of one step is hidden; a longer one shows by the difference (a 1.2 TB state at
link rate is not hidden by one step: the step waits for it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from perdure.runtime.comm.group import Abandoned, Comm
from perdure.runtime.comm.swarm import CopyJob, StateCopy
from perdure.runtime.plan import Plan

State = tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]

_SLICE_S = 0.01


def is_overlapped(first: Plan | None, receivers: Sequence[str]) -> bool:
    """Whether an epoch's copy overlaps its first step: receivers there are, and the first
    step's own plan (``Start.first``) gives each of them no slot (the coordinator plans it
    so exactly where ``copy_rule.overlaps``)."""
    if not receivers or first is None:
        return False
    return all(len(first.slots_of(first.members.index(r))) == 0 for r in receivers)


def committed_offer(state: State, params: Sequence[torch.Tensor]) -> State:
    """A holder's offer that stays its committed state while it computes the next step:
    ``state`` (``Trainer.export``) with every model tensor that is not one of ``params``
    cloned (the buffers a slot's forward moves and puts back); the parameters and the
    optimizer's tensors as they are (only the update writes them, after the copy)."""
    model, optim, extra = state
    held = {p.data_ptr() for p in params}
    snap = {k: t if t.data_ptr() in held else t.detach().clone() for k, t in model.items()}
    return snap, optim, extra


class CopyServer:
    """A holder's side of an overlapped copy on a background thread (see the module's
    docstring): runs the copy on the epoch's own group (``comm``, whose comm thread runs
    the copy's operations) from a thread of its own, and records what it sent (``sent``:
    seconds and the copy's counters) or the exception that ended it. The group is the
    epoch's to close.

    Why no group is built on the thread: building a gloo group is a few dozen store round
    trips, each of which needs the GIL back in Python. On a thread beside a main thread
    that computes slots, each waited up to the interpreter's switch interval (5 ms) for
    it: measured, a copy group of its own formed 0.10-0.13 s after the epoch's (about
    0.01 s) and was the largest share of a kill's cost (docs/performance.md, section 17)."""

    def __init__(
        self, comm: Comm, copy: StateCopy, job: CopyJob, *, step: int, mode: str = "overlapped"
    ) -> None:
        self.job = job
        self.mode = mode
        """``overlapped``, or ``paced`` for a paced copy's part (its events' mode)."""
        self.step = step
        """The step the holder's committed state is at: its ``state_sent`` event's."""
        self.sent: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._copy = copy
        self._t0 = time.monotonic()
        self._comm = comm
        self._thread = threading.Thread(target=self._serve, name="state-copy", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            got = self._copy.copy(self._comm, self.job)
            assert got is None, "a holder received state"
            stats = dict(self._copy.stats)
            self.sent = {"seconds": round(time.monotonic() - self._t0, 4), **stats}
        except BaseException as e:  # handed to the step loop by wait()
            self.error = e

    def wait(self, abort: Callable[[], bool]) -> dict[str, Any]:
        """Block until the copy is served (the step's gate before its reduction); raise
        what ended it (CommFailed: the epoch ends, the coordinator plans again), or
        Abandoned once ``abort`` holds (the epoch changed). Every operation of the copy
        has the epoch's collective timeout, so the thread ends by itself."""
        while self._thread.is_alive():
            self._thread.join(_SLICE_S)
            if self._thread.is_alive() and abort():
                raise Abandoned("membership epoch changed during the state copy")
        if self.error is not None:  # CommFailed, Abandoned, or a bug (raised as it is)
            raise self.error
        assert self.sent is not None
        return self.sent

    def served(self) -> bool:
        """Whether :meth:`wait` would return (or raise) at once: the copy served in full,
        or ended by what it raises."""
        return self.sent is not None or self.error is not None or not self._thread.is_alive()

    def finished(self, wait_s: float = 0.0) -> dict[str, Any] | None:
        """What was sent, where the copy was served in full (waiting up to ``wait_s`` for
        a copy still on its way); else None. Served in full is :attr:`sent` being set:
        the thread may still be closing the copy's group (seen in a clean-clone CI: the
        receiver held its state, the holder's thread was still alive)."""
        end = time.monotonic() + wait_s
        while self.sent is None and self.error is None and self._thread.is_alive():
            left = end - time.monotonic()
            if left <= 0:
                break
            self._thread.join(min(_SLICE_S, left))
        if self.error is not None or self.sent is None:
            return None
        return dict(self.sent)

    def close(self) -> None:
        """Leave the copy (an epoch that ended first): its group is closed (the epoch's
        own, closed with the epoch anyway), and the server thread ends at its next
        operation's abort check or timeout."""
        self._comm.close()
