"""Assemble the report page and write it.

The page is one HTML file: inline CSS, inline SVG, no script, no external reference of
any kind, so it opens from a laptop, a CI artifact or an air-gapped cluster alike, and
renders without console errors because there is no code to raise any. Tooltips are SVG
``<title>`` elements, which browsers show on hover without JavaScript.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from perdure.report.charts import (
    eval_charts,
    loss_chart,
    slot_chart,
    step_time_chart,
    train_charts,
)
from perdure.report.load import RunData, epoch_marks, fault_marks, load_run
from perdure.report.svg import esc
from perdure.report.tables import (
    decision_table_html,
    event_table_html,
    fault_table_html,
    header_html,
)
from perdure.report.timeline import timeline_chart

REPORT_NAME = "report.html"

CSS = """
:root { color-scheme: light; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
  margin: 0 auto; padding: 16px 24px 48px; max-width: 1000px; background: #fff; }
h1 { font-size: 22px; margin: 8px 0 4px; }
h2 { font-size: 17px; margin: 28px 0 6px; border-bottom: 1px solid #ddd; padding-bottom: 3px; }
p.note { color: #666; font-size: 13px; margin: 4px 0; }
p.warn { color: #8a4b00; background: #fff4e0; padding: 6px 10px; border-radius: 4px; }
dl.facts { display: grid; grid-template-columns: repeat(auto-fill, minmax(220px, 1fr));
  gap: 6px 18px; margin: 10px 0; }
dl.facts div { min-width: 0; }
dl.facts dt { color: #666; font-size: 12px; }
dl.facts dd { margin: 0; font-weight: 600; overflow-wrap: anywhere; }
dl.facts dd.ok { color: #1a7f37; } dl.facts dd.bad { color: #c62828; }
table { border-collapse: collapse; font-size: 13px; width: 100%; margin: 6px 0; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 3px 8px; text-align: left;
  vertical-align: top; }
th { background: #f6f6f6; font-weight: 600; }
table.events td:nth-child(3) { font-family: ui-monospace, monospace; font-size: 12px;
  overflow-wrap: anywhere; }
summary { cursor: pointer; color: #444; }
pre { font-size: 12px; background: #f8f8f8; padding: 8px; overflow-x: auto; }
svg.chart { display: block; max-width: 100%; height: auto; margin: 8px 0; }
svg text { font: 11px system-ui, sans-serif; fill: #444; }
svg .chart-title { font-size: 13px; font-weight: 600; fill: #222; }
svg .axis-label { fill: #666; }
svg .axis, svg .tick { stroke: #888; stroke-width: 1; }
svg .grid { stroke: #eee; stroke-width: 1; }
svg .series { fill: none; stroke: #1f6fb4; stroke-width: 1.4; }
svg .series.raw { stroke: #9cc3e6; stroke-width: 1; }
svg .series.smooth { stroke: #1f4f8f; stroke-width: 1.8; }
svg.step-time .series.raw { stroke: #c4c4c4; }
svg.step-time .series.smooth { stroke: #444; stroke-width: 1.6; }
svg .marker line { stroke-width: 1.2; stroke-dasharray: 4 3; }
svg .marker.fault line { stroke: #d62728; } svg .marker.fault text { fill: #b71c1c; }
svg .marker.membership line { stroke: #7b4fd6; }
svg .marker.membership text { fill: #5b2fb6; }
svg .marker text { font-size: 10.5px; font-weight: 600; }
svg .strip-bg { fill: #f4f4f4; }
svg .slot-count { font-size: 10px; }
svg .empty { fill: #999; }
svg .event { fill: #777; }
svg .lane-fault .event { fill: #d62728; } svg .lane-failure .event { fill: #ff7f0e; }
svg .lane-membership .event { fill: #7b4fd6; } svg .lane-recovery .event { fill: #2ca02c; }
svg .lane-decision .event { fill: #8c564b; } svg .lane-checkpoint .event { fill: #1f77b4; }
footer { margin-top: 36px; color: #888; font-size: 12px; }
"""


def config_html(data: RunData) -> str:
    """The run config as indented JSON in a collapsed block (it is long and rarely needed)."""
    if not data.config:
        return '<p class="note">No config.json in the run directory.</p>'
    text = json.dumps(data.config, indent=2, sort_keys=False, default=str)
    return f"<details><summary>config.json</summary><pre>{esc(text)}</pre></details>"


def _eval_section(data: RunData) -> list[str]:
    """The evaluations on the held-out data set (none logged: no section)."""
    if not data.evals:
        return []
    last = ", ".join(
        f"eval/{name} = {pts[-1][1]:.6g} (after step {pts[-1][0]})"
        for name, pts in sorted(data.evals.items())
    )
    return [
        "<h2>Evaluation</h2>",
        f'<p class="note">Last: {esc(last)}.</p>',
        eval_charts(data.evals, [p.step for p in data.metrics]),
    ]


def _train_section(data: RunData) -> list[str]:
    """The task's own training metrics (``Task.metrics``; none logged: no section)."""
    if not data.train:
        return []
    last = ", ".join(
        f"train/{name} = {pts[-1][1]:.6g} (step {pts[-1][0]})"
        for name, pts in sorted(data.train.items())
    )
    return [
        "<h2>Training metrics</h2>",
        f'<p class="note">Last: {esc(last)}.</p>',
        train_charts(data.train, [p.step for p in data.metrics]),
    ]


def render_html(data: RunData) -> str:
    """The whole report page for parsed run data; a pure function of ``data``."""
    faults = fault_marks(data.summary, data.events)
    epochs = epoch_marks(data.events)
    warn = []
    if data.missing_files:
        warn.append("missing: " + ", ".join(data.missing_files))
    if data.skipped_lines:
        warn.append(
            "unreadable lines skipped: "
            + ", ".join(f"{k} ({v})" for k, v in sorted(data.skipped_lines.items()))
        )
    warn_html = f'<p class="warn">{esc("; ".join(warn))}</p>' if warn else ""
    title = f"perdure report: {data.run_dir.name or data.run_dir}"
    sections = [
        f"<h1>{esc(title)}</h1>",
        header_html(data),
        warn_html,
        "<h2>Loss</h2>",
        loss_chart(data.metrics, faults),
        *_train_section(data),
        *_eval_section(data),
        "<h2>Step time and membership</h2>",
        step_time_chart(data.metrics, epochs),
        '<p class="note">Markers: the first step of a new membership epoch, with its '
        "number of workers in brackets; hover for the members and the reason.</p>",
        "<h2>Slot assignment</h2>",
        '<p class="note">Each strip is one worker; its colour is the number of slots it '
        "computed at that step. The global batch and its slots never change; only who "
        "computes them does.</p>",
        slot_chart(data.metrics, epochs),
        "<h2>Faults</h2>",
        fault_table_html(data),
        "<h2>Decision log</h2>",
        decision_table_html(data),
        "<h2>Events</h2>",
        timeline_chart(data.events),
        event_table_html(data),
        "<h2>Config</h2>",
        config_html(data),
        "<footer>Written by <code>perdure report</code>. Self-contained: no scripts, "
        "no external resources.</footer>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head>"
        f'<body><main id="report">{"".join(sections)}</main></body></html>\n'
    )


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``RUN_DIR/report.html``).

    The file is written to a temporary name and renamed, so a reader never sees half a
    report. Raises ``FileNotFoundError`` if ``run_dir`` is not a directory; anything
    inside it may be missing or damaged, and the report says so.
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"run directory not found: {root}")
    target = Path(out) if out is not None else root / REPORT_NAME
    page = render_html(load_run(root)).encode("utf-8", errors="replace")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(page)
        # mkstemp makes 0600, and a run writes its files under umask 077 (launch.api's
        # private_files); a report is for sharing (another account, a web server): 0644.
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target.resolve()
