"""The lease's I/O for a coordinator, on its own thread: the policy's lease effects in, its
lease events out.

The server's loop must never block on the lease store (an etcd that does not answer, a
file server that hangs): failure detection and admission run on that loop. So the agent
takes the policy's lease effects (:class:`~policy.HoldLease`, :class:`~policy.WatchLease`,
:class:`~policy.AcquireLease`, :class:`~policy.ProbePrimary`, :class:`~policy.EndLease`),
carries them out one at a time with bounded calls, and posts each answer as an event
(``post`` appends to the server's queue, which is safe from another thread). Between
requests it renews every quarter TTL while holding, or reads the store every quarter TTL
while watching. It decides nothing: when to renew, probe or take over is the policy's.

An acquisition raises the run directory's fence to the new generation before it reports
the grant: the policy admits nobody under a generation the writers could not check.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from perdure.runtime.control import policy as pol
from perdure.runtime.control import protocol as p
from perdure.runtime.control.fence import current_generation, install_fence
from perdure.runtime.control.lease import Granted, LeaseStore, LeaseStoreError


class LeaseAgent:
    """One coordinator's lease I/O thread (see module doc)."""

    def __init__(
        self,
        store: LeaseStore,
        run_dir: str | Path,
        holder: dict[str, Any],
        post: Callable[[pol.Event], None],
        *,
        generation: int,
        primary: str | None = None,
    ) -> None:
        """``generation`` > 0: start holding it (a primary that acquired at start-up);
        0: start watching. ``primary``: the address a standby probes, instead of the
        channel the primary recorded in its lease (e.g. when the standby reaches it
        through another address)."""
        self.store, self.run_dir, self.holder, self.post = store, Path(run_dir), holder, post
        self.primary = primary
        self.interval_s = store.ttl_s / 4
        self.hold = generation
        self.requests: deque[pol.LeaseEffect] = deque()
        self.cond = threading.Condition()
        self.stopped = False
        self.due = time.monotonic() + self.interval_s
        self.thread = threading.Thread(target=self._run, name="lease-agent", daemon=True)
        self.thread.start()

    def submit(self, effect: pol.LeaseEffect) -> None:
        with self.cond:
            if isinstance(effect, pol.HoldLease):
                self.hold, self.due = effect.generation, 0.0
            elif isinstance(effect, pol.WatchLease):
                self.hold, self.due = 0, 0.0
            else:
                self.requests.append(effect)
            self.cond.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish the queued requests (an ``EndLease`` must land), then stop."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout_s)
        with contextlib.suppress(Exception):
            self.store.close()

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.requests and not self.stopped and time.monotonic() < self.due:
                    self.cond.wait(max(0.0, self.due - time.monotonic()))
                if self.requests:
                    job: pol.LeaseEffect | None = self.requests.popleft()
                elif self.stopped:
                    return
                else:
                    job = None
                    self.due = time.monotonic() + self.interval_s
                hold = self.hold
            try:
                self._do(job, hold)
            except (LeaseStoreError, OSError, ValueError, KeyError) as e:
                self.post(pol.LeaseUnavailable(f"{type(e).__name__}: {e}", time.monotonic()))

    def _do(self, job: pol.LeaseEffect | None, hold: int) -> None:
        if job is None:
            if hold > 0:
                self._answer(self.store.renew(hold), acquired=False)
            else:
                self.post(pol.LeaseObserved(self.store.observe(), time.monotonic()))
        elif isinstance(job, pol.AcquireLease):
            floor = current_generation(self.run_dir)
            got = self.store.acquire(job.expect, floor, self.holder)
            if isinstance(got, Granted):
                install_fence(self.run_dir, got.generation, self.holder)
            self._answer(got, acquired=True)
        elif isinstance(job, pol.ProbePrimary):
            serving, detail = probe(self.primary or job.channel, min(1.0, self.store.ttl_s / 2))
            self.post(pol.PrimaryProbed(serving, detail, time.monotonic()))
        elif isinstance(job, pol.EndLease):
            self.store.end(job.generation)

    def _answer(self, got: Any, *, acquired: bool) -> None:
        """Post the answer. Only an acquisition switches to holding: a renewal's answer
        must not undo a ``WatchLease`` that arrived while it was in flight."""
        now = time.monotonic()
        if isinstance(got, Granted):
            if acquired:
                with self.cond:
                    self.hold = got.generation
            self.post(pol.LeaseGranted(got.generation, got.until, now))
        else:
            with self.cond:
                self.hold = 0  # refused: read the store from now on
            self.post(pol.LeaseLost(got.view, now))


def probe(channel: str, timeout_s: float) -> tuple[bool, str]:
    """Whether a serving coordinator answers at ``channel`` (``HOST:PORT``) within
    ``timeout_s``: it must send its challenge, and the challenge must say serving. A port
    that accepts but never speaks (a hung process) is no answer."""
    host, _, port = channel.rpartition(":")
    if not host or not port.isdigit():
        return False, f"no channel to probe ({channel!r})"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            buf = p.LineBuffer()
            msgs: list[p.Message] = []
            end = time.monotonic() + timeout_s
            while not msgs and time.monotonic() < end:
                data = sock.recv(65536)
                if not data:
                    break
                msgs = buf.feed(data)
    except (OSError, p.ProtocolError) as e:
        return False, f"no answer from {channel}: {e}"
    if not msgs or not isinstance(msgs[0], p.Challenge):
        return False, f"no challenge from {channel}"
    c = msgs[0]
    if c.serving:
        return True, f"{channel} serves generation {c.generation}"
    return False, f"{channel} answers but does not serve (generation {c.generation})"


__all__ = ["LeaseAgent", "probe"]
