"""A membership epoch's data plane: one gloo (or NCCL) group whose operations can be abandoned.

gloo's ``Work.wait`` cannot be interrupted from another thread (``abort()`` does not wake
it), so every data-plane operation runs on a private thread and the step loop waits for it
in short slices, checking an abort predicate between slices. When the coordinator declares a
peer dead, the predicate turns true and the step loop leaves at once; the abandoned thread
ends by itself when its own timeout expires, holding only the old group.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from perdure.runtime.comm.tiers import Tiers, build_tiers

T = TypeVar("T")
_SLICE_S = 0.01
"""The longest a wait in :meth:`Comm.result` goes without looking at its abort predicate
(a notice that should end it wakes it at once: :func:`wake_waits`)."""

_WAITS: set[threading.Event] = set()
"""The events of the waits in :meth:`Comm.result` under way in this process."""
_WAITS_LOCK = threading.Lock()


def wake_waits() -> None:
    """Make every wait in :meth:`Comm.result` of this process look at its abort predicate
    now: the membership client calls it on each notice (a new epoch announced, a stop,
    its coordinator lost). Without it a survivor learned of a peer's death up to
    ``_SLICE_S`` late, on a kill's critical path once the death is told before the
    collective fails (``control/liveness.py``)."""
    with _WAITS_LOCK:
        for woken in _WAITS:
            woken.set()


class Abandoned(RuntimeError):
    """The step loop gave up on a collective because the membership epoch changed."""


class CommFailed(RuntimeError):
    """A collective failed (a peer closed its connection, or the timeout expired): a fault
    of the data plane, absorbed by a new membership epoch. Its ``__cause__`` is the
    backend's exception."""


_BACKEND_FAILURES = (
    "gloo/transport",  # gloo's socket errors carry their source path: "Read error", ...
    "Connection closed by peer",
    "Connection reset by peer",
    "Operation timed out",
    "Application timeout caused pair closure",
    "Timed out waiting",
    "NCCL error",
    "NCCL communicator was aborted",
    "Broken pipe",
)


def is_collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is the data plane failing, not a bug in the code on the comm thread.

    gloo reports every transport failure as a plain ``RuntimeError``; a shape mismatch or
    a wrong argument is a ``RuntimeError`` too, so the message decides. The store's and
    NCCL's failures have their own types (``DistError`` and its subclasses).
    """
    if isinstance(e, dist.DistError | TimeoutError | ConnectionError):
        return True
    return type(e) is RuntimeError and any(m in str(e) for m in _BACKEND_FAILURES)


class Comm:
    """One process group under a fresh store prefix, with abandonable operations."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        size: int,
        timeout: timedelta,
        should_abort: Callable[[], bool],
        backend: str = "gloo",
        bind: str | None = None,
        interface: str | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``bind``: the address this member's gloo listeners use (its own address as the
        coordinator sees it); unset, gloo resolves the host name, which may be any
        interface, or loopback on another host's behalf. ``interface``: the network
        interface by name instead (gloo's device, and ``NCCL_SOCKET_IFNAME``)."""
        self.rank, self.size, self.timeout = rank, size, timeout
        self.device = device or torch.device("cpu")
        """Where this group's tensors must live (CUDA for NCCL, the CPU for gloo)."""
        self.should_abort = should_abort
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix=f"comm-{prefix}")
        group = _Group(prefix, rank, size, timeout, backend, bind, interface)
        self._group = group
        self.tiers: Tiers | None = None
        """The region and leader groups of a two-tier reduction (``add_tiers``)."""
        # Closed until formed: an epoch that changes while its group forms closes this
        # Comm in ``call`` (it raised AttributeError there instead of Abandoned, and the
        # worker exited: seen in a clean-clone CI, a region lost as an epoch started).
        self.pg: Any = _CLOSED
        self.pg = self.call(lambda: group.make(store))

    def add_tiers(self, store: dist.Store, region: str, *, direct: bool = True) -> None:
        """Build this epoch's two-tier groups (``comm/tiers.py``); every member calls it,
        with the same ``direct`` (the leaders' direct exchange, or the backend's
        all-reduce)."""
        g = self._group

        def make(prefix: str, rank: int, size: int) -> Any:
            return dataclasses.replace(g, prefix=prefix, rank=rank, size=size).make(store)

        args = (store, g.prefix, self.rank, self.size, region, make, self.timeout, direct)
        self.tiers = self.call(lambda: build_tiers(*args))

    def subgroup(self, store: dist.Store, name: str, rank: int, size: int) -> Comm:
        """A process group of some members of this epoch under ``<prefix><name>/`` (a
        replica group of ``runtime/shard``), with its own comm thread, the same backend,
        address and timeout; only the ``size`` members that call it with the same
        ``name`` meet."""
        g = self._group
        return Comm(
            store,
            f"{g.prefix}{name}/",
            rank,
            size,
            self.timeout,
            self.should_abort,
            backend=g.backend,
            bind=g.bind,
            interface=g.interface,
            device=self.device,
        )

    def call(self, fn: Callable[[], T], *, grace_s: float = 0.0) -> T:
        """Run ``fn`` on the comm thread; raise Abandoned or CommFailed instead of hanging.
        ``grace_s``: once the epoch changes, how long to let ``fn`` finish before leaving
        it, for an exchange that tears this rank's replica if left half done while its
        peers finish (an update's parameters)."""
        return self.result(self.submit(fn), grace_s=grace_s)

    def any_rank(self, flag: bool, timeout: timedelta | None = None) -> bool:
        """Whether ``flag`` holds on any rank (a MAX all-reduce of one integer): for a
        choice every rank must make alike because what follows it is a collective, such
        as whether to write the final checkpoint (``Worker._finish``)."""
        if self.size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
        wait = timeout or self.timeout
        self.call(lambda: self.pg.allreduce([t], opts).wait(wait))
        return bool(t.item())

    def submit(self, fn: Callable[[], T]) -> cf.Future[T]:
        """Start ``fn`` on the comm thread (the step loop goes on; see :meth:`result`)."""
        return self._pool.submit(fn)

    def result(
        self,
        fut: cf.Future[T],
        *,
        grace_s: float = 0.0,
        abort: Callable[[], bool] | None = None,
    ) -> T:
        """Wait for ``fut`` in short slices, leaving once the epoch has changed (at once,
        or ``grace_s`` after: see :meth:`call`). ``abort``: when to leave instead of the
        group's own predicate (an overlapped outer step's reduction, waited on during the
        next step: it is abandoned only when its own step is)."""
        should_abort = abort or self.should_abort
        since: float | None = None
        woken = threading.Event()
        fut.add_done_callback(lambda _: woken.set())
        with _WAITS_LOCK:
            _WAITS.add(woken)
        try:
            while True:
                woken.wait(_SLICE_S)
                woken.clear()
                if fut.done():
                    break
                if since is None and should_abort():
                    since = time.monotonic()
                if since is not None and time.monotonic() - since >= grace_s:
                    self.close()
                    raise Abandoned("membership epoch changed during a collective")
        finally:
            with _WAITS_LOCK:
                _WAITS.discard(woken)
        try:
            return fut.result()
        except (Abandoned, CommFailed):
            raise
        except Exception as e:
            if is_collective_failure(e):
                raise CommFailed(_one_line(e)) from e
            e.add_note("perdure: raised on the comm thread, and not by the backend: a bug")
            raise

    def close(self) -> None:
        """Leave the group: its comm thread is let go, and the process group (and a
        two-tier reduction's groups) is dropped on a thread of its own (:func:`_drop`); any
        later use of it raises CommFailed."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        hold, self.pg = [self.pg], _CLOSED  # no other local reference: see _drop
        if hold[0] is not _CLOSED:
            _drop(hold)
        if self.tiers is not None:  # its region's and leaders' groups, alike
            tiers, self.tiers = self.tiers, None
            _drop([g for g in (tiers.local, tiers.cross) if g is not None])


class _Closed:
    """What a closed Comm's ``pg`` is: any use raises CommFailed (the epoch is over)."""

    def __getattr__(self, name: str) -> Any:
        raise CommFailed(f"process group closed (used for {name!r} after its epoch ended)")


