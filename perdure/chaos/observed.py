"""Every failure a run's log shows, scheduled or not, and whether each was absorbed. Pure.

The fault report (``chaos/summary.py``) starts from the schedule: one row per injected
fault. This starts from what happened: a worker killed from outside, a process stopped by
an operator, a link that dropped by itself are failures too, and the run must say that it
saw and absorbed them. One record per failure, from the event log:

- ``process_exit``: the launcher saw a worker process die (non-zero code); the
  coordinator's ``leave`` of that process is its detection, not another failure (when the
  coordinator died with it, the first epoch started without it is);
- ``heartbeat_loss``: a ``leave`` whose reason is the phi detector's, of a process that
  did not die (stopped, or too slow to beat);
- ``eviction``: a ``leave`` for a worker its peers evicted (non-finite slots that did not
  reproduce elsewhere);
- ``disconnect``: any other ``leave`` that no exit explains (a protocol error, a send that
  failed);
- ``collective_failure``: a membership epoch's ``collective_failed`` reports when no member
  was lost within ``EXPLAIN_S`` of them (a dropped link; otherwise they are the loss's
  symptom);
- ``coordinator_loss``: a standby took over;
- ``replica_divergence``: replica fingerprints disagreed;
- ``bad_part``: a part was quarantined (its samples' gradients were non-finite);
- ``corrupt_part``: a part failed a read and was repaired (its first ``part_repaired``
  record: read again, or a mirror's copy) or, with no good copy, quarantined (a decision
  of kind ``corrupt``).

Graceful departures (``leave_requested``) and everything after ``run_end`` (shutdown) are
not failures. A failure is *scheduled* when an injected fault explains it: the fault
signalled its process (the ``pids`` of ``fault_injected``), or named its worker or region
(up to ``MATCH_S`` after the fault ended), or poisoned or corrupted its part, or could
take the coordinator. It is *detected* when the run noticed it (for a process exit: a ``leave`` of
that process or an epoch started without it; a process that never joined needs nothing
but the launcher's notice), and *absorbed* when it was detected, the run
reached its end and no committed step was lost after it. Whether the final parameters
equal a fault-free run's is for a reference run to say (the tests, the demo).

Limits: causes are read from timing and names, not known; two failures within
``EXPLAIN_S`` of each other are told apart only by worker; an unscheduled failure of a
fault's target within ``MATCH_S`` of that fault's end is counted as the fault's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from perdure import events as ev
from perdure.chaos.faults.corrupt_part import CORRUPT_PART
from perdure.chaos.faults.poison_part import POISON_PART
from perdure.chaos.summary import steps_lost

Record = dict[str, Any]

EXPLAIN_S = 2.0
"""A collective failure this close to a lost member is that loss's symptom."""

MATCH_S = 10.0
"""How long after a fault ends (or strikes, if untimed) it may still explain a failure
of its target named by worker or region."""

INJECT_LAG_S = 0.5
"""The driver logs ``fault_injected`` after it signals: the failure may be logged first."""

COORDINATOR_FAULT_S = 60.0
"""How long after a fault that can take the coordinator a takeover is counted as its."""

_LEAVE_KINDS = (("phi", "heartbeat_loss"), ("evicted", "eviction"))


def observed_failures(events: list[Record], metrics: list[Record]) -> list[Record]:
    """One record per failure the log shows (see module doc), in time order."""
    events = sorted(events, key=lambda e: e["t"])
    end = next((e["t"] for e in events if e["event"] == ev.RUN_END), None)
    live = [e for e in events if end is None or e["t"] <= end]
    exits, claimed = _process_exits(live)
    found = exits + _leaves(live, claimed) + _collective(live) + _others(live)
    found.sort(key=lambda f: f["t"])
    faults = [e for e in events if e["event"] == ev.FAULT_INJECTED]
    ended = {e.get("fault"): e["t"] for e in events if e["event"] == ev.FAULT_ENDED}
    region_of = {e["worker"]: e.get("region") for e in events if e["event"] == ev.JOIN}
    out = []
    for f in found:
        fault = _explained_by(f, faults, ended, region_of)
        judged = _judged(f, fault, events, metrics, end is not None)
        out.append({**judged, "member": _member(events, f)})
    _mark_survivors(out)
    return out


