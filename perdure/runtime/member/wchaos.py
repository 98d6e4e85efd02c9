"""The worker's side of fault injection: faults that act inside the process.

``kill``, ``hang`` and ``region_down`` are real signals sent by the launcher; ``delay``,
``comm_error``, ``slow_storage`` and ``disk_full`` need the process's cooperation, so the
launcher posts them under ``chaos/<worker>`` (or ``chaos/<region>``) in the store
(``chaos/message.py``) and the heartbeat thread picks them up: a delay holds this worker's
heartbeats and its data-plane sends for ``delay_ms``; a comm error makes its next
collective fail, as a dropped link would; slow storage holds each read of a slot's
samples for ``delay_ms``; a full disk is a file that fills the checkpoint directory's file
system (:class:`DiskFiller`), deleted when its duration ends or the worker exits.

The heartbeat thread must outlive anything it reads: a value it cannot use (not JSON, an
unknown kind, a bad field) is ignored and logged once, never raised. Once told the run's
schedule (:meth:`ChaosState.arm`), the worker polls only the keys an in-process fault of
that schedule can be posted under, and not at all when there is none.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perdure import events as ev
from perdure.chaos import message
from perdure.chaos.faults import in_process_kinds

if TYPE_CHECKING:
    import torch.distributed as dist

    from perdure.chaos.config import ChaosConfig

log = logging.getLogger(__name__)


class ChaosState:
    """In-process faults currently in force for this worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}
        self._rejected: dict[str, bytes] = {}
        self._targets: frozenset[str] | None = None  # None: not armed, poll every key
        self._delay_s = 0.0
        self._delay_until = 0.0
        self._comm_error = False
        self._storage_s = 0.0
        self._storage_until = 0.0
        self._storage_told = False
        self.filler: DiskFiller | None = None
        """Where ``disk_full`` fills (the worker sets it: its checkpoint directory)."""

    def arm(self, schedule: ChaosConfig) -> None:
        """Poll only for the targets of ``schedule``'s in-process faults (none: never)."""
        self._targets = frozenset(f.target for f in schedule.in_process)

    def watches(self, *targets: str) -> bool:
        """Whether a fault can be posted for any of ``targets`` (worth a store connection)."""
        return self._targets is None or any(t in self._targets for t in targets)

    def poll(self, store: dist.Store, name: str, region: str, events: Any) -> None:
        """Apply what the launcher posted for ``name`` or ``region`` since the last poll.
        Store errors are the caller's (its connection); bad values are handled here."""
        for target in (name, region):
            if self._targets is not None and target not in self._targets:
                continue
            key = message.key(target)
            if store.check([key]):
                self._read(key, store.get(key), name, events)

    def _read(self, key: str, raw: bytes, name: str, events: Any) -> None:
        try:
            fault = message.decode(raw, in_process_kinds())
        except message.BadMessage as e:
            self._reject(key, raw, str(e), name, events)
            return
        if fault.seq <= self._seen.get(key, 0):
            return
        self._seen[key] = fault.seq
        self._apply(fault)
        if fault.kind == "slow_storage":
            self._hit(events, name, "slow_storage", delay_ms=fault.delay_ms)
        elif fault.kind == "disk_full" and self.filler is not None:
            filled = self.filler.fill(fault.duration_s)
            self._hit(events, name, "disk_full", path=str(self.filler.path), bytes=filled)

    def _hit(self, events: Any, name: str, kind: str, **fields: Any) -> None:
        try:
            if events is not None:
                events.write({"event": ev.FAULT_HIT, "kind": kind, "worker": name, **fields})
        except OSError as e:  # the log is a courtesy here; the heartbeat must go on
            log.warning("%s: could not log the fault: %s", name, e)

    def tick(self) -> None:
        """Undo what expired (the heartbeat calls it): a full disk's file is deleted."""
        if self.filler is not None:
            self.filler.expire()

    def _reject(self, key: str, raw: bytes, reason: str, name: str, events: Any) -> None:
        """Log a bad value once (it stays in the store and is read on every heartbeat)."""
        if self._rejected.get(key) == raw:
            return
        self._rejected[key] = raw
        log.warning("%s: ignored the value under %s: %s", name, key, reason)
        try:
            if events is not None:
                record = {"event": ev.FAULT_REJECTED, "worker": name, "key": key, "reason": reason}
                events.write(record)
        except OSError as e:  # the log is a courtesy here; the heartbeat must go on
            log.warning("%s: could not log the ignored value: %s", name, e)

    def _apply(self, fault: message.Message) -> None:
        with self._lock:
            if fault.kind == "delay":
                self._delay_s = fault.delay_ms / 1000
                duration = fault.duration_s
                self._delay_until = time.time() + duration if duration else float("inf")
            elif fault.kind == "comm_error":
                self._comm_error = True
            elif fault.kind == "slow_storage":
                self._storage_s = fault.delay_ms / 1000
                duration = fault.duration_s
                self._storage_until = time.time() + duration if duration else float("inf")

    def delay_s(self) -> float:
        with self._lock:
            return self._delay_s if time.time() < self._delay_until else 0.0

    def storage_delay_s(self) -> float:
        """The ``slow_storage`` latency in force now, per read of a slot's samples."""
        with self._lock:
            return self._storage_s if time.time() < self._storage_until else 0.0

    def take_comm_error(self) -> bool:
        with self._lock:
            hit, self._comm_error = self._comm_error, False
            return hit


