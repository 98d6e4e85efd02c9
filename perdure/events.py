"""The run's event log: every event name, and the JSON-lines files that hold them.

One module owns the names: the processes that write events (coordinator, workers,
launcher, chaos, checkpointer) and those that read them (summary, report, live view,
tests) import the constants below, so a renamed or mistyped event fails at import or at
the first write instead of silently matching nothing.

Each record is written with one ``write`` on a file opened in append mode, so lines from
several processes on one machine interleave whole. Every record carries ``t``, wall-clock
seconds since the epoch, so that a reader can order them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Final

log = logging.getLogger("perdure.events")

# -- run ---------------------------------------------------------------------------------
RUN_START: Final = "run_start"
"""The launcher began a run (or a resume) in this directory."""
COORDINATOR_UP: Final = "coordinator_up"
"""A coordinator listens (its channel port)."""
COORDINATOR_TAKEOVER: Final = "coordinator_takeover"
"""A standby coordinator took over from workers' soft state: the primary's lease expired and
its probe found no serving primary (the new generation, the previous one, the probe)."""
COORDINATOR_FENCED: Final = "coordinator_fenced"
"""A coordinator saw a newer generation (in the lease store or a worker's hello) and
stopped: its last record (its generation, the newer one, where it saw it)."""
LEASE_LAPSED: Final = "lease_lapsed"
"""A coordinator's lease ran out before it renewed it: it dropped its workers and
coordinates nothing until it renews."""
LEASE_REGAINED: Final = "lease_regained"
"""A coordinator whose lease had lapsed renewed it under the same generation."""
LEASE_UNAVAILABLE: Final = "lease_unavailable"
"""The lease store did not answer (first failure of a streak; the error)."""
WORKER_FENCED: Final = "worker_fenced"
"""A worker found the run directory's fence above its generation: it left its epoch and
looks for the newer coordinator."""
ZYGOTE_UNAVAILABLE: Final = "zygote_unavailable"
"""The fork server was not ready; workers start as new processes."""
WORKER_DONE: Final = "worker_done"
"""A member finished the last step (its final hash)."""
RUN_END: Final = "run_end"
"""Every member is done; exits from here on are shutdown."""
RUN_DRAINING: Final = "run_draining"
"""A stop was asked for (a signal): members finish at a step boundary and checkpoint."""
RUN_FAILED: Final = "run_failed"
"""The run cannot go on (an error that every replica reproduces, e.g. in the math)."""

# -- membership --------------------------------------------------------------------------
JOIN: Final = "join"
"""A worker was admitted to the control channel."""
REFUSED: Final = "refused"
"""Admission refused (bad token, duplicate name, run over, bad message)."""
LEAVE: Final = "leave"
"""A worker left the run: dead, evicted or disconnected (with the reason)."""
LEAVE_REQUESTED: Final = "leave_requested"
"""A worker asked to leave at the next step boundary (SIGTERM)."""
LEFT: Final = "left"
"""A worker that asked to leave is out of the membership and exits."""
RECONNECT: Final = "reconnect"
"""A worker lost its coordinator and reconnects (to it or a standby)."""
BECAME_SPARE: Final = "became_spare"
"""An admitted worker past the configured count waits as a warm spare."""
SPARE_PROMOTED: Final = "spare_promoted"
"""A warm spare replaces a lost member in the next epoch."""
MEMBER_BENCHED: Final = "member_benched"
"""A member whose link lags (``lag_s`` over the others') leaves the collective, not the run."""
MEMBER_UNBENCHED: Final = "member_unbenched"
"""A benched member's link is back to speed: it is planned in again."""
EPOCH_ANNOUNCED: Final = "epoch_announced"
"""Phase 1 of a membership epoch: members and the step boundary."""
READY_TIMEOUT: Final = "ready_timeout"
"""A member did not report ready in time; re-announced without it."""
EPOCH_STARTED: Final = "epoch_started"
"""Phase 3: the plan, start step, state source and receivers."""
RECOVERED_FROM_CHECKPOINT: Final = "recovered_from_checkpoint"
"""Every replica was lost: the epoch starts from a checkpoint."""

# -- step --------------------------------------------------------------------------------
STATE_RECEIVED: Final = "state_received"
"""A receiver adopted a live peer's state: in epoch ``epoch``, ``mode`` "blocking" (every
member waited at the epoch's start) or "overlapped" (the holders computed step
``overlapped_step`` while it copied, and it took part in that step's reduction with no
slot; ``runtime/member/copy_overlap.py``; null in a blocking copy)."""
STATE_SENT: Final = "state_sent"
"""A holder served its part of a state copy (``bytes`` in ``ranges``, to the receivers
``to``), ``mode`` and ``overlapped_step`` as in ``state_received``."""
SHARD_RECEIVED: Final = "shard_received"
"""A member of a replica group received its shard of the optimizer state from another
member at an epoch's start (``train.shard_degree`` > 1), with its parameters when they
are sharded at rest (``train.shard_params``)."""
PARAMS_AT_REST: Final = "params_at_rest"
"""Parameters sharded at rest (``train.shard_params``): what a member keeps resident
between slots in this epoch (``bytes``), the whole replica's (``of``), and the most it has
held at once outside a slot's gathers since it was built (``init_peak_bytes``: the whole
replica where the model is built eagerly; about one shard with ``task.init =
"per_module"`` or a checkpoint loaded by shard), and, loaded from a checkpoint, the tensor
bytes it read from it (``ckpt_read_bytes``: its shard's byte ranges, the buffers, and any
shard it sent meanwhile; null when it loaded none)."""
SHARD_REDUCE: Final = "shard_reduce"
"""How a replica group's member gets the step's gradient in an epoch (``train.shard_degree``
> 1): ``mode`` ``scatter`` (its shard's value ``range`` of the slot buffer, reduce-
scattered) or ``whole`` (all-reduced whole; ``why``, where a scatter was wanted)."""
PARAMS_PEAK: Final = "params_peak"
"""Parameters sharded at rest, at an epoch's end: the most parameter bytes a member held
at once in it (``peak_bytes``: resident parameters plus a gather's temporary), the whole
replica's (``of``) and the broadcasts it took part in (``gathers``)."""
STEP_ABANDONED: Final = "step_abandoned"
"""A member left a step because the membership epoch changed."""
SLOTS_SALVAGED: Final = "slots_salvaged"
"""A member reused slots it finished in an abandoned attempt of the same step."""
OUTER_UNDONE: Final = "outer_undone"
"""``outer.delay = 1``: the reduction of an outer step (``step``) that a member had already
applied the update of was lost when its epoch ended (``why``); the member undid the update
and redoes the step in the next epoch, keeping its own replicas of it."""
EXPONENTS_REFIT: Final = "exponents_refit"
"""A step's carried exponents (``train.reduction_exponents = "carried"``) did not fit its
gradients: every member computed the step again against the step's true exponents."""
LOSS_SCALE: Final = "loss_scale"
"""The loss scale changed (``train.precision = "fp16"``, ``runtime/replica/loss_scale.py``):
``step``, ``old`` and ``new`` scale, ``reason`` (``overflow``: the ``slots`` whose gradient
overflowed float16, the step computed again at ``new``; ``growth``: after
``train.loss_scale_growth_interval`` clean steps, ``new`` from step ``step + 1`` on).
Logged by rank 0 when the step commits."""
COLLECTIVE_FAILED: Final = "collective_failed"
"""A member's collective failed (peer closed, timeout, link drop)."""
REPLICA_DIVERGED: Final = "replica_diverged"
"""Replica fingerprints disagreed; the odd ones receive state."""
SUSPECT_WORKER: Final = "suspect_worker"
"""A non-finite slot did not reproduce elsewhere: the worker is suspect."""
DECISION: Final = "decision"
"""A decision-log entry (e.g. a quarantine): changes the math, replayed on resume. Its
``parts`` are the dataset parts it quarantines (read them with :func:`decision_parts`)."""
PART_REPAIRED: Final = "part_repaired"
"""A dataset part failed a read (checksum, error, missing) and was served anyway with
the manifest's bytes: read again (``via``: ``reread``) or fetched from a mirror (``via``:
its URL); ``part`` is its index, ``manifest`` and ``found`` are both SHA-256s (``found``
None when unreadable). Runs before the rename wrote ``shard_repaired`` with ``shard``."""

# -- process -----------------------------------------------------------------------------
PROCESS_EXIT: Final = "process_exit"
"""The launcher saw a worker process exit with a non-zero code."""
REPLACEMENT_STARTED: Final = "replacement_started"
"""The launcher started a replacement for a lost worker."""
PROCESS_PLACED: Final = "process_placed"
"""A cluster launcher's process started on a node (Ray: the node, its address, the pid)."""

# -- chaos -------------------------------------------------------------------------------
FAULT_INJECTED: Final = "fault_injected"
"""The chaos schedule injected a fault."""
FAULT_HIT: Final = "fault_hit"
"""A worker's in-process fault hook fired (e.g. comm_error)."""
FAULT_ENDED: Final = "fault_ended"
"""A timed fault was undone (SIGCONT, delay over, region back)."""
FAULT_REJECTED: Final = "fault_rejected"
"""A worker ignored a value under its chaos key that is no fault it can apply (the reason)."""

# -- checkpoint --------------------------------------------------------------------------
CHECKPOINT_SAVED: Final = "checkpoint_saved"
"""A checkpoint was committed (manifest written)."""
CHECKPOINT_SKIPPED: Final = "checkpoint_skipped"
"""A checkpoint step was skipped (the previous save still running)."""
CHECKPOINT_FAILED: Final = "checkpoint_failed"
"""A checkpoint save failed; the previous ones are kept."""
CHECKPOINT_BUSY_WAIT: Final = "checkpoint_busy_wait"
"""A step waited for the previous save's snapshot."""
CHECKPOINT_ABANDONED: Final = "checkpoint_abandoned"
"""A save was cut short by a membership change."""

NAMES: frozenset[str] = frozenset(
    {
        RUN_START,
        COORDINATOR_UP,
        COORDINATOR_TAKEOVER,
        COORDINATOR_FENCED,
        LEASE_LAPSED,
        LEASE_REGAINED,
        LEASE_UNAVAILABLE,
        WORKER_FENCED,
        ZYGOTE_UNAVAILABLE,
        WORKER_DONE,
        RUN_END,
        RUN_DRAINING,
        RUN_FAILED,
        JOIN,
        REFUSED,
        LEAVE,
        LEAVE_REQUESTED,
        LEFT,
        RECONNECT,
        BECAME_SPARE,
        SPARE_PROMOTED,
        MEMBER_BENCHED,
        MEMBER_UNBENCHED,
        EPOCH_ANNOUNCED,
        READY_TIMEOUT,
        EPOCH_STARTED,
        RECOVERED_FROM_CHECKPOINT,
        STATE_RECEIVED,
        STATE_SENT,
        SHARD_RECEIVED,
        PARAMS_AT_REST,
        SHARD_REDUCE,
        PARAMS_PEAK,
        STEP_ABANDONED,
        SLOTS_SALVAGED,
        OUTER_UNDONE,
        EXPONENTS_REFIT,
        LOSS_SCALE,
        COLLECTIVE_FAILED,
        REPLICA_DIVERGED,
        SUSPECT_WORKER,
        DECISION,
        PART_REPAIRED,
        PROCESS_EXIT,
        REPLACEMENT_STARTED,
        PROCESS_PLACED,
        FAULT_INJECTED,
        FAULT_HIT,
        FAULT_ENDED,
        FAULT_REJECTED,
        CHECKPOINT_SAVED,
        CHECKPOINT_SKIPPED,
        CHECKPOINT_FAILED,
        CHECKPOINT_BUSY_WAIT,
        CHECKPOINT_ABANDONED,
    }
)
"""Every event name; the writer refuses any other (a typo is a bug, not a new event)."""


class JsonLines:
    """One append-only JSON-lines file.

    The log is a record of the run, not a condition of it: a write that fails (disk full,
    file system gone) drops that record and says so once per cause on stderr, instead of
    killing the process that was training. A write cut short leaves a torn line, which
    the writer tries to end with a newline and every reader skips.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.dropped = 0
        self._warned: set[int] = set()

    def write(self, record: dict[str, Any]) -> None:
        assert record.get("event", RUN_START) in NAMES, record.get("event")
        line = json.dumps({"t": round(time.time(), 6), **record}, separators=(",", ":")) + "\n"
        data = line.encode()
        with self._lock:
            try:
                self._append(data)
            except OSError as e:
                self._dropped(e)

    def _append(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, data)
            if written < len(data):
                with contextlib.suppress(OSError):
                    os.write(fd, b"\n")  # end the torn line: readers skip it
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes")
        finally:
            os.close(fd)

    def _dropped(self, e: OSError) -> None:
        self.dropped += 1
        if e.errno not in self._warned:
            self._warned.add(e.errno or 0)
            log.warning("%s: %s; records of this log are dropped", self.path, e.strerror or e)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a JSON-lines file (torn lines are skipped)."""
    p = Path(path)
    if not p.exists():
        return []
    return [r for line in p.read_bytes().splitlines() if (r := _record(line)) is not None]


class Tail:
    """The complete lines appended to a JSON-lines file since the last call (a torn last
    line waits for the next call). Readers that poll a live run use it, so each byte of
    the log is read once. ``from_end``: skip what the file already holds (a run resumed
    in its own directory must not act on the previous run's lines)."""

    def __init__(self, path: str | Path, *, from_end: bool = False) -> None:
        self.path, self.pos = Path(path), 0
        if from_end and self.path.exists():
            self.pos = self.path.stat().st_size

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.pos += end
        return [r for line in data[:end].splitlines() if (r := _record(line)) is not None]


def _record(line: bytes) -> dict[str, Any] | None:
    """One line's record; None for a blank or torn line (a write cut short)."""
    try:
        record = json.loads(line) if line.strip() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def decision_parts(entry: dict[str, Any]) -> list[int]:
    """The dataset parts a decision-log entry quarantines: ``parts``, or ``shards`` in an
    entry written before parts were called parts (an old run's events or checkpoint)."""
    return list(entry.get("parts", entry.get("shards", [])))


def renamed_decision(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` as it is written now (``shards`` read as ``parts``)."""
    if "shards" not in entry or "parts" in entry:
        return entry
    out = {k: v for k, v in entry.items() if k != "shards"}
    out["parts"] = entry["shards"]
    return out
