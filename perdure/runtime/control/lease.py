"""The run's coordinator lease: who may coordinate, and under which generation.

One lease per run, held by at most one coordinator at a time and renewed while it
coordinates. Each acquisition raises the run's *generation* (the fencing token): the new
holder installs it in the run directory's fence (``control/fence.py``) before it admits a
worker, announces it in every welcome, epoch and start, and every writer of the run
directory checks it. Two backends, one interface (:class:`LeaseStore`):

- ``embedded`` (:class:`FileLease`, the default): a record in ``RUN_DIR/control/lease.json``,
  changed only under an ``flock`` of ``lease.lock`` (compare-and-swap on the generation
  and the renewal counter), replaced whole by an atomic swap with a spare allocated when
  the lease is first taken (``reserved.py``): a renewal needs no free space, so a disk
  filled by checkpoints does not stop the control plane. No clock is shared: a holder renews
  by bumping a counter, and an observer calls the lease expired once the counter has not
  moved for a whole TTL *on its own monotonic clock*. Sound on one host, and across hosts
  whose run directory is a file system with working ``flock`` and atomic rename (NFSv4:
  byte-range locks with server leases; close-to-open consistency).
- ``etcd`` (``control/etcd.py``): a key attached to an etcd lease, taken by a transaction
  that requires it absent; etcd itself expires it. For a coordinator that must outlive a
  region: etcd's quorum decides, not one file server.

The holder's own view of its lease is local and conservative: a grant is valid until
``t0 + SAFETY * ttl`` where ``t0`` is when the renewal was *sent*, so it ends before any
observer can see the lease expire (an observer waits a full TTL from when it saw the last
renewal land, which is after ``t0``); ``SAFETY`` covers monotonic clocks that run at
different rates.

The decisions (when to renew, when a standby may take over) are the policy's
(``policy.py``); this module only does the I/O, each call bounded in time.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from perdure.runtime.control.fence import (
    current_generation,
    install_fence,
    lock_file,
)
from perdure.runtime.control.reserved import ReservedRecord

SAFETY = 0.9
"""A holder's grant is valid for this fraction of the TTL after its renewal was sent."""

LEASE = "control/lease.json"
LEASE_LOCK = "control/lease.lock"


class LeaseStoreError(RuntimeError):
    """The lease store could not be read or changed (unreachable, timed out, bad record)."""


class LeaseHeld(RuntimeError):
    """A coordinator starting as primary found the run's lease live in another's hands."""


@dataclass(frozen=True)
class LeaseView:
    """What a read of the lease store showed."""

    generation: int = 0
    """The newest generation ever granted (0: none yet)."""
    version: int = 0
    """Changes with every renewal (file) or acquisition (etcd): what an observer compares."""
    state: str = "none"
    """``none`` (never held), ``held``, or ``ended`` (the run finished under ``generation``)."""
    live: bool = False
    """Held, and renewed within the TTL as far as this observer can tell."""
    holder: dict[str, Any] = field(default_factory=dict)
    """The holder's record: instance, pid, host, channel (``HOST:PORT``)."""


@dataclass(frozen=True)
class Granted:
    """The lease is this coordinator's, as generation ``generation``, until ``until``
    (local monotonic seconds)."""

    generation: int
    until: float


@dataclass(frozen=True)
class Lost:
    """The store moved on: another holder, or a newer generation (``view``)."""

    view: LeaseView


class LeaseStore(Protocol):
    """One run's lease in one backend. Every call returns or raises within its timeout."""

    ttl_s: float

    def observe(self) -> LeaseView: ...

    def acquire(self, expect: LeaseView, floor: int, holder: dict[str, Any]) -> Granted | Lost:
        """Take the lease if the store still shows ``expect`` (not live) with generation
        ``max(expect.generation, floor) + 1``."""
        ...

    def renew(self, generation: int) -> Granted | Lost:
        """Extend the lease of ``generation`` (also after it lapsed, if nobody took it)."""
        ...

    def end(self, generation: int) -> None:
        """Mark the run ended under ``generation`` and let the lease go."""
        ...

    def close(self) -> None: ...