# -- finding failures ----------------------------------------------------------------------


def _failure(kind: str, e: Record, **more: Any) -> Record:
    return {"kind": kind, "worker": e.get("worker"), "t": e["t"], **more}


def _process_exits(events: list[Record]) -> tuple[list[Record], set[int]]:
    """Exits, each with its process (the last ``join`` of its worker before it) and the
    ``leave`` records of that process, which are its detection (returned as claimed)."""
    out, claimed = [], set()
    for e in events:
        if e["event"] != ev.PROCESS_EXIT:
            continue
        join = _last(events, e["t"], lambda j, w=e["worker"]: _is(j, ev.JOIN, w))
        since = join["t"] if join else float("-inf")
        leaves = [
            i
            for i, x in enumerate(events)
            if _is(x, ev.LEAVE, e["worker"]) and since < x["t"] <= e["t"] + EXPLAIN_S
        ]
        claimed.update(leaves)
        detect = events[leaves[0]] if leaves else (_replanned(events, e, join) if join else e)
        first = min(e["t"], detect["t"]) if detect else e["t"]  # the leave may come first
        pid = join.get("pid") if join else None
        detail = f"exit code {e.get('code')}"
        out.append({**_failure(ev.PROCESS_EXIT, e, pid=pid, detail=detail, code=e.get("code"),
                               detect=detect), "t": first})  # fmt: skip
    return out, claimed


def _replanned(events: list[Record], exit_: Record, join: Record) -> Record | None:
    """The first epoch started without the dead process, from just before its exit on: its
    detection when no coordinator logged a ``leave`` (the coordinator died with it, and a
    standby took over without ever knowing it). Without it means: its worker is not a
    member, or the member of that name is another process (a replacement that joined
    after ``join``, the dead one's admission)."""
    since, worker = exit_["t"] - EXPLAIN_S, exit_["worker"]

    def replaced(before: float) -> bool:
        return any(
            _is(j, ev.JOIN, worker)
            and join["t"] < j["t"] <= before
            and j.get("pid") != join.get("pid")
            for j in events
        )

    return next(
        (
            e
            for e in events
            if e["event"] == ev.EPOCH_STARTED
            and e["t"] >= since
            and (worker not in e.get("plan", {}).get("members", []) or replaced(e["t"]))
        ),
        None,
    )


def _leaves(events: list[Record], claimed: set[int]) -> list[Record]:
    out = []
    for i, e in enumerate(events):
        if e["event"] != ev.LEAVE or i in claimed or _graceful(events, e):
            continue
        reason = str(e.get("reason", ""))
        kind = next((k for word, k in _LEAVE_KINDS if reason.startswith(word)), "disconnect")
        join = _last(events, e["t"], lambda j, w=e["worker"]: _is(j, ev.JOIN, w))
        pid = join.get("pid") if join else None
        first = _benched_before(events, e, join) or e
        out.append(_failure(kind, first, pid=pid, detail=reason, detect=first))
    return out


def _benched_before(events: list[Record], leave: Record, join: Record | None) -> Record | None:
    """The bench-out that took ``leave``'s worker out of the collective since it joined:
    where its failure was first seen (a hung or cut-off member is benched on its
    heartbeats' silence before phi declares it dead)."""
    bench = _last(events, leave["t"], lambda b, w=leave["worker"]: _is(b, ev.MEMBER_BENCHED, w))
    return bench if bench is not None and (join is None or bench["t"] >= join["t"]) else None


def _graceful(events: list[Record], leave: Record) -> bool:
    """The worker asked to go (SIGTERM) since it last joined."""
    w = leave["worker"]
    last = _last(events, leave["t"], lambda x: _is(x, ev.LEAVE_REQUESTED, w) or _is(x, ev.JOIN, w))
    return last is not None and last["event"] == ev.LEAVE_REQUESTED


