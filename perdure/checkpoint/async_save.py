"""Async save: the step loop blocks only for the snapshot; the rest runs on a thread.

``save()`` flattens the state, encodes its JSON context (a deep copy, so the caller may
mutate its dicts at once) and starts a background thread that first copies the tensors
into reused buffers, then checksums, writes, fsyncs, commits and prunes. With
``snapshot_overlap`` ``save()`` returns before the copy ends and ``wait_snapshot()``
blocks for the rest, so the copy overlaps the next forward and backward, which read the
parameters but do not write them. At most one save is in flight.

A sharded state passes the tensors this rank does not hold as ``meta`` tensors, with the
ranks that hold them (``holders``): nothing is copied for them, and the writers split the
work so that each writes only what it holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perdure import events as ev
from perdure.checkpoint.config import CheckpointConfig
from perdure.checkpoint.errors import CheckpointSaveError
from perdure.checkpoint.snapshot import SnapshotBuffers, copy_into
from perdure.checkpoint.space import is_no_space, make_room, needed_bytes, space_of
from perdure.checkpoint.state import CheckpointState
from perdure.checkpoint.tensors import flatten
from perdure.checkpoint.writer import Exchange, Prepared, context_of, write_checkpoint

Log = Callable[[dict[str, Any]], None]


@dataclass
class _Job:
    step: int
    snapshot_done: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    snapshot_error: BaseException | None = None
    snapshot_seconds: float = 0.0


class AsyncCheckpointer:
    """Background checkpoint saves for the step loop (see module doc).

    The caller's protocol per step: ``check()``; at a save step ``save(state)``; forward,
    backward; ``wait_snapshot()``; ``optimizer.step()``. With ``world > 1`` every rank
    runs the same protocol with the same steps, and ``exchange`` must match calls by their
    payload's ``round`` (it may be called from the caller's and the background thread).
    """

    def __init__(
        self,
        root: str | Path,
        config: CheckpointConfig,
        *,
        rank: int = 0,
        world: int = 1,
        exchange: Exchange | None = None,
        log: Log | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """``before_commit`` (rank 0) runs just before a save's commit and may refuse it
        by raising (a writer whose coordinator generation was fenced out)."""
        if world > 1 and exchange is None:
            raise ValueError(f"AsyncCheckpointer: world={world} needs an exchange")
        self.root = Path(root)
        self.config = config
        self.rank, self.world, self.exchange = rank, world, exchange
        self._log = log or (lambda _e: None)
        self._before_commit = before_commit
        self._buffers = SnapshotBuffers()
        self._job: _Job | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_step = -1
        self._closed = False
        self.failures = 0
        self._space: dict[str, Any] | None = None
        self._tried: dict[int, int] = {}
        """Consecutive failed saves (the current episode; 0 after a save commits)."""

    def save(
        self, state: CheckpointState, holders: dict[str, tuple[int, ...]] | None = None
    ) -> bool:
        """Start saving ``state``; False when skipped (a save in flight, ``on_busy=skip``).
        ``holders``: see ``writer.save_checkpoint``."""
        if self._closed:
            raise RuntimeError("AsyncCheckpointer.save after close()")
        self.check()
        if self._should_skip(state.step):
            self._log(
                {"event": ev.CHECKPOINT_SKIPPED, "step": state.step, "reason": "save in flight"}
            )
            return False
        if self._busy():
            t0 = time.perf_counter()
            self.wait()
            self._log(
                {
                    "event": ev.CHECKPOINT_BUSY_WAIT,
                    "step": state.step,
                    "seconds": time.perf_counter() - t0,
                }
            )
        tensors, structure = flatten(state.model, state.optimizer)
        context = context_of(state, structure)
        # A meta tensor (a shard this rank does not hold) is passed on as it is, not copied.
        bufs = {k: t if t.is_meta else self._buffers.buffer_for(k, t) for k, t in tensors.items()}
        pairs = [(t, bufs[k]) for k, t in tensors.items() if not t.is_meta]
        self._buffers.keep_only({k for k, t in tensors.items() if not t.is_meta})
        job = _Job(int(state.step))
        prep = Prepared(job.step, bufs, context, dict(holders or {}))
        self._job = job
        if not self.config.snapshot_overlap:
            # Copy on the caller's thread (its intra-op pool), then hand off the rest.
            t0 = time.perf_counter()
            copy_into(pairs)
            job.snapshot_seconds = time.perf_counter() - t0
            job.snapshot_done.set()
            pairs = []
        self._thread = threading.Thread(
            target=self._run, args=(job, pairs, prep), name=f"perdure-ckpt-{job.step}", daemon=True
        )
        self._thread.start()
        return True

    def _busy(self) -> bool:
        return self._job is not None and not self._job.done.is_set()

    def _should_skip(self, step: int) -> bool:
        if self.config.on_busy != "skip":
            return False
        busy = self._busy()
        if self.world > 1:
            assert self.exchange is not None
            votes = self.exchange({"round": f"step-{step}/busy", "rank": self.rank, "busy": busy})
            return any(v["busy"] for v in votes)
        return busy

    def _run(self, job: _Job, pairs: list, prep: Prepared) -> None:
        t0 = time.perf_counter()
        try:
            if not job.snapshot_done.is_set():
                try:
                    copy_into(pairs)
                except BaseException as e:
                    job.snapshot_error = e
                    raise
                finally:
                    job.snapshot_seconds = time.perf_counter() - t0
                    job.snapshot_done.set()
            retention = self.config if self.rank == 0 else None
            path = write_checkpoint(
                self.root,
                prep,
                rank=self.rank,
                world=self.world,
                exchange=self.exchange,
                retention=retention,
                before_commit=self._before_commit,
                after_failure=lambda errors: self._make_room(prep, errors),
                attempt=self._attempt(job.step),
            )
            self._log(
                {
                    "event": ev.CHECKPOINT_SAVED,
                    "step": job.step,
                    "path": str(path),
                    "seconds": time.perf_counter() - t0,
                    "snapshot_seconds": job.snapshot_seconds,
                    "bytes": _tensor_bytes(prep),
                    **self._recovered(),
                }
            )
        except BaseException as e:
            self._error, self._error_step = e, job.step
            self._failed(job.step, prep, e)
        finally:
            job.done.set()

    def _attempt(self, step: int) -> int:
        """Saves of ``step`` tried before by this saver (the final one is retried)."""
        n = self._tried.get(step, 0)
        self._tried = {step: n + 1}
        return n

    def _make_room(self, prep: Prepared, errors: str) -> None:
        """Rank 0, inside a failed save: on a full file system, note its numbers and make
        room for the next due save (``space.make_room``), before any rank retries."""
        if not is_no_space(RuntimeError(errors)):
            return
        try:
            space = space_of(self.root)
            needed = needed_bytes(_tensor_bytes(prep))
            record: dict[str, Any] = {**space.to_dict(), "needed_bytes": needed}
            record["pruned"] = [p.name for p in make_room(self.root, needed)]
            record["free_bytes_after"] = space_of(self.root).free_bytes
        except Exception as why:  # the episode is logged even if no room is made
            record = {"make_room_error": f"{type(why).__name__}: {why}"}
        self._space = record

    def _failed(self, step: int, prep: Prepared, e: BaseException) -> None:
        """The event, once per episode of consecutive failures: on a full file system with
        the file system, its free bytes, the bytes the save needed and what was pruned."""
        record: dict[str, Any] = {"event": ev.CHECKPOINT_FAILED, "step": step,
                                  "error": f"{type(e).__name__}: {e}"}  # fmt: skip
        space, self._space = self._space, None
        if space is not None:
            record.update(space)
            if "file_system" in space:
                record["error"] = (
                    f"the file system of {space['file_system']} is full: " + (record["error"])
                )
        self.failures += 1
        if self.failures == 1:
            self._log(record)

    def _recovered(self) -> dict[str, Any]:
        """The end of a failure episode, as fields of the ``checkpoint_saved`` event."""
        n, self.failures = self.failures, 0
        return {"after_failures": n} if n else {}

    def wait_snapshot(self) -> None:
        """Block until the in-flight save's copy is complete: after this the caller may
        mutate the state. Raises if the copy failed."""
        job = self._job
        if job is None:
            return
        job.snapshot_done.wait()
        if job.snapshot_error is not None:
            raise CheckpointSaveError(
                f"snapshot of step {job.step} failed: {job.snapshot_error}"
            ) from job.snapshot_error

    def check(self) -> None:
        """Raise a background save's error (once); the step loop calls this every step."""
        if self._error is not None:
            e, self._error = self._error, None
            raise CheckpointSaveError(
                f"background save of step {self._error_step} to {self.root} failed: {e}"
            ) from e

    def wait(self) -> None:
        """Wait for the in-flight save to finish; raise its error."""
        self.wait_for_save()
        self.check()

    def wait_for_save(self) -> None:
        """Wait for the in-flight save to finish, leaving any error for :meth:`check`."""
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Wait for the in-flight save, release the buffers; raise a pending error."""
        self._closed = True
        try:
            self.wait()
        finally:
            self._buffers = SnapshotBuffers()


def _tensor_bytes(prep: Prepared) -> int:
    """The whole state's tensor bytes (every rank's part, held here or not)."""
    return sum(t.numel() * t.element_size() for t in prep.tensors.values())
