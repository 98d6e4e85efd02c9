"""Read a run directory defensively into plain Python data for the report.

A run directory is written by processes that may be killed at any moment, and by
older versions of perdure, so every reader here tolerates a torn last line, a line
that is not a JSON object, a missing file and a missing key. Nothing here raises on
bad input; what cannot be read is counted in ``RunData.skipped_lines`` so the report
can say that it is incomplete rather than silently hide it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perdure import events as ev

METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
SUMMARY = "summary.json"
CONFIG = "config.json"


@dataclass(frozen=True)
class StepPoint:
    """One committed step from ``metrics.jsonl``; a missing number is ``None``."""

    step: int
    t: float | None = None
    loss: float | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    membership_epoch: int | None = None
    members: tuple[str, ...] = ()
    slots: tuple[int, ...] = ()


@dataclass(frozen=True)
class FaultMark:
    """Where a fault goes on a per-step plot: the step it was injected at and a label."""

    step: int
    kind: str
    target: str

    @property
    def label(self) -> str:
        return f"{self.kind} {self.target}".strip()


@dataclass(frozen=True)
class EpochMark:
    """A membership change on a per-step plot: the first step the new membership ran."""

    step: int
    epoch: int
    members: tuple[str, ...]
    reason: str


@dataclass
class RunData:
    """Everything the report draws, parsed once."""

    run_dir: Path
    metrics: list[StepPoint] = field(default_factory=list)
    evals: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Each evaluation metric (``eval/<name>`` less the prefix) by step, in step order."""
    train: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """The task's own metrics (``train/<name>`` less the prefix) by step, in step order."""
    events: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    skipped_lines: dict[str, int] = field(default_factory=dict)
    missing_files: list[str] = field(default_factory=list)


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Return the JSON objects of a JSON-lines file and how many lines were unreadable.

    Blank lines are ignored; a torn line, a non-object line or undecodable bytes count
    as skipped. A missing file reads as empty.
    """
    try:
        raw = path.read_bytes()
    except OSError:
        return [], 0
    rows: list[dict[str, Any]] = []
    skipped = 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8", errors="replace"))
        except ValueError:
            skipped += 1
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            skipped += 1
    return rows, skipped


def read_json(path: Path) -> dict[str, Any] | None:
    """Return the JSON object in ``path``, or ``None`` if it is missing or not an object."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def num(value: Any) -> float | None:
    """A finite float, or ``None`` for anything else (missing, string, NaN, bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def integer(value: Any) -> int | None:
    """An int, or ``None``; integral floats are accepted (JSON writers differ)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def step_point(row: dict[str, Any]) -> StepPoint | None:
    """Parse one metrics row; ``None`` when it has no usable step number."""
    step = integer(row.get("step"))
    if step is None:
        return None
    members = row.get("members")
    slots = row.get("slots")
    member_t: tuple[str, ...] = tuple(str(m) for m in members) if isinstance(members, list) else ()
    slot_t: tuple[int, ...] = ()
    if isinstance(slots, list):
        parsed = [integer(s) for s in slots]
        slot_t = tuple(s if s is not None else 0 for s in parsed)
    return StepPoint(
        step=step,
        t=num(row.get("t")),
        loss=num(row.get("loss")),
        step_s=num(row.get("step_s")),
        tokens_per_s=num(row.get("tokens_per_s")),
        membership_epoch=integer(row.get("membership_epoch")),
        members=member_t,
        slots=slot_t,
    )


def parse_metrics(rows: list[dict[str, Any]]) -> list[StepPoint]:
    """Step points sorted by step; when a step repeats (a resumed run), the last one wins."""
    by_step: dict[int, StepPoint] = {}
    for row in rows:
        p = step_point(row)
        if p is not None:
            by_step[p.step] = p
    return [by_step[s] for s in sorted(by_step)]


def parse_evals(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """The evaluation lines' (``eval_step``) metrics by name, sorted by step; a step
    evaluated twice (a resumed run) keeps its last line."""
    by_name: dict[str, dict[int, float]] = {}
    for row in rows:
        step = integer(row.get("eval_step"))
        if step is None:
            continue
        for key, value in row.items():
            v = num(value) if key.startswith("eval/") else None
            if v is not None:
                by_name.setdefault(key[5:], {})[step] = v
    return {k: sorted(v.items()) for k, v in by_name.items()}


def parse_train(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """The step lines' task metrics (``train/<name>``, ``Task.metrics``) by name, sorted by
    step; a step logged twice keeps its last line."""
    by_name: dict[str, dict[int, float]] = {}
    for row in rows:
        step = integer(row.get("step"))
        if step is None or "eval_step" in row:
            continue
        for key, value in row.items():
            v = num(value) if key.startswith("train/") else None
            if v is not None:
                by_name.setdefault(key[6:], {})[step] = v
    return {k: sorted(v.items()) for k, v in by_name.items()}


def fault_marks(summary: dict[str, Any], events: list[dict[str, Any]]) -> list[FaultMark]:
    """Faults to mark on per-step plots.

    The summary's fault list is preferred (it is the runtime's own account); runs whose
    summary has none fall back to ``fault_injected`` events.
    """
    marks: list[FaultMark] = []
    faults = summary.get("faults")
    if isinstance(faults, list) and faults:
        for f in faults:
            if not isinstance(f, dict):
                continue
            step = integer(f.get("injected_step"))
            if step is not None:
                marks.append(
                    FaultMark(step, str(f.get("kind") or "fault"), str(f.get("target") or ""))
                )
        return marks
    for e in events:
        if e.get("event") != ev.FAULT_INJECTED:
            continue
        step = integer(e.get("step"))
        if step is not None:
            marks.append(FaultMark(step, str(e.get("kind") or "fault"), str(e.get("target") or "")))
    return marks


def epoch_marks(events: list[dict[str, Any]]) -> list[EpochMark]:
    """Membership changes from ``epoch_started`` events, the first (start) one excluded."""
    marks: list[EpochMark] = []
    for e in events:
        if e.get("event") != ev.EPOCH_STARTED:
            continue
        step = integer(e.get("start_step"))
        epoch = integer(e.get("epoch"))
        if step is None or epoch is None:
            continue
        plan = e.get("plan")
        members = plan.get("members") if isinstance(plan, dict) else None
        marks.append(
            EpochMark(
                step=step,
                epoch=epoch,
                members=tuple(str(m) for m in members) if isinstance(members, list) else (),
                reason=str(e.get("reason") or ""),
            )
        )
    marks.sort(key=lambda m: (m.step, m.epoch))
    return marks[1:] if marks and marks[0].reason == "start" else marks


def load_run(run_dir: str | Path) -> RunData:
    """Read every input of the report from ``run_dir``; never raises on bad content."""
    root = Path(run_dir)
    data = RunData(run_dir=root)
    metric_rows, skipped = read_jsonl(root / METRICS)
    if skipped:
        data.skipped_lines[METRICS] = skipped
    data.metrics = parse_metrics(metric_rows)
    data.evals = parse_evals(metric_rows)
    data.train = parse_train(metric_rows)
    events, skipped = read_jsonl(root / EVENTS)
    if skipped:
        data.skipped_lines[EVENTS] = skipped
    data.events = sorted(events, key=lambda e: num(e.get("t")) or 0.0)
    for name in (METRICS, EVENTS, SUMMARY, CONFIG):
        if not (root / name).exists():
            data.missing_files.append(name)
    data.summary = read_json(root / SUMMARY) or {}
    data.config = read_json(root / CONFIG) or {}
    return data
