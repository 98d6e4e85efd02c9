"""TensorBoard event files of a run, each point written once.

Tags (x axis: the training step; wall time: when the record was logged):

- ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/loss_scale`` (``fp16``
  only), ``train/step_s``,
  ``train/tokens_per_s``, and the task's own ``train/<name>`` (``Task.metrics``): one point
  per committed step, from ``metrics.jsonl``;
- ``eval/<name>``: one point per evaluation (``runtime/member/evaluate.py``), at the step after
  whose update it ran, from its ``metrics.jsonl`` line;
- ``membership/members``, ``membership/epoch``: one point per membership epoch, at its
  start step;
- ``faults/injected``: the running count of faults the schedule injected;
- ``failures/observed`` and ``failures/<kind>``: running counts of the failures the log
  shows (``chaos/observed.py``), scheduled or not.

Each tag has a key that only grows: the step for ``train/*``, the epoch number for
``membership/*``, the count for the counters; a point is written only when its key is
above the last one written. So a step that two ranks 0 logged (one died after logging it,
its step was re-run by the survivors with the same bits) is one point, and a coordinator
that takes over reads the keys back from the files its predecessor wrote and goes on
after them: nothing is duplicated, and nothing it had not flushed is lost (the points come
from the logs, not from its memory). A launch that starts over existing files (a resume in
the same run directory) marks its first step as TensorBoard's *purge step*, so the
previous launch's points from there on are hidden instead of drawn twice.

Limit: a point older than the newest of its tag that arrives late (a log line delayed
behind a newer one) is dropped; the logs are written in step order, so this does not
happen in a run that follows them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perdure import events as ev
from perdure.metrics.view import Failure, RunView

TRAIN = (
    ("train/loss", "loss"),
    ("train/lr", "lr"),
    ("train/grad_norm", "grad_norm"),
    ("train/loss_scale", "loss_scale"),
    ("train/step_s", "step_s"),
    ("train/tokens_per_s", "tokens_per_s"),
)
"""Per-step tags and the ``metrics.jsonl`` field each plots."""

EPOCH_TAGS = ("membership/members", "membership/epoch")
COUNTERS = ("faults/injected", "failures/observed")


class _EventWriter:
    """Scalars into one event file, as ``torch.utils.tensorboard.SummaryWriter`` writes
    them (a ``simple_value`` per point; a purge step as a file-version event and a
    session start at that step), from the ``tensorboard`` package alone: the coordinator
    writes these files and never imports torch (its import was most of the coordinator's
    start-up)."""

    def __init__(self, log_dir: Path, *, purge_step: int | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(log_dir), max_queue_size=10, flush_secs=3600)
        if purge_step is not None:  # hides the earlier launch's points from this step on
            self._writer.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            start = SessionLog(status=SessionLog.START)
            self._writer.add_event(Event(step=purge_step, session_log=start))

    def add_scalar(self, tag: str, value: float, *, global_step: int, walltime: float) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self._writer.add_event(Event(summary=summary, step=int(global_step), wall_time=walltime))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@dataclass(frozen=True)
class Point:
    tag: str
    step: int
    value: float
    key: float
    """Grows along the tag: what decides whether the point is new."""
    t: float


def train_points(metrics: Iterable[dict[str, Any]]) -> list[Point]:
    out = []
    for m in metrics:
        for tag, name in TRAIN:
            v = m.get(name)
            if isinstance(v, int | float):
                out.append(Point(tag, int(m["step"]), float(v), float(m["step"]), float(m["t"])))
        for name, v in m.items():  # each param group's rate: train/lr/<group>
            if name.startswith("lr/") and isinstance(v, int | float):
                key = float(m["step"])
                out.append(Point(f"train/{name}", int(m["step"]), float(v), key, float(m["t"])))
            elif name.startswith("train/") and isinstance(v, int | float):  # Task.metrics
                key = float(m["step"])
                out.append(Point(name, int(m["step"]), float(v), key, float(m["t"])))
    return out


def eval_points(evals: Iterable[dict[str, Any]]) -> list[Point]:
    """``eval/<name>`` points of the evaluation lines (key: their step)."""
    out = []
    for m in evals:
        step = int(m["eval_step"])
        for name, v in m.items():
            if name.startswith("eval/") and isinstance(v, int | float):
                out.append(Point(name, step, float(v), float(step), float(m["t"])))
    return out


def event_points(view: RunView) -> list[Point]:
    """Membership, fault and failure points from the events read so far. Pure but for
    the view's cached failure list."""
    out = []
    epochs = {e["epoch"]: e for e in view.events if e["event"] == ev.EPOCH_STARTED}
    for ep in view.epochs():
        t = float(epochs[ep.number]["t"])
        out.append(Point("membership/members", ep.start_step, ep.members, ep.number, t))
        out.append(Point("membership/epoch", ep.start_step, ep.number, ep.number, t))
    injected = [e for e in view.events if e["event"] == ev.FAULT_INJECTED]
    for i, e in enumerate(injected, 1):
        step = e["step"] if isinstance(e.get("step"), int) else view.step_at(e["t"])
        out.append(Point("faults/injected", step, i, i, float(e["t"])))
    out += failure_points(view.failures())
    return out


