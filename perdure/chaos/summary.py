"""What each injected fault cost, read back from the run's logs. Pure functions.

Times are measured from the ``fault_injected`` record (written by the launcher at the
moment it sends the signal or posts the fault) to the first record of each phase:

- *detect*: the first sign the system saw it: a ``leave`` or ``collective_failed`` of the
  target, a standby's takeover, a re-plan away from a slow worker, a quarantine;
- *re-plan*: the next ``epoch_started`` (a new membership epoch with a new plan);
- *copy state*: the first ``state_received`` after it (replicate, resume, continue);
- *recover*: the next committed step after the re-plan.

*Steps lost* counts committed steps that a later epoch started before (it must be 0: a
step that completed anywhere is kept).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from perdure import events as ev

CLASSES = {
    "kill": "hardware",
    "stop": "planned",
    "hang": "hardware",
    "comm_error": "hardware",
    "delay": "network",
    "region_down": "partial_cluster_loss",
    "poison_shard": "data",
}

Record = dict[str, Any]


def _first(events: Iterable[Record], after: float, pred: Any) -> Record | None:
    return next((e for e in events if e["t"] >= after and pred(e)), None)


def _detected(e: Record, fault: Record, region_workers: set[str]) -> bool:
    kind, target = fault["kind"], fault["target"]
    name = e["event"]
    if kind == "poison_shard":
        return name == ev.DECISION and int(target) in e.get("shards", [])
    if kind == "delay":
        return name == ev.EPOCH_ANNOUNCED and e.get("reason") == "rebalance"
    hit = {target} | region_workers
    if name in (ev.LEAVE, ev.COLLECTIVE_FAILED, ev.LEAVE_REQUESTED):
        return e.get("worker") in hit or kind == "comm_error"
    return name == ev.COORDINATOR_TAKEOVER


def fault_report(events: list[Record], metrics: list[Record]) -> list[Record]:
    """One record per injected fault (see module doc), in injection order. A fault's
    phases are looked for before the next fault strikes, so that one fault's recovery is
    never credited to another."""
    events = sorted(events, key=lambda e: e["t"])
    region_of = {e["worker"]: e.get("region") for e in events if e["event"] == ev.JOIN}
    faults = [e for e in events if e["event"] == ev.FAULT_INJECTED]
    out = []
    for i, f in enumerate(faults):
        end = faults[i + 1]["t"] if i + 1 < len(faults) else float("inf")
        window = [e for e in events if e["t"] < end or e["event"] in (ev.RUN_END, ev.LEAVE)]
        out.append(_one(f, window, metrics, region_of))
    return out


def _start_t(f: Record, metrics: list[Record]) -> float:
    """When a fault took effect. A poisoned shard is applied by the loaders at exactly its
    step, possibly before the launcher noticed that step: it starts when that step did."""
    if f["kind"] != "poison_shard" or f.get("at_step") is None:
        return float(f["t"])
    before = [m["t"] for m in metrics if m["step"] < f["at_step"]]
    return max(before) if before else min((m["t"] for m in metrics), default=float(f["t"]))


def _one(f: Record, events: list[Record], metrics: list[Record], region_of: dict) -> Record:
    t0 = _start_t(f, metrics)
    region_workers = {w for w, r in region_of.items() if r == f["target"]}
    detect = _first(events, t0, lambda e: _detected(e, f, region_workers))
    replan = _first(events, t0, lambda e: e["event"] == ev.EPOCH_STARTED)
    if f["kind"] in ("poison_shard",):
        replan = None
    copy = None
    if f["kind"] in ("kill", "stop", "hang", "region_down"):
        copy = _first(events, t0, lambda e: e["event"] == ev.STATE_RECEIVED)
    after = replan["t"] if replan else (detect["t"] if detect else t0)
    commit = next((m for m in metrics if m["t"] > after), None)
    return {
        "fault": f.get("fault"),
        "kind": f["kind"],
        "class": CLASSES.get(f["kind"], "other"),
        "target": f["target"],
        "injected_step": f.get("step"),
        "injected_t": t0,
        "detect_s": _dt(detect, t0),
        "replan_s": _dt(replan, t0),
        "state_copy_s": copy.get("seconds") if copy else None,
        "recover_s": _dt(commit, t0),
        "steps_lost": steps_lost(events, metrics, t0),
        "absorbed": _absorbed(f, events, detect),
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


def _absorbed(f: Record, events: list[Record], detect: Record | None) -> bool:
    """The run went on to its end with the fault handled as its class requires."""
    ended = any(e["event"] == ev.RUN_END for e in events)
    if f["kind"] == "delay":
        evicted = any(
            e["event"] == ev.LEAVE and e.get("worker") == f["target"] and e["t"] >= f["t"]
            for e in events
        )
        return ended and not evicted
    return ended and detect is not None


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


def totals(faults: list[Record]) -> Record:
    return {
        "faults_injected": len(faults),
        "faults_absorbed": sum(1 for f in faults if f["absorbed"]),
        "steps_lost": sum(f["steps_lost"] for f in faults),
    }
