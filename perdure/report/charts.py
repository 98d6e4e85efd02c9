"""The report's per-step charts as pure functions from parsed run data to SVG strings.

All per-step charts share one x scale (``svg.step_scale``) and width, so a fault marker
on the loss chart sits exactly above the re-slotting it caused on the slot chart.
Points are drawn one per committed step, without downsampling: a few thousand steps
make a path of some tens of kilobytes, which is fine; a run of millions of steps would
want bucketing, which is not done here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from perdure.report.load import EpochMark, FaultMark, StepPoint
from perdure.report.svg import (
    MARGIN_LEFT,
    WIDTH,
    Linear,
    Log10,
    esc,
    fmt,
    log_ticks,
    nice_ticks,
    polyline_path,
    short,
    step_scale,
    svg_open,
    x_axis,
    y_axis,
)

PLOT_TOP = 56  # room for the title and two staggered rows of marker labels
PLOT_BOTTOM_PAD = 40
LABEL_CHARS = 22

# Slot-count colours run from LIGHT (1 slot) to DARK (the run's most slots per worker),
# so the contrast is used whatever the slot count; 0 slots is the strip background.
LIGHT = (0xC6, 0xDB, 0xEF)
DARK = (0x08, 0x45, 0x94)


@dataclass(frozen=True)
class Marker:
    """A vertical line at a step, with a short label above the plot and a full tooltip."""

    step: int
    label: str
    tooltip: str
    kind: str  # CSS class: "fault" or "membership"


def fault_markers(faults: Sequence[FaultMark]) -> list[Marker]:
    """Markers for injected faults, labelled ``kind target``."""
    return [
        Marker(f.step, f.label, f"fault injected at step {f.step}: {f.label}", "fault")
        for f in faults
    ]


def epoch_markers(epochs: Sequence[EpochMark]) -> list[Marker]:
    """Markers for membership changes, labelled with the new membership epoch."""
    out = []
    for e in epochs:
        members = ", ".join(e.members)
        tip = f"membership epoch {e.epoch} from step {e.step}: [{members}]"
        if e.reason:
            tip += f"; {e.reason}"
        out.append(Marker(e.step, f"epoch {e.epoch} ({len(e.members)})", tip, "membership"))
    return out


def _markers_svg(markers: Sequence[Marker], x: Linear, y_top: float, y_bottom: float) -> str:
    """Vertical lines plus labels; labels alternate between two rows to limit overlap."""
    parts = []
    for i, m in enumerate(sorted(markers, key=lambda m: m.step)):
        if not (x.d0 <= m.step <= x.d1):
            continue
        px = fmt(x(m.step))
        row_y = y_top - 6 - (i % 2) * 14
        parts.append(
            f'<g class="marker {esc(m.kind)}" data-step="{m.step}" data-label="{esc(m.label)}">'
            f"<title>{esc(m.tooltip)}</title>"
            f'<line x1="{px}" y1="{fmt(row_y + 3)}" x2="{px}" y2="{fmt(y_bottom)}"/>'
            f'<text x="{px}" y="{fmt(row_y)}" text-anchor="middle">'
            f"{esc(short(m.label, LABEL_CHARS))}</text></g>"
        )
    return "".join(parts)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """A centred moving average (window shrinks at the ends); smooths noisy loss curves."""
    if window <= 1:
        return list(values)
    half = window // 2
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def series_chart(
    points: Sequence[tuple[int, float]],
    *,
    title: str,
    y_label: str,
    markers: Sequence[Marker] = (),
    all_steps: Sequence[int] = (),
    log_y: bool = False,
    smooth: bool = False,
    css_class: str = "chart",
    height: int = 260,
    gaps: bool = True,
) -> str:
    """A line of one value against step, with vertical markers.

    ``all_steps`` fixes the x domain (so charts align even if one series has gaps); the
    line is broken wherever steps are not consecutive. ``log_y`` suits step times, where
    a recovery step can be a hundred times the usual one. ``smooth`` adds a centred
    moving average over about 2% of the steps on top of the faint raw line. ``gaps``
    false: a series sampled every few steps (evaluations) is one line through its points.
    """
    domain_steps = list(all_steps) or [s for s, _ in points] or [0]
    x = step_scale(domain_steps)
    y_top, y_bottom = PLOT_TOP, height - PLOT_BOTTOM_PAD
    out = [svg_open(WIDTH, height, title, css_class)]
    out.append(
        f'<text class="chart-title" x="{MARGIN_LEFT}" y="14">{esc(title)}</text>'
        f'<text class="axis-label" x="{MARGIN_LEFT - 8}" y="{fmt(y_top - 30)}" '
        f'text-anchor="end">{esc(y_label)}</text>'
    )
    vals = [v for _, v in points if (v > 0 or not log_y)]
    if vals:
        lo, hi = min(vals), max(vals)
        y: Linear | Log10
        if log_y:
            lo, hi = (lo / 1.2, hi * 1.2) if lo != hi else (lo / 2, hi * 2)
            y = Log10(lo, hi, y_bottom, y_top)
            ticks = log_ticks(lo, hi) or [lo, hi]
        else:
            pad = (hi - lo) * 0.05 or abs(hi) * 0.1 or 1.0
            lo, hi = lo - pad, hi + pad
            y = Linear(lo, hi, y_bottom, y_top)
            ticks = nice_ticks(lo, hi, 5)
        out.append(y_axis(y, ticks, x.r0, x.r1))
        pts = [(s, v) for s, v in points if v > 0 or not log_y]
        breaks = {i for i in range(1, len(pts)) if gaps and pts[i][0] != pts[i - 1][0] + 1}
        px = [(x(s), y(v)) for s, v in pts]
        raw_class = "series raw" if smooth else "series"
        out.append(f'<path class="{raw_class}" d="{polyline_path(px, breaks)}"/>')
        if smooth and len(pts) >= 20:
            window = max(3, len(pts) // 50)
            sm = moving_average([v for _, v in pts], window)
            spx = [(x(s), y(v)) for (s, _), v in zip(pts, sm, strict=True)]
            out.append(f'<path class="series smooth" d="{polyline_path(spx, breaks)}"/>')
    else:
        out.append(
            f'<text class="empty" x="{fmt((x.r0 + x.r1) / 2)}" y="{fmt((y_top + y_bottom) / 2)}" '
            f'text-anchor="middle">no data</text>'
        )
    out.append(_markers_svg(markers, x, y_top, y_bottom))
    out.append(x_axis(x, y_bottom))
    out.append("</svg>")
    return "".join(out)


def loss_chart(metrics: Sequence[StepPoint], faults: Sequence[FaultMark]) -> str:
    """Loss against step, each injected fault marked at its step."""
    pts = [(p.step, p.loss) for p in metrics if p.loss is not None]
    return series_chart(
        [(s, v) for s, v in pts if v is not None],
        title="Loss by step (faults marked)",
        y_label="loss",
        markers=fault_markers(faults),
        all_steps=[p.step for p in metrics],
        smooth=True,
        css_class="chart loss",
    )


def eval_charts(evals: dict[str, list[tuple[int, float]]], all_steps: Sequence[int]) -> str:
    """One chart per evaluation metric against the step after which it was evaluated."""
    return "".join(
        series_chart(
            pts,
            title=f"eval/{name} on the held-out data set",
            y_label=name,
            all_steps=all_steps,
            css_class="chart eval",
            gaps=False,
        )
        for name, pts in sorted(evals.items())
    )


def train_charts(train: dict[str, list[tuple[int, float]]], all_steps: Sequence[int]) -> str:
    """One chart per task metric (``Task.metrics``) against the step."""
    return "".join(
        series_chart(
            pts,
            title=f"train/{name}",
            y_label=name,
            all_steps=all_steps,
            css_class="chart train",
            gaps=False,
        )
        for name, pts in sorted(train.items())
    )


def step_time_chart(metrics: Sequence[StepPoint], epochs: Sequence[EpochMark]) -> str:
    """Step wall time against step (log scale), each membership change marked."""
    pts = [(p.step, p.step_s) for p in metrics if p.step_s is not None]
    return series_chart(
        [(s, v) for s, v in pts if v is not None],
        title="Step time by step, log scale (membership changes marked)",
        y_label="seconds",
        markers=epoch_markers(epochs),
        all_steps=[p.step for p in metrics],
        log_y=True,
        smooth=True,
        css_class="chart step-time",
    )


def worker_order(metrics: Sequence[StepPoint]) -> list[str]:
    """Every worker that ever held slots, in order of first appearance in the chain."""
    seen: dict[str, None] = {}
    for p in metrics:
        for m in p.members:
            seen.setdefault(m, None)
    return list(seen)


def slot_runs(metrics: Sequence[StepPoint], worker: str) -> list[tuple[int, int, int]]:
    """``(first_step, last_step, slots)`` runs of a worker's slot count over consecutive steps.

    Steps where the worker is not a member are left out (they break a run), as are
    missing steps. Rows whose ``members`` and ``slots`` lengths differ are unreadable
    for this purpose and skipped.
    """
    runs: list[tuple[int, int, int]] = []
    for p in metrics:
        if len(p.members) != len(p.slots) or worker not in p.members:
            continue
        n = p.slots[p.members.index(worker)]
        if runs and runs[-1][1] == p.step - 1 and runs[-1][2] == n:
            runs[-1] = (runs[-1][0], p.step, n)
        else:
            runs.append((p.step, p.step, n))
    return runs


def slot_shade(n: int, max_n: int) -> float:
    """Where ``n`` slots sit between the lightest (1) and darkest (``max_n``) colour, 0..1."""
    if max_n <= 1:
        return 1.0
    return min(max((n - 1) / (max_n - 1), 0.0), 1.0)


def slot_colour(n: int, max_n: int) -> str:
    """Darker for more slots, interpolated linearly in RGB from LIGHT to DARK.

    A member holding 0 slots (possible when the planner moves all work off a slow
    worker) is white, unlike a non-member, which shows the grey strip background.
    """
    if n <= 0:
        return "#ffffff"
    f = slot_shade(n, max_n)
    r, g, b = (round(lo + (hi - lo) * f) for lo, hi in zip(LIGHT, DARK, strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def slot_chart(
    metrics: Sequence[StepPoint], epochs: Sequence[EpochMark] = (), row_h: int = 22
) -> str:
    """One strip per worker, coloured by how many slots it computed at each step.

    Re-slotting is visible as a colour change, a departure as a strip that stops, a
    replacement as a strip that starts. Counts are written inside runs wide enough to
    hold them; every run has a tooltip. Membership changes are marked as on the
    step-time chart.
    """
    workers = worker_order(metrics)
    max_n = max((n for p in metrics for n in p.slots), default=1)
    x = step_scale([p.step for p in metrics] or [0])
    top = PLOT_TOP
    height = top + max(len(workers), 1) * row_h + PLOT_BOTTOM_PAD + 18
    title = "Slots per worker by step (re-slotting)"
    out = [svg_open(WIDTH, height, title, "chart slots")]
    out.append(f'<text class="chart-title" x="{MARGIN_LEFT}" y="14">{esc(title)}</text>')
    for i, w in enumerate(workers):
        y0 = top + i * row_h
        out.append(
            f'<g class="slot-row" data-worker="{esc(w)}">'
            f'<rect class="strip-bg" x="{fmt(x.r0)}" y="{y0 + 2}" '
            f'width="{fmt(x.r1 - x.r0)}" height="{row_h - 4}"/>'
            f'<text class="tick-label" x="{fmt(x.r0 - 6)}" y="{fmt(y0 + row_h / 2)}" '
            f'text-anchor="end" dominant-baseline="middle">{esc(short(w, 10))}</text>'
        )
        for a, b, n in slot_runs(metrics, w):
            x0, x1 = x(a - 0.5), x(b + 0.5)
            tip = f"{w}: {n} slot{'s' if n != 1 else ''}, steps {a}–{b}"
            out.append(
                f'<rect class="slot-run" data-from="{a}" data-to="{b}" data-slots="{n}" '
                f'x="{fmt(x0)}" y="{y0 + 2}" width="{fmt(max(x1 - x0, 0.5))}" '
                f'height="{row_h - 4}" fill="{slot_colour(n, max_n)}">'
                f"<title>{esc(tip)}</title></rect>"
            )
            if x1 - x0 >= 14:
                colour = "#fff" if slot_shade(n, max_n) > 0.5 else "#222"
                out.append(
                    f'<text class="slot-count" x="{fmt((x0 + x1) / 2)}" '
                    f'y="{fmt(y0 + row_h / 2)}" text-anchor="middle" dominant-baseline="middle" '
                    f'fill="{colour}">{n}</text>'
                )
        out.append("</g>")
    if not workers:
        out.append(
            f'<text class="empty" x="{fmt((x.r0 + x.r1) / 2)}" y="{top + row_h / 2}" '
            f'text-anchor="middle">no slot data</text>'
        )
    y_bottom = top + max(len(workers), 1) * row_h
    out.append(_markers_svg(epoch_markers(epochs), x, top, y_bottom))
    out.append(x_axis(x, y_bottom))
    lx = x.r0
    ly = y_bottom + 40
    out.append(f'<text class="tick-label" x="{fmt(lx)}" y="{ly + 9}">slots:</text>')
    legend = list(range(1, max_n + 1))
    if len(legend) > 12:  # many slots per worker: a sample of the scale
        legend = sorted({1 + round(i * (max_n - 1) / 7) for i in range(8)})
    for i, n in enumerate(legend):
        bx = lx + 40 + i * 34
        out.append(
            f'<rect class="legend" x="{fmt(bx)}" y="{ly}" width="14" height="12" '
            f'fill="{slot_colour(n, max_n)}"/><text class="tick-label" x="{fmt(bx + 18)}" '
            f'y="{ly + 10}">{n}</text>'
        )
    out.append("</svg>")
    return "".join(out)
