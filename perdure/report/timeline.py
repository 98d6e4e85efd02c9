"""A compact event timeline: one lane per kind of happening, against wall time.

Per-step charts cannot show what happens between steps (detection, re-planning,
a replacement starting), so this chart uses seconds since the first event instead.
Events in a lane that fall within a pixel of each other overlap; each has its own
tooltip, and the full list is in the event table below the chart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from perdure import events as ev
from perdure.report.load import num
from perdure.report.svg import (
    MARGIN_RIGHT,
    WIDTH,
    Linear,
    esc,
    fmt,
    nice_ticks,
    short,
    svg_open,
    tick_label,
)

# lane name -> event kinds; order is top to bottom. Unknown kinds go to "other".
LANES: tuple[tuple[str, frozenset[str]], ...] = (
    ("run", frozenset({ev.RUN_START, ev.COORDINATOR_UP, ev.WORKER_DONE, ev.RUN_END})),
    ("fault", frozenset({ev.FAULT_INJECTED, ev.FAULT_ENDED})),
    (
        "failure",
        frozenset(
            {ev.COLLECTIVE_FAILED, ev.PROCESS_EXIT, ev.CHECKPOINT_FAILED, ev.CHECKPOINT_ABANDONED}
        ),
    ),
    ("membership", frozenset({ev.JOIN, ev.LEAVE, ev.EPOCH_ANNOUNCED, ev.EPOCH_STARTED})),
    ("recovery", frozenset({ev.REPLACEMENT_STARTED, ev.STATE_RECEIVED})),
    ("decision", frozenset({ev.DECISION})),
    ("checkpoint", frozenset({ev.CHECKPOINT_SAVED})),
)
# Wider than the per-step charts' margin: lane names are longer than tick labels, and
# this chart's x axis is seconds, so it need not line up with them.
MARGIN_LEFT = 92


def lane_of(kind: str) -> str:
    """The lane an event kind is drawn in."""
    for name, kinds in LANES:
        if kind in kinds:
            return name
    return "other"


def _tooltip(e: dict[str, Any], rel: float) -> str:
    bits = [f"{rel:+.3f} s {e.get('event')}"]
    for key in ("worker", "target", "kind", "epoch", "step", "start_step", "reason", "error"):
        if key in e and e[key] not in (None, ""):
            bits.append(f"{key}={short(str(e[key]), 100)}")
    return " ".join(bits)


def timeline_chart(events: Sequence[dict[str, Any]], row_h: int = 20) -> str:
    """Events as ticks in lanes over seconds since the first timed event."""
    timed = [(num(e.get("t")), e) for e in events]
    pts = [(t, e) for t, e in timed if t is not None]
    used = [name for name, _ in LANES if any(lane_of(str(e.get("event"))) == name for _, e in pts)]
    if any(lane_of(str(e.get("event"))) == "other" for _, e in pts):
        used.append("other")
    top = 28
    height = top + max(len(used), 1) * row_h + 44
    title = "Event timeline (seconds since the first event)"
    out = [svg_open(WIDTH, height, title, "chart timeline")]
    out.append(f'<text class="chart-title" x="{MARGIN_LEFT}" y="14">{esc(title)}</text>')
    if not pts:
        out.append(f'<text class="empty" x="{WIDTH // 2}" y="{top + 10}">no events</text></svg>')
        return "".join(out)
    t0 = min(t for t, _ in pts)
    span = max(t for t, _ in pts) - t0
    x = Linear(0.0, span or 1.0, MARGIN_LEFT, WIDTH - MARGIN_RIGHT)
    for i, name in enumerate(used):
        y0 = top + i * row_h
        out.append(
            f'<g class="lane lane-{esc(name)}" data-lane="{esc(name)}">'
            f'<line class="grid" x1="{fmt(x.r0)}" y1="{fmt(y0 + row_h / 2)}" '
            f'x2="{fmt(x.r1)}" y2="{fmt(y0 + row_h / 2)}"/>'
            f'<text class="tick-label" x="{fmt(x.r0 - 6)}" y="{fmt(y0 + row_h / 2)}" '
            f'text-anchor="end" dominant-baseline="middle">{esc(name)}</text>'
        )
        for t, e in pts:
            if lane_of(str(e.get("event"))) != name:
                continue
            px = fmt(x(t - t0))
            out.append(
                f'<rect class="event ev-{esc(e.get("event"))}" data-event="{esc(e.get("event"))}" '
                f'x="{px}" y="{y0 + 3}" width="3" height="{row_h - 6}">'
                f"<title>{esc(_tooltip(e, t - t0))}</title></rect>"
            )
        out.append("</g>")
    y_axis_px = top + len(used) * row_h
    out.append(
        f'<line class="axis" x1="{fmt(x.r0)}" y1="{y_axis_px}" x2="{fmt(x.r1)}" y2="{y_axis_px}"/>'
    )
    for tk in nice_ticks(0.0, span or 1.0, 8):
        px = fmt(x(tk))
        out.append(
            f'<line class="tick" x1="{px}" y1="{y_axis_px}" x2="{px}" y2="{y_axis_px + 4}"/>'
            f'<text class="tick-label" x="{px}" y="{y_axis_px + 16}" text-anchor="middle">'
            f"{esc(tick_label(tk))}</text>"
        )
    out.append(
        f'<text class="axis-label" x="{fmt(x.r1)}" y="{y_axis_px + 30}" '
        f'text-anchor="end">seconds</text></svg>'
    )
    return "".join(out)
