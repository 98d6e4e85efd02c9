"""Small SVG primitives: scales, ticks, axes, escaped text.

Hand-written rather than a plotting library so the report needs nothing but the
standard library and stays a single self-contained file. It draws what the report
needs (lines, rectangles, vertical markers) and nothing more; it is no general
plotting toolkit. Every builder returns a string of well-formed XML, so tests can
parse it with ``xml.etree``.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Plot geometry shared by every per-step chart, so their x axes line up on the page.
WIDTH = 960
MARGIN_LEFT = 64
MARGIN_RIGHT = 16


def esc(text: object) -> str:
    """Escape any value for HTML text, attribute values and SVG (XML) alike."""
    return html.escape(str(text), quote=True)


def fmt(value: float) -> str:
    """A coordinate with two decimals, trailing zeros dropped: compact, stable output."""
    s = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if s == "-0" else s


def short(text: str, limit: int) -> str:
    """Cut ``text`` to ``limit`` characters with an ellipsis; full text goes in a <title>."""
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "…"


@dataclass(frozen=True)
class Linear:
    """Maps a data interval onto a pixel interval (either may be reversed)."""

    d0: float
    d1: float
    r0: float
    r1: float

    def __call__(self, v: float) -> float:
        if self.d1 == self.d0:
            return (self.r0 + self.r1) / 2
        return self.r0 + (v - self.d0) * (self.r1 - self.r0) / (self.d1 - self.d0)


@dataclass(frozen=True)
class Log10:
    """A log-10 scale; values at or below zero are clamped to the domain's low end."""

    d0: float
    d1: float
    r0: float
    r1: float

    def __call__(self, v: float) -> float:
        lo, hi = math.log10(self.d0), math.log10(self.d1)
        x = math.log10(max(v, self.d0))
        if hi == lo:
            return (self.r0 + self.r1) / 2
        return self.r0 + (x - lo) * (self.r1 - self.r0) / (hi - lo)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (steps of 1, 2 or 5 x 10^k) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        return [lo]
    raw = (hi - lo) / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    v = first
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 12))
        v += step
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    """Ticks at 1, 2 and 5 x 10^k within [lo, hi] (only powers of ten if there are many)."""
    if lo <= 0 or hi <= 0 or not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    k0, k1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    mults = (1,) if k1 - k0 > 4 else (1, 2, 5)
    ticks = [m * 10.0**k for k in range(k0, k1 + 1) for m in mults]
    return [t for t in ticks if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]


def tick_label(v: float) -> str:
    """A short human label for an axis tick."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6 or a < 1e-3:
        return f"{v:.0e}"
    if a >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def step_scale(steps: Iterable[int], width: int = WIDTH) -> Linear:
    """The shared x scale of all per-step charts: half a step of padding on each side."""
    s = list(steps)
    lo, hi = (min(s), max(s)) if s else (0, 1)
    return Linear(lo - 0.5, hi + 0.5, MARGIN_LEFT, width - MARGIN_RIGHT)


def x_axis(x: Linear, y_px: float, label: str = "step") -> str:
    """Integer step ticks along the bottom of a chart."""
    lo, hi = x.d0 + 0.5, x.d1 - 0.5
    ticks = [t for t in nice_ticks(lo, hi, 8) if float(t).is_integer()] or [lo]
    parts = [
        f'<line class="axis" x1="{fmt(x.r0)}" y1="{fmt(y_px)}" x2="{fmt(x.r1)}" y2="{fmt(y_px)}"/>'
    ]
    for t in ticks:
        px = fmt(x(t))
        parts.append(
            f'<line class="tick" x1="{px}" y1="{fmt(y_px)}" x2="{px}" y2="{fmt(y_px + 4)}"/>'
            f'<text class="tick-label" x="{px}" y="{fmt(y_px + 16)}" '
            f'text-anchor="middle">{esc(tick_label(t))}</text>'
        )
    parts.append(
        f'<text class="axis-label" x="{fmt(x.r1)}" y="{fmt(y_px + 30)}" '
        f'text-anchor="end">{esc(label)}</text>'
    )
    return "".join(parts)


def y_axis(y: Linear | Log10, ticks: Sequence[float], x_px: float, x_end: float) -> str:
    """Tick labels on the left and light grid lines across the plot."""
    parts = []
    for t in ticks:
        py = fmt(y(t))
        parts.append(
            f'<line class="grid" x1="{fmt(x_px)}" y1="{py}" x2="{fmt(x_end)}" y2="{py}"/>'
            f'<text class="tick-label" x="{fmt(x_px - 6)}" y="{py}" text-anchor="end" '
            f'dominant-baseline="middle">{esc(tick_label(t))}</text>'
        )
    return "".join(parts)


def svg_open(width: int, height: int, title: str, css_class: str) -> str:
    """The root element, with an accessible title.

    No ``xmlns``: inline SVG in HTML5 does not need it, and leaving it out keeps the page
    free of any ``http://`` string, which the self-containment test checks for.
    """
    return (
        f'<svg class="{esc(css_class)}" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{esc(title)}"><title>{esc(title)}</title>'
    )


def polyline_path(points: Sequence[tuple[float, float]], breaks: set[int]) -> str:
    """An SVG path ``d`` through pixel points, lifting the pen before each index in ``breaks``."""
    out = []
    for i, (px, py) in enumerate(points):
        out.append(("M" if i == 0 or i in breaks else "L") + f"{fmt(px)} {fmt(py)}")
    return "".join(out)
