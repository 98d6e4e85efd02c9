"""What ``perdure sim`` prints and writes: tables, a JSON record and plots.

Plots are PNGs drawn with matplotlib when it is installed (``requirements-bench.txt``),
else standalone SVGs drawn with the report's own primitives (``perdure.report.svg``), so
that a plot is written on any machine the simulator runs on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perdure.report.svg import Linear, Log10, esc, fmt, log_ticks, nice_ticks, tick_label
from perdure.sim.run import Summary
from perdure.sim.steptime import STEP_PARTS
from perdure.sim.sweep import Sweep
from perdure.sim.validate import TOLERANCE, Row

COLOURS = {
    "perdure": "#1f77b4",
    "perdure/chain": "#9ecae1",
    "perdure/exact_flat": "#6baed6",
    "perdure/exact_hier": "#08519c",
    "perdure/exact_hier/streamed": "#08519c",
    "perdure/exact_hier/bucketed": "#3182bd",
    "perdure/exact_hier/last_slot": "#c6dbef",
    "torchrun": "#d62728",
    "torchft": "#2ca02c",
}


DILOCO_COLOURS = {
    "10": ("#fdae6b", "#e6550d", "#fdd0a2", "#a63603"),
    "50": ("#bcbddc", "#756bb1", "#dadaeb", "#54278f"),
    "200": ("#c7e9c0", "#74c476", "#e5f5e0", "#238b45"),
}
"""DiLoCo's rows: a hue by H (oranges, purples, greens), a shade by precision and
overlap (fp32, int8, fp32/overlap, int8/overlap); other H: grey."""


def colour(label: str) -> str:
    if label.startswith("diloco/H"):
        parts = label.split("/")
        shades = DILOCO_COLOURS.get(parts[1][1:])
        if shades is None:
            return "#555555"
        return shades[(parts[2] == "int8") + 2 * (parts[-1] == "overlap")]
    return COLOURS.get(label, "#555555")


def goodput_table(rows: Sequence[Summary], days: float, seeds: int) -> str:
    w = max([18, *(len(r.policy) for r in rows)])
    lines = [
        f"goodput over {days:g} days, {seeds} seeds (mean, 5th-95th percentile); "
        "efficiency: the same against compute alone",
        f"{'policy':{w}s} {'goodput':>8s} {'interval':>17s} {'efficiency':>10s} "
        f"{'step s':>7s} {'failures':>8s} {'restarts':>8s}",
    ]
    for r in rows:
        lines.append(
            f"{r.policy:{w}s} {r.goodput:8.4f} [{r.low:.4f}, {r.high:.4f}] {r.efficiency:10.4f} "
            f"{r.step_s:7.3f} {r.failures:8.1f} {r.restarts:8.1f}"
        )
    return "\n".join(lines)


def step_table(rows: Sequence[Summary], memory: str) -> str:
    """Each policy's fault-free step by dimension, and what a GPU holds."""
    w = max([18, *(len(r.policy) for r in rows)])
    lines = [
        f"step by dimension, s (full strength); memory per GPU: {memory}",
        f"{'policy':{w}s} " + " ".join(f"{p:>9s}" for p in STEP_PARTS) + f" {'step':>9s}",
    ]
    for r in rows:
        if not r.step_parts:
            continue
        cells = " ".join(f"{r.step_parts.get(p, 0.0):9.3f}" for p in STEP_PARTS)
        lines.append(f"{r.policy:{w}s} {cells} {sum(r.step_parts.values()):9.3f}")
    return "\n".join(lines)


def throughput_table(rows: Sequence[Summary], sync: str) -> str:
    """Tokens a second and bytes across regions per token, each against the synchronous
    perdure row ``sync``: the sync-vs-DiLoCo comparison (throughput only)."""
    w = max([18, *(len(r.policy) for r in rows)])
    ref = next((r for r in rows if r.policy == sync), None)
    lines = [
        f"throughput and bytes across regions per token, against {sync} (the synchronous "
        "step); DiLoCo's loss per token differs from the synchronous step's and is NOT "
        "simulated: these are throughput, not quality",
        f"{'policy':{w}s} {'step s':>7s} {'tokens/s':>10s} {'x sync':>6s} {'efficiency':>10s} "
        f"{'goodput':>8s} {'cross B/token':>13s} {'x sync':>9s}",
    ]
    for r in rows:
        speed = r.tokens_per_s / ref.tokens_per_s if ref and ref.tokens_per_s else math.nan
        nbytes = (  # one region: nothing crosses
            f"{r.cross_bytes_per_token / ref.cross_bytes_per_token:9.5f}"
            if ref and ref.cross_bytes_per_token
            else f"{'-':>9s}"
        )
        lines.append(
            f"{r.policy:{w}s} {r.step_s:7.3f} {r.tokens_per_s:10.4g} {speed:6.3f} "
            f"{r.efficiency:10.4f} {r.goodput:8.4f} {r.cross_bytes_per_token:13.1f} {nbytes}"
        )
    return "\n".join(lines)


