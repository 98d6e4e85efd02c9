"""A run's logs on shared storage: one part file per process, merged by the coordinator.

``events.jsonl`` and ``metrics.jsonl`` used to be appended to by every process of a run
with ``O_APPEND``, which interleaves whole lines on one machine's file system but not on
a network file system: NFS emulates ``O_APPEND`` on the client (it writes at the size it
last saw), so two hosts appending at once overwrite each other's lines. Here no file has
two writers:

- every process writes its own part file, ``RUN_DIR/<log>.d/<writer>.jsonl`` (the writer
  id holds the process name, host and pid, so a replacement never shares its
  predecessor's file);
- the active coordinator (the primary, or the standby once it took over) merges the
  parts' complete lines into ``RUN_DIR/<log>.jsonl`` every ``MERGE_S``, in the order of
  their ``t``, and once more when it stops; the local launcher merges a last time after
  every process has stopped. Every reader (summary, report, live view, tests) keeps
  reading the merged file, up to ``MERGE_S`` behind the writers.

A merge is crash-safe: ``<log>.d/merged.json`` records, after each append, the merged
file's size and how far into each part it has read; a new merger (a standby taking
over) first cuts the merged file back to the recorded size (an append the old merger
did not finish recording), then goes on from the recorded offsets, so no line is lost or
written twice. Limits: lines are ordered by their writers' clocks within a merge (as good
as the hosts' time sync), and a line stamped just before a merge but written just after
it (its writer preempted in between) lands in the next one, slightly out of order, as it
would have landed late in one shared file; each writer's own lines keep their order. A
record written after the final merge (a worker's last line after the
coordinator exited, on a deployment without the local launcher) stays in its part file
only.

Two coordinators alive at once (a primary cut off from its run, or hung, while a standby
took over) must not write over each other's appends. Each generation keeps its own record
(``merged.g<N>.json``; a merger reads the newest), and a merger that claims a generation
writes its record first, then *rebases* the merged file: copies its recorded bytes into a
fresh file and renames it over the old one. An older merger checks for a newer record
after it opens the merged file and before it writes, so it either sees the claim and
stands down for good, or opened the old file, which the rename has taken out of the run
(its late append lands in no file a reader sees). So the newer merger never waits for the
older: a primary SIGSTOPped inside its merge holds the advisory lock (``merge.lock``:
mergers of one generation, and the launcher's last merge, take turns on it) until it
wakes, and the standby's merger merges without it after ``LOCK_S``. A merger that claims
nothing (the launcher's, a tool's) that cannot have the lock in ``LOCK_S`` skips its merge
(the parts keep every line). Limits: a reader holding the merged file open across a
takeover keeps reading the old file (readers here reopen it by name); a new launch
(another lease store, whose generations start again at 1) removes the earlier launches'
records once its own is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from perdure.events import JsonLines

LOGS = ("events", "metrics")
MERGE_S = 0.05
"""How often the active coordinator merges the part files."""
STATE = "merged.json"
"""The record of a merger that claims no generation; a generation's is ``merged.g<N>.json``."""
LOCK_S = 1.0
"""How long a merger waits for the advisory lock before it merges without it (a merger
that claimed its generation) or skips this merge (one that claims nothing)."""
OWNER_LOCK_S = 0.05
"""The same for a merger that owns its generation, which needs the lock only against a
merger that claims nothing (and merges every ``MERGE_S``: it must not wait a second each
time an older generation's stopped merger holds the lock)."""
_STATE_NAME = re.compile(r"merged(?:\.g([0-9]{1,18}))?\.json")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def writer_id(name: str) -> str:
    """A part file name no other process of the run uses: name, host, pid, a nonce."""
    host = _UNSAFE.sub("_", socket.gethostname())[:32]
    return f"{_UNSAFE.sub('_', name)[:64]}.{host}.{os.getpid()}.{secrets.token_hex(2)}"


