"""The run as its logs show it, folded into numbers a dashboard can plot. No I/O but reads.

:class:`RunView` tails ``metrics.jsonl`` (one line per committed step) and
``events.jsonl`` (every process's events) from the moment it is made, so a coordinator
sees this launch's records only (a run resumed in its own directory appends to the
previous launch's logs). :func:`snapshot` is a pure function of the records read so far.

Failures are those of ``chaos/observed.py`` (one record per failure the log shows,
scheduled or not), counted by kind and by whether a fault of the schedule explains them;
they are recomputed only when new events arrive. Limit: ``observed.py`` reads causes
from timing, so a failure seen within a couple of seconds of another may change kind once
a later event explains it (a ``disconnect`` becomes the ``process_exit`` it was): a count
may go down by one as another goes up.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perdure import events as ev
from perdure.chaos import faults as registry
from perdure.chaos.observed import observed_failures
from perdure.chaos.summary import goodput
from perdure.events import Tail

Record = dict[str, Any]


@dataclass(frozen=True)
class Snapshot:
    """What the run's logs say now (this launch)."""

    step: int | None = None
    """The last committed step (None: none yet)."""
    steps_committed: int = 0
    loss: float | None = None
    lr: float | None = None
    lrs: dict[str, float] = field(default_factory=dict)
    """Each param group's rate (``lr/<group>``) at the last committed step."""
    eval_step: int | None = None
    """The step after which the last evaluation ran (None: none yet)."""
    evals: dict[str, float] = field(default_factory=dict)
    """That evaluation's metrics by name, less the ``eval/`` prefix (``loss``, ...)."""
    train: dict[str, float] = field(default_factory=dict)
    """The task's own metrics (``train/<name>`` less the prefix) at the last committed step."""
    grad_norm: float | None = None
    """The last committed step's gradient norm (before ``optim.grad_clip``)."""
    loss_scale: float | None = None
    """The last committed step's loss scale (``train.precision = "fp16"`` only)."""
    step_s: float | None = None
    tokens_per_s: float | None = None
    membership_epoch: int | None = None
    members: int = 0
    membership_changes: int = 0
    """Epochs whose member set differs from the previous one (re-plans not counted)."""
    checkpoint_step: int | None = None
    """The step of the newest committed checkpoint."""
    checkpoints_saved: int = 0
    faults: dict[tuple[str, str], int] = field(default_factory=dict)
    """Faults injected by the schedule, by (kind, failure class)."""
    failures: dict[tuple[str, bool], int] = field(default_factory=dict)
    """Failures observed, by (kind, scheduled)."""
    goodput: float | None = None
    run_ended: bool = False


@dataclass(frozen=True)
class Epoch:
    """A membership epoch as ``epoch_started`` logged it."""

    number: int
    start_step: int
    members: int


@dataclass(frozen=True)
class Failure:
    """An observed failure, placed at the step the run was at when it happened."""

    kind: str
    scheduled: bool
    step: int
    t: float


class RunView:
    """Tails the run's logs; ``update()`` reads what was appended since the last call."""

    def __init__(self, run_dir: str | Path) -> None:
        run_dir = Path(run_dir)
        self._metrics_tail = Tail(run_dir / "metrics.jsonl", from_end=True)
        self._events_tail = Tail(run_dir / "events.jsonl", from_end=True)
        self.metrics: list[Record] = []
        self.evals: list[Record] = []
        """The evaluations' lines (``eval_step``: ``runtime/member/evaluate.py``)."""
        self.events: list[Record] = []
        self._failures: list[Failure] = []
        self._failures_at = -1
        """How many events the failures were computed from."""

    def update(self) -> tuple[list[Record], list[Record]]:
        """Read new records; returns (new metrics lines, new events)."""
        lines = self._metrics_tail.read()
        new_m = [m for m in lines if _is_step(m)]
        self.evals += [m for m in lines if is_eval(m)]
        new_e = [e for e in self._events_tail.read() if isinstance(e.get("t"), int | float)]
        self.metrics += new_m
        self.events += new_e
        return new_m, new_e

    def epochs(self) -> list[Epoch]:
        return [
            Epoch(int(e["epoch"]), int(e["start_step"]), len(e["plan"]["members"]))
            for e in self.events
            if e["event"] == ev.EPOCH_STARTED and _is_epoch(e)
        ]

    def failures(self) -> list[Failure]:
        """Every failure the events show so far (recomputed when events were added)."""
        if self._failures_at != len(self.events):
            self._failures_at = len(self.events)
            found = observed_failures(self.events, [])  # kinds and causes need no metrics
            self._failures = [
                Failure(str(f["kind"]), bool(f["scheduled"]), self.step_at(f["t"]), f["t"])
                for f in found
            ]
        return self._failures

    def step_at(self, t: float) -> int:
        """The step the run was at at time ``t``: one past the last committed before it."""
        times = [float(m["t"]) for m in self.metrics]
        i = bisect.bisect_right(times, t)
        done = [int(m["step"]) for m in self.metrics[:i]]
        return max(done) + 1 if done else 0

    def snapshot(self) -> Snapshot:
        return snapshot(self.metrics, self.events, self.failures(), self.evals)