def acquire_for_primary(
    store: LeaseStore,
    run_dir: str | Path,
    holder: dict[str, Any],
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Granted:
    """A primary's first acquisition: at once when the lease was never held or the run
    ended; after it expires when a previous coordinator left it held (a crash); never
    while another coordinator keeps renewing it (:class:`LeaseHeld`, naming the holder).
    The new generation is above both the store's and the run directory's fence, and the
    fence is raised to it before this returns."""
    end = clock() + 2 * store.ttl_s + 1.0
    view = store.observe()
    while True:
        if not view.live:
            got = store.acquire(view, current_generation(run_dir), holder)
            if isinstance(got, Granted):
                install_fence(run_dir, got.generation, holder)
                return got
            view = got.view
            continue
        if clock() > end:
            raise LeaseHeld(
                f"the run's lease is held by a live coordinator (generation {view.generation}, "
                f"{_who(view.holder)}); stop it, or wait for its lease to expire"
            )
        sleep(store.ttl_s / 4)
        view = store.observe()


def _who(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}, channel {holder.get('channel')}"


class FileLease:
    """The embedded backend: the lease as a file in the run directory (see module doc)."""

    def __init__(
        self,
        run_dir: str | Path,
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(run_dir) / LEASE
        self.lock = Path(run_dir) / LEASE_LOCK
        self._record = ReservedRecord(self.path)
        self.ttl_s = ttl_s
        self.clock = clock
        self._seen: tuple[int, int, str] | None = None
        self._seen_at = 0.0

    def observe(self) -> LeaseView:
        rec = self._read()
        key = (int(rec.get("generation", 0)), int(rec.get("version", 0)), str(rec["state"]))
        now = self.clock()
        if key != self._seen:
            # A change seen now may have landed just before: count the TTL from now.
            self._seen, self._seen_at = key, now
        live = key[2] == "held" and now - self._seen_at < self.ttl_s
        return LeaseView(key[0], key[1], key[2], live, dict(rec.get("holder", {})))

    def acquire(self, expect: LeaseView, floor: int, holder: dict[str, Any]) -> Granted | Lost:
        t0 = self.clock()
        with self._locked():
            rec = self._read()
            now = _view(rec)
            if (now.generation, now.version, now.state) != (
                expect.generation,
                expect.version,
                expect.state,
            ):
                return Lost(self._fresh(now))
            generation = max(expect.generation, floor) + 1
            self._write({"generation": generation, "version": 0, "state": "held", "holder": holder})
        return Granted(generation, t0 + SAFETY * self.ttl_s)

    def renew(self, generation: int) -> Granted | Lost:
        t0 = self.clock()
        with self._locked():
            rec = self._read()
            now = _view(rec)
            if now.generation != generation or now.state != "held":
                return Lost(self._fresh(now))
            self._write({**rec, "version": now.version + 1})
        return Granted(generation, t0 + SAFETY * self.ttl_s)

    def end(self, generation: int) -> None:
        with self._locked():
            rec = self._read()
            if int(rec.get("generation", 0)) == generation:
                self._write({**rec, "state": "ended"})

    def close(self) -> None:
        pass

    # -- file ------------------------------------------------------------------------------

    def _fresh(self, view: LeaseView) -> LeaseView:
        """A view read under the lock: live unless ended (it was just read)."""
        return LeaseView(
            view.generation, view.version, view.state, view.state == "held", view.holder
        )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            with lock_file(self.lock, max(0.5, self.ttl_s / 4)):
                yield
        except OSError as e:
            raise LeaseStoreError(f"{self.lock}: {e}") from e

    def _read(self) -> dict[str, Any]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {"state": "none"}
        except OSError as e:
            raise LeaseStoreError(f"{self.path}: {e}") from e
        try:
            rec = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            rec = None
        ok = (
            isinstance(rec, dict)
            and isinstance(rec.get("generation"), int)
            and isinstance(rec.get("version"), int)
            and rec.get("state") in ("held", "ended")
        )
        if not ok:
            raise LeaseStoreError(f"{self.path}: not a lease record")
        assert isinstance(rec, dict)
        return rec

    def _write(self, rec: dict[str, Any]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._record.write(json.dumps(rec, separators=(",", ":")).encode() + b"\n")
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise LeaseStoreError(
                    f"the file system of {self.path.parent} is full ({self.path}: {e})"
                ) from e
            raise LeaseStoreError(f"{self.path}: {e}") from e


def _view(rec: dict[str, Any]) -> LeaseView:
    return LeaseView(
        int(rec.get("generation", 0)),
        int(rec.get("version", 0)),
        str(rec["state"]),
        False,
        dict(rec.get("holder", {})),
    )


def holder_record(instance: str, channel: str, role: str) -> dict[str, Any]:
    """Who holds (or asks for) the lease: shown in errors and probed by a standby."""
    return {
        "instance": instance,
        "role": role,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "channel": channel,
    }


__all__ = [
    "SAFETY",
    "FileLease",
    "Granted",
    "LeaseHeld",
    "LeaseStore",
    "LeaseStoreError",
    "LeaseView",
    "Lost",
    "acquire_for_primary",
    "holder_record",
]