def part(run_dir: str | Path, log: str, writer: str) -> JsonLines:
    """The part file that process ``writer`` writes its records of ``log`` to."""
    assert log in LOGS, log
    return JsonLines(Path(run_dir) / f"{log}.d" / f"{writer}.jsonl")


class Merger:
    """Merges the part files of one log into the merged file; one merger at a time.

    ``metrics`` has a line per committed step, written by *every* member that committed
    it (so a step is logged whoever of them survives: rank 0 alone lost a step's line
    when it abandoned a step the others committed, its coordinator lost mid-step). The
    merger keeps the first line of each step and drops the rest: ``last_step``, the
    highest step merged in this launch, is in its crash-safe record, so a standby that
    takes over goes on with it, and a new launch (``new_launch``: the primary of a run
    resumed in its own directory, which logs its steps again) starts it afresh. A step
    redone within a launch (a rollback to a checkpoint) computes the same bits and keeps
    its first line. Limit: a step's line counts as a duplicate if a later step's line
    was stamped before it by every writer's clock, which clock skew between hosts larger
    than a step could cause only if no member that committed both wrote them in order.
    """

    def __init__(
        self,
        run_dir: str | Path,
        log: str,
        *,
        new_launch: bool = False,
        generation: int | None = None,
    ) -> None:
        """``generation``: the merging coordinator's; it claims the log (recorded in the
        state), and a merger of an older generation that finds it there stands down for
        good (a primary cut off from its run, still merging while a standby took over,
        must not write over the newer merger's lines). None: a last merge (the launcher's,
        a tool's), which claims nothing."""
        assert log in LOGS, log
        self.merged = Path(run_dir) / f"{log}.jsonl"
        self.parts = Path(run_dir) / f"{log}.d"
        self.offsets: dict[str, int] = {}
        self.size = 0
        self.per_step = log == "metrics"
        self.last_step = -1
        self.generation = generation
        self.claimed: int | None = None
        """The newest generation recorded in the state."""
        self.stood_down = False
        self.owns = False
        """Whether this merger claimed its generation and rebased the merged file: it may
        then merge without the lock (module docstring)."""
        self.ready = False
        """Whether it has recovered (a merger that claims nothing and could not have the
        lock recovers at its first merge that has it)."""
        with self._lock() as locked:
            # a new launch starts the count again (its lease store may be new); a standby
            # claims over an older generation
            self._recover(truncate=locked)
            newer = new_launch or (generation is not None and generation > (self.claimed or 0))
            claim = generation is not None and newer
            if claim:
                self.claimed = generation
            if new_launch and self.last_step >= 0:
                self.last_step = -1
            if claim or new_launch:  # a standby taking over from this launch must not see
                self._save()  # the old one's steps
            if new_launch:
                self._forget_other_records()
            if claim:
                self._rebase()
                self.owns = True
            self.ready = locked or self.owns

    def _recover(self, truncate: bool = True) -> None:
        """Pick up where the newest record says its merger stopped."""
        state = newest_record(self.parts)
        try:
            assert state is not None
            self.size = int(state["size"])
            self.offsets = {str(k): int(v) for k, v in state["offsets"].items()}
            self.last_step = int(state.get("last_step", -1))
            self.claimed = _generation(state)
        except (AssertionError, ValueError, KeyError, TypeError, AttributeError):
            self.size = self.merged.stat().st_size if self.merged.exists() else 0
            self.offsets = {}
            return
        if truncate and self.merged.exists() and self.merged.stat().st_size > self.size:
            with open(self.merged, "r+b") as f:  # an append its merger did not record
                f.truncate(self.size)

    def _rebase(self) -> None:
        """The merged file as a fresh file of its recorded bytes, renamed over the old one
        (module docstring: what fences an older merger's late append)."""
        if not self.merged.exists():
            return
        tmp = self.merged.with_name(f"{self.merged.name}.{os.getpid()}.tmp")
        try:
            with open(self.merged, "rb") as src, open(tmp, "wb") as dst:
                left = self.size
                while left > 0:
                    chunk = src.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    dst.write(chunk)
                    left -= len(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            self.size -= left  # a merged file shorter than its record: what it holds
            os.replace(tmp, self.merged)
        except OSError:  # a full disk: the old file stays, older mergers stand down by the record
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _forget_other_records(self) -> None:
        """A new launch's record is the only one: an earlier launch's generations (its
        lease store's count) must not supersede it."""
        own = self.parts / _state_name(self.claimed)
        for _, path in _records(self.parts):
            if path != own:
                with contextlib.suppress(OSError):
                    path.unlink()

    def merge(self, final: bool = False) -> int:
        """Append the parts' new complete lines (those stamped before now, or all of
        them when ``final``) in ``t`` order; returns how many were appended."""
        if self.stood_down:
            return 0
        if not self.ready:  # claims nothing, found the lock held at its start
            with self._lock() as locked:
                if not locked:
                    return 0  # the parts keep the lines
                self._recover()
                self.ready = True
        cutoff = float("inf") if final else time.time()
        batch: list[tuple[float, str, bytes]] = []
        reached: dict[str, int] = {}
        for path in sorted(self.parts.glob("*.jsonl")) if self.parts.is_dir() else []:
            lines, end = _new_lines(path, self.offsets.get(path.name, 0), cutoff)
            if end != self.offsets.get(path.name, 0):
                reached[path.name] = end
            batch += [(t, path.name, line) for t, line in lines]
        if not reached:
            return 0
        batch.sort(key=lambda x: (x[0], x[1]))
        kept, last_step = self._first_per_step([line for _, _, line in batch])
        data = b"".join(line + b"\n" for line in kept)
        with self._lock() as locked:
            if not (locked or self.owns):
                return 0  # another merger holds the lock: the parts keep the lines
            try:
                if self._superseded() or not self._append(data):
                    self.stood_down = True
                    return 0
            except OSError:
                return 0  # a full disk or a lost mount: the parts keep the records; retried
            self.last_step = last_step
            self.offsets.update(reached)
            self.size += len(data)
            self._save()
        return len(kept)

    def _superseded(self) -> bool:
        """Whether a newer generation's merger has claimed the log since this one did."""
        if self.generation is None:
            return False
        newest = max((g for g, _ in _records(self.parts)), default=0)
        return newest > self.generation

    @contextlib.contextmanager
    def _lock(self) -> Iterator[bool]:
        """Recover, check and append as one step against another merger of the run (an
        advisory lock on a file beside the parts: the mergers of one file system). Yields
        whether it was had within ``LOCK_S``: its holder may be a process stopped inside
        its merge, which a newer generation does not wait for (module docstring)."""
        try:
            self.parts.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.parts / "merge.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # no lock to be had (a read-only run directory): merge unlocked
            yield True
            return
        try:
            yield _flock(fd, OWNER_LOCK_S if self.owns else LOCK_S)
        finally:
            os.close(fd)  # releases the lock

    def _first_per_step(self, lines: list[bytes]) -> tuple[list[bytes], int]:
        """``lines`` less, for ``metrics``, every line of a step already merged (in
        order: the first line of a new step raises the mark), and the new ``last_step``."""
        if not self.per_step:
            return lines, self.last_step
        out, last = [], self.last_step
        for line in lines:
            step = _step(line)
            if step is not None and step <= last:
                continue
            last = max(last, step if step is not None else -1)
            out.append(line)
        return out, last

    def _append(self, data: bytes) -> bool:
        """Write ``data`` at the recorded size; False if a newer generation claimed the
        log (checked after the open: module docstring), nothing written."""
        if not data:
            return True
        fd = os.open(self.merged, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if self._superseded():
                return False
            os.lseek(fd, self.size, os.SEEK_SET)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, self.size)
            raise
        finally:
            os.close(fd)
        return True

    def _save(self) -> None:
        """Record the merged size and the parts' offsets, in the claimed generation's
        record (an older merger never writes a newer one's)."""
        path = self.parts / _state_name(self.claimed)
        tmp = path.with_name(path.name + ".tmp")
        with contextlib.suppress(OSError):
            state = {"size": self.size, "offsets": self.offsets, "last_step": self.last_step}
            if self.claimed is not None:
                state["generation"] = self.claimed
            tmp.write_text(json.dumps(state))
            os.replace(tmp, path)


def _state_name(generation: int | None) -> str:
    return STATE if generation is None else f"merged.g{generation}.json"


def _records(parts: Path) -> list[tuple[int, Path]]:
    """Every merger's record in ``parts``: (generation, path), oldest first (0: the record
    of mergers that claimed none)."""
    try:
        names = [p for p in parts.iterdir() if _STATE_NAME.fullmatch(p.name)]
    except OSError:
        return []
    out = []
    for p in names:
        m = _STATE_NAME.fullmatch(p.name)
        assert m is not None
        out.append((int(m.group(1) or 0), p))
    return sorted(out)


def newest_record(parts: str | Path) -> dict[str, Any] | None:
    """The newest generation's merge record in a log's parts folder (``<log>.d``): the
    merged size, each part's offset, ``last_step``, ``generation``; None where none can
    be read."""
    for _, path in reversed(_records(Path(parts))):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict):
            return state
    return None