COST_ITEMS = ("detection", "wait", "reform", "copy", "startup", "load", "lost", "reduced")
"""The ledger's items in the order the cost table prints them (``policies.common.ITEMS``)."""


def cost_table(rows: Sequence[Summary]) -> str:
    """Where each policy's time goes: seconds per failure of each kind, by item, and the
    failures' and the checkpoints' share of the run."""
    w = max([18, *(len(r.policy) for r in rows)])
    head = f"{'policy':{w}s} {'failure':14s} {'n/run':>6s} " + " ".join(
        f"{i:>9s}" for i in COST_ITEMS
    )
    lines = [
        "cost per failure, seconds (items: docs/simulation.md); total: per failure, and "
        "x n/run as a share of the run",
        head + f" {'total':>9s} {'of run':>7s}",
    ]
    for r in rows:
        counts = r.counts
        run_s = r.outcomes[0].elapsed_s if r.outcomes else 0.0
        for kind, items in sorted(r.per_failure.items()):
            n = counts.get(kind, 0.0)
            total = sum(items.values())
            share = total * (n or 1.0) / run_s if run_s else 0.0
            cells = " ".join(f"{items.get(i, 0.0):9.1f}" for i in COST_ITEMS)
            lines.append(f"{r.policy:{w}s} {kind:14s} {n:6.1f} {cells} {total:9.1f} {share:7.2%}")
        ck = r.checkpoint_s
        blank = " ".join(f"{'':9s}" for _ in COST_ITEMS)
        share = ck / run_s if run_s else 0.0
        lines.append(f"{r.policy:{w}s} {'checkpoints':14s} {'':6s} {blank} {ck:9.1f} {share:7.2%}")
    return "\n".join(lines)


def validation_table(rows: Sequence[Row]) -> str:
    lines = [
        "validation: predicted against measured (measured: median [min, max] of repeats)",
        f"{'workload':9s} {'system':26s} {'metric':10s} {'predicted':>9s} "
        f"{'measured':>9s} {'range':>15s} {'diff':>7s}",
    ]
    for r in rows:
        mark = " in range" if r.in_range else ""
        if r.flagged:
            mark += f" > {TOLERANCE} (docs/simulation.md)"
        if r.note:
            mark += " (not comparable: see docs/simulation.md)"
        lines.append(
            f"{r.workload:9s} {r.system:26s} {r.metric:10s} {r.predicted:9.3f} "
            f"{r.measured:9.3f} [{r.low:6.3f},{r.high:6.3f}] {r.diff:+7.3f}{mark}"
        )
    return "\n".join(lines)


def sweep_table(s: Sweep) -> str:
    """Goodput at each value, and efficiency (against compute alone) after a slash."""
    w = max([18, *(len(p) for p in s.rows)])
    head = f"{'policy':{w}s} " + " ".join(f"{v:>15g}" for v in s.values)
    lines = [f"sweep: {s.label} (goodput / efficiency)", head]
    for policy, rows in s.rows.items():
        cells = " ".join(f"{r.goodput:7.4f}/{r.efficiency:.4f}" for r in rows)
        lines.append(f"{policy:{w}s} {cells}")
    return "\n".join(lines)