def _collective(events: list[Record]) -> list[Record]:
    """One failure per epoch whose collective failures no lost member explains: no member
    was lost from the epoch's start to ``EXPLAIN_S`` after its first collective failure
    (a worker stopped and woken reports its stale epoch's failure long after its loss)."""
    gone = (ev.LEAVE, ev.PROCESS_EXIT, ev.MEMBER_BENCHED)  # benched: out of the collective
    lost = [e["t"] for e in events if e["event"] in gone]
    started = {e.get("epoch"): e["t"] for e in events if e["event"] == ev.EPOCH_STARTED}
    groups: dict[Any, list[Record]] = {}
    for e in events:
        if e["event"] == ev.COLLECTIVE_FAILED:
            groups.setdefault(e.get("epoch"), []).append(e)
    out = []
    for epoch, group in groups.items():
        first = group[0]
        since = min(started.get(epoch, first["t"]), first["t"] - EXPLAIN_S)
        if any(since <= t <= first["t"] + EXPLAIN_S for t in lost):
            continue
        reporters = sorted({str(e.get("worker")) for e in group})
        detail = str(first.get("error", ""))
        out.append(_failure("collective_failure", first, detail=detail, reporters=reporters,
                            detect=first))  # fmt: skip
    return out


def _others(events: list[Record]) -> list[Record]:
    out = []
    repaired: set[Any] = set()  # one failure per part, however many workers repaired it
    for e in events:
        if e["event"] == ev.COORDINATOR_TAKEOVER:
            detail = f"the {e.get('by', 'standby')} took over"
            out.append({**_failure("coordinator_loss", e, detail=detail, detect=e),
                        "worker": "coordinator"})  # fmt: skip
        elif e["event"] == ev.REPLICA_DIVERGED:
            workers = list(e.get("workers", []))
            worker = workers[0] if workers else None
            detail = f"fingerprints of {workers} disagreed at step {e.get('step')}"
            out.append({**_failure("replica_divergence", e, detail=detail, detect=e),
                        "worker": worker})  # fmt: skip
        elif e["event"] == ev.DECISION and e.get("kind") in _PART_DECISIONS:
            kind = _PART_DECISIONS[e["kind"]]
            parts = ev.decision_parts(e)
            detail = f"parts {parts} quarantined at step {e.get('step')}"
            out.append(_failure(kind, e, detail=detail, parts=parts, detect=e))
        elif e["event"] == ev.PART_REPAIRED and e.get("part") not in repaired:
            repaired.add(e.get("part"))
            detail = f"part {e.get('part')}: {e.get('error')}; served via {e.get('via')}"
            out.append(_failure("corrupt_part", e, detail=detail, parts=[e.get("part")], detect=e))
    return out


_PART_DECISIONS = {"quarantine": "bad_part", "corrupt": CORRUPT_PART}
"""Decision kinds that quarantine a part, and the failure each records."""

_PART_FAULTS = {"bad_part": POISON_PART, CORRUPT_PART: CORRUPT_PART}
"""The fault kind that explains each part failure (when it names the part)."""


# -- judging them --------------------------------------------------------------------------


def _explained_by(
    f: Record, faults: list[Record], ended: dict[Any, float], region_of: dict[str, Any]
) -> Record | None:
    """The latest injected fault that explains ``f`` (see module doc), if any."""
    before = [x for x in faults if x["t"] <= f["t"] + INJECT_LAG_S]
    for x in reversed(before):
        until: float = ended[x["fault"]] if x.get("fault") in ended else x["t"]
        if _explains(x, f, until, region_of):
            return x
    return None