_CLOSED: Any = _Closed()


DROP_WAIT_S = 60.0
"""Longest a dropped process group waits for its other references to go (:func:`_drop`)
before its thread lets it go regardless."""

_DROP_POLL_S = 0.02


def _drop(hold: list[Any]) -> None:
    """Drop a process group on a daemon thread of its own. Its destructor joins gloo's
    threads and closes its pairs: 20-30 ms here (0.1 s with a dead peer), with the GIL
    released, but the thread that lets the last reference go waits that long. Run where
    the group was last referenced, it landed on a kill's critical path (the receiver's
    copy group just before it joins the redone step's reduction, each holder's at its
    gate, the old epoch's between a survivor's abandon and its ready report).

    So the thread keeps the group until its own is the only reference, then lets it go:
    the destructor runs here, not wherever the collector happens to run. At a kill, the
    group is still held by the operation abandoned on the comm thread (its frames, the
    closure it runs) and then by the exception that ends it, whose traceback is a cycle
    only the garbage collector frees. Measured before this wait: a gen-0 collection of
    13-23 ms in each holder at each kill, on its main thread or its copy's thread, the old
    epoch's group destroyed inside it (docs/performance.md, section 17).
    A reference still held after ``DROP_WAIT_S`` is left to its holder. ``hold``: the
    only reference the caller has, in a list the thread empties (a local name left in a
    caller's frame would drop it there)."""
    threading.Thread(target=_release, args=(hold,), name="pg-drop", daemon=True).start()


def _release(hold: list[Any]) -> None:
    end = time.monotonic() + DROP_WAIT_S
    # 2: the list's reference and getrefcount's argument (indexed: a loop variable would
    # be a third)
    while time.monotonic() < end and any(sys.getrefcount(hold[i]) > 2 for i in range(len(hold))):
        time.sleep(_DROP_POLL_S)
    hold.clear()


@dataclass(frozen=True)
class _Group:
    """How to build one epoch's process group."""

    prefix: str
    rank: int
    size: int
    timeout: timedelta
    backend: str
    bind: str | None
    interface: str | None = None

    def make(self, store: dist.Store) -> Any:
        sub = dist.PrefixStore(self.prefix, store)
        if self.backend == "nccl":  # pragma: no cover - needs a GPU
            _nccl_interface(self.interface, self.bind)
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = self.timeout
            return dist.ProcessGroupNCCL(sub, self.rank, self.size, nccl)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = self.timeout
        if self.interface:
            opts._devices = [dist.ProcessGroupGloo.create_device(interface=self.interface)]
        elif self.bind:
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind)]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(sub, self.rank, self.size, opts)


def _nccl_interface(interface: str | None, bind: str | None) -> None:
    """NCCL picks its socket interface from ``NCCL_SOCKET_IFNAME`` only: name the one
    given, or the one that holds the bind address (an operator's own setting wins)."""
    import os

    from perdure.runtime.control.address import interface_of

    name = interface or (interface_of(bind) if bind else None)
    if name and "NCCL_SOCKET_IFNAME" not in os.environ:
        os.environ["NCCL_SOCKET_IFNAME"] = f"={name}"  # '=': exactly this interface


def _one_line(e: BaseException) -> str:
    """gloo's errors carry a C++ source path and a stack; keep the sentence a user needs."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    return text[:300]
