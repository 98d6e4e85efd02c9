"""The report's HTML tables: header facts, faults, decisions, events.

Each function takes parsed run data and returns an escaped HTML fragment. Missing
values render as an en dash, never as ``None``: older runs and interrupted runs lack
keys, and the report should show what is there rather than fail.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from perdure import events as ev
from perdure.chaos.faults import failure_class
from perdure.report.load import RunData, integer, num
from perdure.report.svg import esc, short

DASH = "–"


def seconds(v: Any, digits: int = 3) -> str:
    """A duration in seconds, or a dash."""
    f = num(v)
    return DASH if f is None else f"{f:.{digits}f} s"


def duration(v: Any) -> str:
    """A wall time, as ``1h 02m 03s`` / ``2m 03.4s`` / ``8.90 s``."""
    f = num(v)
    if f is None:
        return DASH
    if f < 60:
        return f"{f:.2f} s"
    m, s = divmod(f, 60)
    if m < 60:
        return f"{int(m)}m {s:04.1f}s"
    h, m = divmod(m, 60)
    return f"{int(h)}h {int(m):02d}m {int(s):02d}s"


def yes_no(v: Any) -> str:
    """``yes``/``no`` for booleans, a dash for anything else."""
    return "yes" if v is True else "no" if v is False else DASH


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], css_class: str) -> str:
    """An HTML table; cells are escaped here, so callers pass plain text."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return (
        f'<table class="{esc(css_class)}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{body}</tbody></table>"
    )


def header_facts(data: RunData) -> list[tuple[str, str]]:
    """The run's headline facts as (label, value) pairs, in display order."""
    s = data.summary
    steps = integer(s.get("steps"))
    if steps is None and data.metrics:
        steps = data.metrics[-1].step + 1
    facts = [
        ("run directory", str(data.run_dir)),
        ("steps", DASH if steps is None else str(steps)),
        ("wall time", duration(s.get("wall_s"))),
        ("final hash", str(s.get("final_hash") or DASH)),
    ]
    ref = s.get("reference")
    if isinstance(ref, dict) and isinstance(ref.get("bitwise_equal"), bool):
        src = ref.get("source")
        how = f" ({src} reference)" if isinstance(src, str) and src else ""
        verdict = "bitwise-equal" if ref["bitwise_equal"] else "DIFFERENT"
        facts.append(("vs. fault-free reference", verdict + how))
    restarts = integer(s.get("survivor_restarts"))
    facts.append(("survivor restarts", DASH if restarts is None else str(restarts)))
    mc = integer(s.get("membership_changes"))
    facts.append(("membership changes", DASH if mc is None else str(mc)))
    inj, absd = integer(s.get("faults_injected")), integer(s.get("faults_absorbed"))
    if inj is None and s.get("faults") is None:
        inj = sum(1 for e in data.events if e.get("event") == ev.FAULT_INJECTED)
    if inj is not None and absd is not None:
        facts.append(("faults absorbed", f"{absd} of {inj}"))
    elif inj is not None:
        facts.append(("faults injected", str(inj)))
    seen, fine = integer(s.get("failures_observed")), integer(s.get("failures_absorbed"))
    if seen is not None and fine is not None:
        facts.append(("failures absorbed", f"{fine} of {seen}"))
    gp = num(s.get("goodput"))
    facts.append(("goodput", DASH if gp is None else f"{gp:.1%}"))
    return facts


def header_html(data: RunData) -> str:
    """Headline facts as a definition list; the reference verdict gets a colour class."""
    items = []
    for label, value in header_facts(data):
        cls = ""
        if label.startswith("vs."):
            cls = ' class="ok"' if value.startswith("bitwise-equal") else ' class="bad"'
        items.append(f"<div><dt>{esc(label)}</dt><dd{cls}>{esc(value)}</dd></div>")
    return f'<dl class="facts">{"".join(items)}</dl>'


def _after(events: list[dict[str, Any]], t0: float, kinds: set[str]) -> dict[str, Any] | None:
    for e in events:
        t = num(e.get("t"))
        if t is not None and t >= t0 and e.get("event") in kinds:
            return e
    return None


