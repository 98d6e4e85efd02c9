"""``perdure report``: a self-contained HTML report of a run directory.

The report reads ``metrics.jsonl``, ``events.jsonl``, ``summary.json`` and
``config.json`` and draws loss, step time, slot assignment and the fault and decision
tables as inline SVG and HTML: one file, no scripts, no network.
"""

from perdure.report.load import RunData, load_run
from perdure.report.page import REPORT_NAME, render_html, write_report

__all__ = ["REPORT_NAME", "RunData", "load_run", "render_html", "write_report"]