def snapshot(
    metrics: list[Record],
    events: list[Record],
    failures: list[Failure],
    evals: list[Record] | None = None,
) -> Snapshot:
    """The numbers of the run from its records. Pure."""
    last_eval = max(evals, key=lambda m: (m["eval_step"], m["t"])) if evals else None
    last = max(metrics, key=lambda m: (m["step"], m["t"])) if metrics else None
    epochs = [e for e in events if e["event"] == ev.EPOCH_STARTED and _is_epoch(e)]
    saved = [e for e in events if e["event"] == ev.CHECKPOINT_SAVED and "step" in e]
    faults: dict[tuple[str, str], int] = {}
    for e in events:
        if e["event"] == ev.FAULT_INJECTED:
            kind = str(e.get("kind"))
            key = (kind, failure_class(kind))
            faults[key] = faults.get(key, 0) + 1
    counts: dict[tuple[str, bool], int] = {}
    for f in failures:
        counts[(f.kind, f.scheduled)] = counts.get((f.kind, f.scheduled), 0) + 1
    sets = [frozenset(e["plan"]["members"]) for e in epochs]
    return Snapshot(
        step=int(last["step"]) if last else None,
        steps_committed=len({m["step"] for m in metrics}),
        loss=_num(last, "loss"),
        lr=_num(last, "lr"),
        lrs={
            k[3:]: float(v)
            for k, v in (last or {}).items()
            if k.startswith("lr/") and isinstance(v, int | float)
        },
        eval_step=int(last_eval["eval_step"]) if last_eval else None,
        evals=eval_metrics(last_eval),
        train={
            k[6:]: float(v)
            for k, v in (last or {}).items()
            if k.startswith("train/") and isinstance(v, int | float)
        },
        grad_norm=_num(last, "grad_norm"),
        loss_scale=_num(last, "loss_scale"),
        step_s=_num(last, "step_s"),
        tokens_per_s=_num(last, "tokens_per_s"),
        membership_epoch=int(epochs[-1]["epoch"]) if epochs else None,
        members=len(sets[-1]) if sets else 0,
        membership_changes=sum(1 for a, b in itertools.pairwise(sets) if a != b),
        checkpoint_step=max(int(e["step"]) for e in saved) if saved else None,
        checkpoints_saved=len(saved),
        faults=faults,
        failures=counts,
        goodput=goodput([m for m in metrics if isinstance(m.get("step_s"), int | float)]),
        run_ended=any(e["event"] == ev.RUN_END for e in events),
    )


def failure_class(kind: str) -> str:
    """The design's failure class of a fault kind (``unknown`` for a kind not in the
    registry, e.g. one logged by a newer version)."""
    k = registry.get(kind)
    return str(k.failure_class) if k is not None else "unknown"


def _num(rec: Record | None, key: str) -> float | None:
    v = rec.get(key) if rec else None
    return float(v) if isinstance(v, int | float) else None


def eval_metrics(rec: Record | None) -> dict[str, float]:
    """An evaluation line's metrics by name, less the ``eval/`` prefix."""
    return {
        k[5:]: float(v)
        for k, v in (rec or {}).items()
        if k.startswith("eval/") and isinstance(v, int | float) and not isinstance(v, bool)
    }


def is_eval(m: Record) -> bool:
    """An evaluation's line of metrics.jsonl (``runtime/member/evaluate.py``)."""
    step = m.get("eval_step")
    return (
        isinstance(step, int) and not isinstance(step, bool) and isinstance(m.get("t"), int | float)
    )


def _is_step(m: Record) -> bool:
    return isinstance(m.get("step"), int) and isinstance(m.get("t"), int | float)


def _is_epoch(e: Record) -> bool:
    plan = e.get("plan")
    return (
        isinstance(e.get("epoch"), int)
        and isinstance(e.get("start_step"), int)
        and isinstance(plan, dict)
        and isinstance(plan.get("members"), list)
    )
