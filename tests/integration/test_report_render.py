"""The report renders in headless Chromium without console errors (issue 7's bar).

Skips, saying why, where Debian's ``chromium`` is not installed
(``apt-get install -y chromium``). How it checks: a copy of the report gets a probe
script at the top of ``<head>`` that records ``window.onerror``, unhandled rejections,
failed resource loads and ``console.error``/``console.warn`` into a ``<pre>``, and on
``load`` writes the rendered size of every SVG chart. ``--dump-dom`` returns the DOM
after the load event, so the test reads both from it. Console messages logged before
the probe could hook in are caught from Chromium's own log on stderr (``CONSOLE`` lines).
The report itself is untouched: it has no script.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from perdure.report import write_report

# tests/ may or may not be a package (tests/__init__.py): import the fixtures either way.
try:
    from tests.unit.test_report_fixtures import make_run_dir
except ModuleNotFoundError:  # rootdir not on sys.path; pytest put tests/ there instead
    from test_report_fixtures import make_run_dir  # type: ignore[no-redef]

PROBE = """<script>
(function () {
  var errs = [];
  function note(kind, msg) {
    errs.push(kind + ": " + msg);
    var el = document.getElementById("__probe_errors");
    if (el) { el.textContent = errs.join("\\n"); }
  }
  window.onerror = function (m, src, line) { note("error", m + " @" + src + ":" + line); };
  window.addEventListener("unhandledrejection", function (e) { note("rejection", e.reason); });
  window.addEventListener("error", function (e) {
    if (e.target && e.target !== window) { note("resource", e.target.outerHTML.slice(0, 120)); }
  }, true);
  ["error", "warn"].forEach(function (k) {
    var orig = console[k];
    console[k] = function () { note("console." + k, Array.prototype.join.call(arguments, " "));
      return orig.apply(console, arguments); };
  });
  window.addEventListener("load", function () {
    var out = [];
    document.querySelectorAll("svg.chart").forEach(function (s) {
      var r = s.getBoundingClientRect();
      out.push({cls: s.getAttribute("class"), w: Math.round(r.width), h: Math.round(r.height),
                marks: s.querySelectorAll("g.marker").length,
                runs: s.querySelectorAll("rect.slot-run").length});
    });
    var pre = document.createElement("pre");
    pre.id = "__probe_layout";
    pre.textContent = JSON.stringify(out);
    document.body.appendChild(pre);
    var e = document.createElement("pre");
    e.id = "__probe_errors";
    e.textContent = errs.join("\\n");
    document.body.appendChild(e);
  });
})();
</script>"""


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip(
            "chromium not installed: the render test needs Debian's chromium "
            "(apt-get install -y chromium)"
        )
    return exe


def run_chromium(exe: str, page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [
        exe,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        *extra,
        page.as_uri(),
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=90, check=False)


def test_report_renders_without_console_errors(tmp_path: Path) -> None:
    exe = chromium()
    report = write_report(make_run_dir(tmp_path / "run"))
    html = report.read_text(encoding="utf-8")
    probed = tmp_path / "probed.html"
    probed.write_text(html.replace("<head>", "<head>" + PROBE, 1), encoding="utf-8")

    res = run_chromium(exe, probed, tmp_path / "profile", "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    console = [ln for ln in res.stderr.splitlines() if "CONSOLE" in ln]
    assert console == [], console

    errs = re.search(r'<pre id="__probe_errors">(.*?)</pre>', dom, flags=re.S)
    assert errs is not None, "the probe did not run: " + dom[-500:]
    assert errs.group(1).strip() == ""

    layout = re.search(r'<pre id="__probe_layout">(.*?)</pre>', dom, flags=re.S)
    assert layout is not None
    charts = {c["cls"].split()[1]: c for c in json.loads(layout.group(1))}
    assert set(charts) == {"loss", "step-time", "slots", "timeline"}
    for c in charts.values():
        assert c["w"] > 300 and c["h"] > 100, c  # laid out, not collapsed
    assert charts["loss"]["marks"] == 1  # the kill
    assert charts["step-time"]["marks"] == 2  # two membership changes
    assert charts["slots"]["runs"] == 6
    assert '<table class="faults">' in dom


def test_report_screenshot_is_drawn(tmp_path: Path) -> None:
    """The page paints: a screenshot is written and is not a blank image."""
    exe = chromium()
    report = write_report(make_run_dir(tmp_path / "run"))
    shot = tmp_path / "shot.png"
    res = run_chromium(
        exe, report, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1040,1400"
    )
    assert res.returncode == 0, res.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # a blank white 1040x1400 PNG is a few kB