def _flock(fd: int, timeout_s: float) -> bool:
    """An exclusive ``flock`` on ``fd`` within ``timeout_s``, polled: whether it was had."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def _new_lines(path: Path, offset: int, cutoff: float) -> tuple[list[tuple[float, bytes]], int]:
    """The complete lines of ``path`` after ``offset`` stamped before ``cutoff`` (with
    their ``t``), and the offset after the last of them. Torn or foreign lines are
    skipped (and passed)."""
    try:
        with open(path, "rb") as f:  # opened afresh: NFS revalidates on open
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    out: list[tuple[float, bytes]] = []
    at = offset
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break  # a line still being written
        line = raw.rstrip(b"\n")
        t = _stamp(line)
        if t is not None and t >= cutoff:
            break  # later lines of this writer are later still: next merge
        if t is not None:
            out.append((t, line))
        at += len(raw)
    return out, at


def _generation(state: Any) -> int | None:
    g = state.get("generation") if isinstance(state, dict) else None
    return int(g) if isinstance(g, int) else None


def _field(line: bytes, name: str) -> Any:
    """Field ``name`` of a JSON-object line (None: no such field, or not such a line)."""
    try:
        record: Any = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record.get(name) if isinstance(record, dict) else None


def _stamp(line: bytes) -> float | None:
    t = _field(line, "t")
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None


def _step(line: bytes) -> int | None:
    """A metrics line's ``step`` (None: not a step's line)."""
    step = _field(line, "step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def merge_all(run_dir: str | Path, final: bool = False) -> None:
    """Merge every log of the run once (the launcher's last merge, a tool's)."""
    for log in LOGS:
        Merger(run_dir, log).merge(final=final)


class Mergers:
    """The coordinator's mergers of every log, at most one merge per ``MERGE_S``."""

    def __init__(self, run_dir: str | Path, *, new_launch: bool = False) -> None:
        """``new_launch``: this coordinator starts a launch (a primary), so the metrics
        merger logs steps afresh; a standby taking over goes on with the launch."""
        self.run_dir = run_dir
        self.new_launch = new_launch
        self._mergers: list[Merger] | None = None
        self._last = 0.0

    def tick(self, now: float, final: bool = False, generation: int | None = None) -> None:
        """``generation``: this coordinator's (see ``Merger``)."""
        if not final and now - self._last < MERGE_S:
            return
        self._last = now
        if self._mergers is None:  # created on first use: a standby merges once active
            new = self.new_launch
            self._mergers = [
                Merger(self.run_dir, log, new_launch=new, generation=generation) for log in LOGS
            ]
        for m in self._mergers:
            m.merge(final=final)


__all__ = [
    "LOCK_S",
    "LOGS",
    "MERGE_S",
    "Merger",
    "Mergers",
    "merge_all",
    "newest_record",
    "part",
    "writer_id",
]
