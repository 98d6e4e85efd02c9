"""What each injected fault cost, read back from the run's logs. Pure functions.

Times are measured from the ``fault_injected`` record (written by the launcher at the
moment it sends the signal or posts the fault) to the first record of each phase:

- *detect*: the first sign the system saw it, as its kind recognises it
  (``chaos/faults/``): a ``leave`` or ``collective_failed`` of the target, a standby's
  takeover, a re-plan away from a slow worker, a quarantine;
- *re-plan*: the next ``epoch_started`` (a new membership epoch with a new plan), for
  kinds that re-plan;
- *copy state*: the first ``state_received`` after it (replicate, resume, continue), for
  kinds whose absorption copies state;
- *recover*: the next committed step after the re-plan.

*Steps lost* counts committed steps that a later epoch started before (it must be 0: a
step that completed anywhere is kept).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from perdure import events as ev
from perdure.chaos import faults
from perdure.chaos.faults.base import Fault

Record = dict[str, Any]

_UNKNOWN = Fault()
"""How a kind this code does not know is read (an older or newer run's log): as a fault
that removes members."""


def _first(events: Iterable[Record], after: float, pred: Any) -> Record | None:
    return next((e for e in events if e["t"] >= after and pred(e)), None)


def _named(name: str) -> Any:
    return lambda e: e["event"] == name


def fault_report(events: list[Record], metrics: list[Record]) -> list[Record]:
    """One record per injected fault (see module doc), in injection order. A fault's
    phases are looked for before the next fault strikes, so that one fault's recovery is
    never credited to another."""
    events = sorted(events, key=lambda e: e["t"])
    region_of = {e["worker"]: e.get("region") for e in events if e["event"] == ev.JOIN}
    injected = [e for e in events if e["event"] == ev.FAULT_INJECTED]
    out = []
    for i, f in enumerate(injected):
        end = injected[i + 1]["t"] if i + 1 < len(injected) else float("inf")
        window = [e for e in events if e["t"] < end or e["event"] in (ev.RUN_END, ev.LEAVE)]
        out.append(_one(f, window, metrics, region_of))
    return out


def _one(f: Record, events: list[Record], metrics: list[Record], region_of: dict) -> Record:
    kind = faults.get(f["kind"]) or _UNKNOWN
    t0 = kind.started_at(f, metrics)
    region_workers = {w for w, r in region_of.items() if r == f["target"]}
    detect = _first(events, t0, lambda e: kind.detected(e, f, region_workers))
    replan = _first(events, t0, _named(ev.EPOCH_STARTED)) if kind.replans else None
    copy = _first(events, t0, _named(ev.STATE_RECEIVED)) if kind.copies_state else None
    after = replan["t"] if replan else (detect["t"] if detect else t0)
    commit = next((m for m in metrics if m["t"] > after), None)
    return {
        "fault": f.get("fault"),
        "kind": f["kind"],
        "class": faults.failure_class(f["kind"]) or "other",
        "target": f["target"],
        "injected_step": f.get("step"),
        "injected_t": t0,
        "detect_s": _dt(detect, t0),
        "replan_s": _dt(replan, t0),
        "state_copy_s": copy.get("seconds") if copy else None,
        "recover_s": _dt(commit, t0),
        "steps_lost": steps_lost(events, metrics, t0),
        "absorbed": kind.absorbed(f, events, detect),
    }


def _dt(rec: Record | None, t0: float) -> float | None:
    return round(rec["t"] - t0, 4) if rec else None


def steps_lost(events: list[Record], metrics: list[Record], since: float) -> int:
    """Committed steps that an epoch started after ``since`` went back over."""
    lost = 0
    for e in events:
        if e["event"] != ev.EPOCH_STARTED or e["t"] < since:
            continue
        done = [m["step"] for m in metrics if m["t"] < e["t"]]
        if done:
            lost += max(0, max(done) + 1 - int(e["start_step"]))
    return lost


def goodput(metrics: list[Record]) -> float | None:
    """Committed steps at the run's median step time, over the wall time they took.

    1.0 means no time went anywhere but steps at the usual rate; faults lower it by the
    time spent detecting, re-planning and copying state, and by slow steps.
    """
    if len(metrics) < 2:
        return None
    ms = sorted(metrics, key=lambda m: m["t"])
    median = statistics.median(m["step_s"] for m in ms)
    elapsed = ms[-1]["t"] - ms[0]["t"] + median
    return round(min(1.0, len(ms) * median / elapsed), 4) if elapsed > 0 else None


def totals(rows: list[Record]) -> Record:
    return {
        "faults_injected": len(rows),
        "faults_absorbed": sum(1 for f in rows if f["absorbed"]),
        "steps_lost": sum(f["steps_lost"] for f in rows),
    }