def record(
    summaries: Sequence[Summary], sweeps: Sequence[Sweep], validation: Sequence[Row]
) -> dict[str, Any]:
    """Everything printed, as JSON-ready data."""

    def summary(r: Summary) -> dict[str, Any]:
        return {
            "policy": r.policy,
            "goodput": r.goodput,
            "low": r.low,
            "high": r.high,
            "efficiency": r.efficiency,
            "step_s": r.step_s,
            "failures": r.failures,
            "restarts": r.restarts,
            "per_seed": [o.goodput for o in r.outcomes],
            "failures_per_run": r.counts,
            "seconds_per_failure": r.per_failure,
            "checkpoint_s": r.checkpoint_s,
            "step_parts": r.step_parts,
            "tokens_per_s": r.tokens_per_s,
            "cross_bytes_per_token": r.cross_bytes_per_token,
        }

    return {
        "goodput": [summary(r) for r in summaries],
        "sweeps": [
            {
                "name": s.name,
                "values": list(s.values),
                "rows": {p: [summary(r) for r in rows] for p, rows in s.rows.items()},
            }
            for s in sweeps
        ],
        "validation": [
            {
                "workload": r.workload,
                "system": r.system,
                "metric": r.metric,
                "predicted": r.predicted,
                "measured": r.measured,
                "low": r.low,
                "high": r.high,
                "diff": r.diff,
                "note": r.note,
            }
            for r in validation
        ],
    }


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def plot_sweep(s: Sweep, out_dir: Path) -> Path:
    """One sweep's goodput per policy (band: 5th-95th percentile over seeds)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _png(s, out_dir / f"sweep_{s.name}.png")
    except ImportError:
        path = out_dir / f"sweep_{s.name}.svg"
        path.write_text(svg_chart(s))
        return path


def _png(s: Sweep, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for policy, rows in s.rows.items():
        c = colour(policy)
        ax.plot(s.values, [getattr(r, s.metric) for r in rows], marker="o", color=c, label=policy)
        if s.metric == "goodput":
            lows, highs = [r.low for r in rows], [r.high for r in rows]
            ax.fill_between(s.values, lows, highs, color=c, alpha=0.15)
    if s.log_x:
        ax.set_xscale("log")
    ax.set_xlabel(s.label)
    ax.set_ylabel(s.metric)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def svg_chart(s: Sweep, width: int = 640, height: int = 400) -> str:
    """A standalone SVG of :func:`plot_sweep` (no plotting library)."""
    longest = max((len(p) for p in s.rows), default=0)
    left, right, top, bottom = 64, max(110, 40 + 7 * longest), 24, 48
    width += right - 110  # the legend's room: the plot keeps its width
    lo, hi = _extent(s)
    pad = (hi - lo) * 0.08 or 0.01
    y = Linear(lo - pad, hi + pad, height - bottom, top)
    x0, x1 = min(s.values), max(s.values)
    x: Linear | Log10
    if s.log_x:
        x = Log10(x0, x1 if x1 > x0 else x0 * 10, left, width - right)
        xticks = log_ticks(x0, x1) or list(s.values)
    else:
        x = Linear(x0, x1 if x1 > x0 else x0 + 1, left, width - right)
        xticks = list(s.values)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f"<title>{esc(s.metric + ' against ' + s.label)}</title>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for t in nice_ticks(lo - pad, hi + pad, 6):
        py = fmt(y(t))
        parts.append(
            f'<line x1="{left}" y1="{py}" x2="{width - right}" y2="{py}" stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{py}" text-anchor="end" dominant-baseline="middle">'
            f"{esc(tick_label(t))}</text>"
        )
    for t in xticks:
        px = fmt(x(t))
        parts.append(
            f'<text x="{px}" y="{height - bottom + 16}" text-anchor="middle">'
            f"{esc(tick_label(t))}</text>"
        )
    parts.append(
        f'<text x="{(left + width - right) / 2}" y="{height - 10}" text-anchor="middle">'
        f"{esc(s.label)}</text>"
        f'<text x="14" y="{top + (height - bottom - top) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {top + (height - bottom - top) / 2})">{esc(s.metric)}</text>'
    )
    for i, (policy, rows) in enumerate(s.rows.items()):
        parts.append(_series(colour(policy), rows, s.values, x, y, s.metric))
        ly = top + 16 * i
        c = colour(policy)
        parts.append(
            f'<line x1="{width - right + 10}" y1="{ly}" x2="{width - right + 30}" y2="{ly}" '
            f'stroke="{c}" stroke-width="2"/><text x="{width - right + 34}" y="{ly}" '
            f'dominant-baseline="middle">{esc(policy)}</text>'
        )
    parts.append("</svg>\n")
    return "".join(parts)


def _extent(s: Sweep) -> tuple[float, float]:
    vals = [getattr(r, s.metric) for rows in s.rows.values() for r in rows]
    if s.metric == "goodput":
        vals += [v for rows in s.rows.values() for r in rows for v in (r.low, r.high)]
    vals = [v for v in vals if math.isfinite(v)] or [0.0, 1.0]
    return min(vals), max(vals)


def _series(
    c: str, rows: Sequence[Summary], values: Sequence[float], x: Any, y: Linear, metric: str
) -> str:
    pts = [(x(v), y(getattr(r, metric))) for v, r in zip(values, rows, strict=True)]
    line = " ".join(f"{fmt(px)},{fmt(py)}" for px, py in pts)
    dots = "".join(f'<circle cx="{fmt(px)}" cy="{fmt(py)}" r="3" fill="{c}"/>' for px, py in pts)
    band = ""
    if metric == "goodput":
        top = [(x(v), y(r.high)) for v, r in zip(values, rows, strict=True)]
        bottom = [(x(v), y(r.low)) for v, r in zip(values, rows, strict=True)][::-1]
        poly = " ".join(f"{fmt(px)},{fmt(py)}" for px, py in top + bottom)
        band = f'<polygon points="{poly}" fill="{c}" fill-opacity="0.15"/>'
    return f'{band}<polyline points="{line}" fill="none" stroke="{c}" stroke-width="2"/>{dots}'