def derived_fault_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fault rows reconstructed from events, for runs whose summary has no fault list.

    Approximations, and labelled as such in the report: detection is the first
    ``collective_failed`` or ``leave`` after the injection; re-planning is the next
    ``epoch_started`` after that; state copy is the next ``state_received``. With
    overlapping faults these may pair the wrong events. Steps lost and absorption
    are not derivable from events and stay empty.
    """
    rows = []
    for e in events:
        if e.get("event") != ev.FAULT_INJECTED:
            continue
        t0 = num(e.get("t"))
        kind = str(e.get("kind") or "")
        row: dict[str, Any] = {
            "fault": e.get("fault"),
            "kind": kind,
            "class": failure_class(kind),
            "target": e.get("target"),
            "injected_step": e.get("step"),
            "injected_t": t0,
        }
        if t0 is not None:
            det = _after(events, t0, {ev.COLLECTIVE_FAILED, ev.LEAVE})
            t_det = num(det.get("t")) if det else None
            if t_det is not None:
                row["detect_s"] = t_det - t0
                rep = _after(events, t_det, {ev.EPOCH_STARTED})
                t_rep = num(rep.get("t")) if rep else None
                if t_rep is not None:
                    row["replan_s"] = t_rep - t_det
                    got = _after(events, t_rep, {ev.STATE_RECEIVED})
                    if got is not None:
                        row["state_copy_s"] = got.get("seconds")
        rows.append(row)
    return rows


FAULT_HEADERS = (
    "#",
    "kind",
    "class",
    "target",
    "injected at step",
    "time to detect",
    "time to re-plan",
    "time to copy state",
    "steps lost",
    "absorbed",
)


def fault_rows(data: RunData) -> tuple[list[list[str]], bool]:
    """Fault table rows, and whether they were derived from events (not the summary)."""
    faults = data.summary.get("faults")
    derived = not (isinstance(faults, list) and faults)
    src = (
        derived_fault_rows(data.events)
        if derived or not isinstance(faults, list)
        else [f for f in faults if isinstance(f, dict)]
    )
    rows = []
    for i, f in enumerate(src):
        idx = integer(f.get("fault"))
        step = integer(f.get("injected_step"))
        lost = integer(f.get("steps_lost"))
        rows.append(
            [
                str(i if idx is None else idx),
                str(f.get("kind") or DASH),
                str(f.get("class") or failure_class(str(f.get("kind"))) or DASH),
                str(f.get("target") or DASH),
                DASH if step is None else str(step),
                seconds(f.get("detect_s")),
                seconds(f.get("replan_s")),
                seconds(f.get("state_copy_s")),
                DASH if lost is None else str(lost),
                yes_no(f.get("absorbed")),
            ]
        )
    return rows, derived


def fault_table_html(data: RunData) -> str:
    """The fault table, with a note when its timings are approximations from events."""
    rows, derived = fault_rows(data)
    if not rows:
        return '<p class="note">No faults were injected in this run.</p>'
    note = (
        '<p class="note">The summary has no fault list (an older or interrupted run): these '
        "rows are reconstructed from events.jsonl, and their timings are approximate.</p>"
        if derived
        else ""
    )
    return table(FAULT_HEADERS, rows, "faults") + note


def decision_rows(data: RunData) -> list[list[str]]:
    """Decision-log entries (quarantines) from events, or the summary's list if no events."""
    src = [e for e in data.events if e.get("event") == ev.DECISION]
    if not src and isinstance(data.summary.get("decisions"), list):
        src = [d for d in data.summary["decisions"] if isinstance(d, dict)]
    rows = []
    for d in src:
        parts = ev.decision_parts(d)
        part_text = ", ".join(map(str, parts)) if parts else DASH
        samples = d.get("samples")
        sample_text = (
            f"{len(samples)}: " + short(", ".join(map(str, samples)), 60)
            if isinstance(samples, list)
            else str(samples if samples is not None else DASH)
        )
        slots = d.get("slots")
        slot = integer(d.get("slot"))
        slot_text = (
            ", ".join(map(str, slots))
            if isinstance(slots, list)
            else (DASH if slot is None else str(slot))
        )
        step = integer(d.get("step"))
        rows.append(
            [
                DASH if step is None else str(step),
                str(d.get("kind") or DASH),
                part_text,
                sample_text,
                slot_text,
                str(d.get("reason") or DASH),
            ]
        )
    return rows


def decision_table_html(data: RunData) -> str:
    """The decision log, or a line saying it is empty."""
    rows = decision_rows(data)
    if not rows:
        return '<p class="note">The decision log is empty: no dataset part was quarantined.</p>'
    return table(("step", "kind", "parts", "samples", "slots", "reason"), rows, "decisions")


# Keys shown as the event's own columns; everything else goes into "details".
_EVENT_SKIP = {"t", "event"}


def event_details(e: dict[str, Any]) -> str:
    """A one-line ``key=value`` summary of an event's payload, long values cut."""
    parts = []
    for k, v in e.items():
        if k in _EVENT_SKIP:
            continue
        text = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"), default=str)
        parts.append(f"{k}={short(str(text), 80)}")
    return " ".join(parts)


def event_rows(data: RunData) -> list[list[str]]:
    """Every event with its time relative to the first event."""
    t0 = next((num(e.get("t")) for e in data.events if num(e.get("t")) is not None), None)
    rows = []
    for e in data.events:
        t = num(e.get("t"))
        rel = DASH if t is None or t0 is None else f"{t - t0:+.3f}"
        rows.append([rel, str(e.get("event") or DASH), event_details(e)])
    return rows


def event_table_html(data: RunData) -> str:
    """All events in a collapsible table (open when short)."""
    rows = event_rows(data)
    if not rows:
        return '<p class="note">No events were recorded.</p>'
    opened = " open" if len(rows) <= 60 else ""
    return (
        f"<details{opened}><summary>{len(rows)} events</summary>"
        + table(("t (s)", "event", "details"), rows, "events")
        + "</details>"
    )