def failure_points(failures: list[Failure]) -> list[Point]:
    out = []
    per_kind: dict[str, int] = {}
    for i, f in enumerate(sorted(failures, key=lambda f: f.t), 1):
        per_kind[f.kind] = per_kind.get(f.kind, 0) + 1
        n = per_kind[f.kind]
        out.append(Point("failures/observed", f.step, i, i, f.t))
        out.append(Point(f"failures/{f.kind}", f.step, n, n, f.t))
    return out


def new_points(points: Iterable[Point], last: dict[str, float]) -> list[Point]:
    """The points whose key is above the last one written for their tag; updates
    ``last``. Pure but for ``last``."""
    out = []
    for p in sorted(points, key=lambda p: (p.key, p.t)):
        if p.key > last.get(p.tag, -1.0):
            last[p.tag] = p.key
            out.append(p)
    return out


def written_keys(log_dir: Path) -> dict[str, float]:
    """The last key of each tag in the event files under ``log_dir`` (purges honoured),
    so that a coordinator taking over goes on after its predecessor."""
    if not any(log_dir.glob("events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    last: dict[str, float] = {}
    for tag in acc.Tags().get("scalars", []):
        values = acc.Scalars(tag)
        if not values:
            continue
        if tag.startswith(("train/", "eval/")):
            last[tag] = float(max(v.step for v in values))
        else:  # counters: the count; membership: the epoch number, below
            last[tag] = float(max(v.value for v in values))
    if "membership/epoch" in last:
        last["membership/members"] = last["membership/epoch"]
    return last


class TensorBoardSink:
    """Writes new points to event files under ``log_dir``.

    ``takeover``: this coordinator continues a predecessor's files (read their keys
    first). Otherwise, if files are already there (an earlier launch), the first point
    written marks a purge from its step on."""

    def __init__(self, log_dir: Path, *, takeover: bool) -> None:
        self.log_dir = log_dir
        self.takeover = takeover
        self.last: dict[str, float] = written_keys(log_dir) if takeover else {}
        self._writer: _EventWriter | None = None
        self.written = 0

    def write(self, points: Iterable[Point]) -> int:
        """Write the new ones among ``points`` and flush; how many were written."""
        fresh = new_points(points, self.last)
        if not fresh:
            return 0
        w = self._open(min(p.step for p in fresh))
        for p in fresh:
            w.add_scalar(p.tag, p.value, global_step=p.step, walltime=p.t)
        w.flush()
        self.written += len(fresh)
        return len(fresh)

    def _open(self, first_step: int) -> _EventWriter:
        if self._writer is None:
            earlier = any(self.log_dir.glob("events.out.tfevents.*"))
            purge = first_step if earlier and not self.takeover else None
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = _EventWriter(self.log_dir, purge_step=purge)
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