def _explains(x: Record, f: Record, until: float, region_of: dict[str, Any]) -> bool:
    if f["kind"] in _PART_FAULTS:
        return x["kind"] == _PART_FAULTS[f["kind"]] and str(x["target"]).isdigit() and (
            int(x["target"]) in (f.get("parts") or []))  # fmt: skip
    if f["kind"] == "coordinator_loss":
        takes = x["kind"] == "region_down" or x["target"] in ("coordinator", "standby")
        return takes and f["t"] - x["t"] <= COORDINATOR_FAULT_S
    if f.get("pid") is not None and f["pid"] in (x.get("pids") or []):
        return True
    workers = f.get("reporters") or [f.get("worker")]
    names = {*workers, *(region_of.get(w or "") for w in workers)}
    return x["target"] in names and f["t"] <= until + MATCH_S


def _judged(
    f: Record, fault: Record | None, events: list[Record], metrics: list[Record], ended: bool
) -> Record:
    detect = f.pop("detect")
    lost = steps_lost(events, metrics, f["t"])
    done = [m["step"] for m in metrics if m["t"] < f["t"]]
    recover = _recovery(events, metrics, f["t"])
    return {
        **f,
        "step": max(done) + 1 if done else 0,
        "scheduled": fault is not None,
        "fault": fault.get("fault") if fault else None,
        "detected": detect is not None,
        "detected_by": detect["event"] if detect else None,
        "recover_s": round(recover - f["t"], 4) if recover is not None else None,
        "steps_lost": lost,
        "absorbed": detect is not None and ended and lost == 0,
    }


def _recovery(events: list[Record], metrics: list[Record], t: float) -> float | None:
    """When the run committed a step again: after the next epoch started, if one did."""
    epoch = next((e["t"] for e in events if e["event"] == ev.EPOCH_STARTED and e["t"] > t), t)
    return next((m["t"] for m in sorted(metrics, key=lambda m: m["t"]) if m["t"] > epoch), None)


def _member(events: list[Record], f: Record) -> bool:
    """Whether the failed worker was a member of the epoch running when it failed (a
    joiner, a spare or an idle worker holds no slots: its failure costs the run nothing).
    Failures that are not one worker's count as members'."""
    if f["kind"] not in (ev.PROCESS_EXIT, *(k for _, k in _LEAVE_KINDS), "disconnect"):
        return True
    epoch = _last(events, f["t"] - 1e-6, lambda e: e["event"] == ev.EPOCH_STARTED)
    return epoch is not None and f.get("worker") in epoch.get("plan", {}).get("members", [])


def _mark_survivors(failures: list[Record]) -> None:
    """A worker that crashed (an exception: a positive exit code), unscheduled, while the
    run was recovering from another worker's failure, was a survivor that the failure took
    down: its replacement is a survivor restart (``survivor``). A process killed by a
    signal, or one that crashed with nothing else going on, failed on its own."""
    for x in failures:
        code = x.get("code")
        x["survivor"] = False
        if (
            x["kind"] != ev.PROCESS_EXIT
            or x["scheduled"]
            or not (isinstance(code, int) and code > 0)
        ):
            continue
        x["survivor"] = any(
            f is not x and f.get("worker") != x.get("worker") and f["t"] <= x["t"]
            and (f["recover_s"] is None or x["t"] <= f["t"] + f["recover_s"])
            for f in failures
        )  # fmt: skip


def survivor_restarts(failures: Iterable[Record]) -> int:
    """Surviving processes that a failure forced to start again (by design, 0)."""
    return sum(1 for f in failures if f.get("survivor"))


def failure_totals(failures: list[Record]) -> Record:
    return {
        "failures_observed": len(failures),
        "failures_unscheduled": sum(1 for f in failures if not f["scheduled"]),
        "failures_absorbed": sum(1 for f in failures if f["absorbed"]),
        "survivor_restarts": survivor_restarts(failures),
    }


# -- helpers -------------------------------------------------------------------------------


def _is(e: Record, name: str, worker: str) -> bool:
    return bool(e["event"] == name and e.get("worker") == worker)


def _last(events: list[Record], before: float, pred: Any) -> Record | None:
    found = None
    for e in events:
        if e["t"] > before:
            break
        if pred(e):
            found = e
    return found