class DelayedLink:
    """The heartbeats' path with the ``delay`` fault's latency in it: each line goes out
    ``delay_s`` after it was stamped, in order, and later lines keep their rate (a link
    with latency, not a slower sender). Lines whose time came are sent at each call, so
    the granularity is the heartbeat interval."""

    def __init__(self, send: Callable[[Any], object]) -> None:
        self._send = send
        self._queue: deque[tuple[float, Any]] = deque()

    def send(self, beat: Any, delay_s: float, now: float) -> None:
        due = now + delay_s
        if self._queue and self._queue[-1][0] > due:
            due = self._queue[-1][0]  # a link keeps its order when its latency drops
        self._queue.append((due, beat))
        while self._queue and self._queue[0][0] <= now:
            self._send(self._queue.popleft()[1])


class DiskFiller:
    """The ``disk_full`` fault: one file that takes every free byte of the file system
    holding ``directory``, and its removal. ``posix_fallocate`` takes the space at once
    where the file system supports it; otherwise (or for what it left) zeros are written
    until the file system refuses, at most ``cap`` bytes."""

    def __init__(self, directory: Path, name: str, cap: int = 8 << 30) -> None:
        self.path = directory / f".perdure-disk-full-{name}"
        self.cap = cap
        self._until: float | None = None
        self._lock = threading.Lock()

    def fill(self, duration_s: float | None) -> int:
        """Fill now, for ``duration_s`` (None: until :meth:`remove`); the bytes taken."""
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            st = os.statvfs(self.path.parent)
            free = min(st.f_bavail * st.f_frsize, self.cap)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                with contextlib.suppress(OSError):  # not supported, or a little too much
                    os.posix_fallocate(fd, 0, free)
                step = 1 << 20
                while os.fstat(fd).st_size < self.cap:
                    try:
                        os.write(fd, bytes(step))
                    except OSError as e:
                        if e.errno != errno.ENOSPC or step <= 4096:
                            break
                        step //= 4  # take the last blocks too
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            self._until = time.monotonic() + duration_s if duration_s else None
            log.warning("disk_full: %s takes %d bytes", self.path, size)
            return size

    def expire(self) -> None:
        with self._lock:
            due = self._until is not None and time.monotonic() >= self._until
        if due:
            self.remove()

    def remove(self) -> None:
        with self._lock:
            self._until = None
            self.path.unlink(missing_ok=True)
