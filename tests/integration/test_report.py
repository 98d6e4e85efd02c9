"""Unit tests of the report: SVG builders, tables, defensive loading, the written file."""

# mypy: disable-error-code="no-redef"

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from perdure.report import load_run, render_html, write_report
from perdure.report.charts import (
    loss_chart,
    moving_average,
    slot_chart,
    slot_runs,
    step_time_chart,
    worker_order,
)
from perdure.report.load import (
    FaultMark,
    epoch_marks,
    fault_marks,
    parse_metrics,
    read_jsonl,
)
from perdure.report.svg import esc, log_ticks, nice_ticks, step_scale, tick_label
from perdure.report.tables import fault_rows, header_facts
from perdure.report.timeline import timeline_chart

# tests/ may or may not be a package (tests/__init__.py): import the fixtures either way.
try:
    from tests.unit.test_report_fixtures import (
        EPOCH1_STEP,
        EPOCH2_STEP,
        KILL_STEP,
        STEPS,
        SUMMARY,
        events_rows,
        make_run_dir,
        metrics_rows,
    )
except ModuleNotFoundError:  # rootdir not on sys.path; pytest put tests/ there instead
    from test_report_fixtures import (
        EPOCH1_STEP,
        EPOCH2_STEP,
        KILL_STEP,
        STEPS,
        SUMMARY,
        events_rows,
        make_run_dir,
        metrics_rows,
    )  # type: ignore[no-redef]


def parse(svg: str) -> ET.Element:
    """Parse an SVG string; fails the test if it is not well-formed XML."""
    return ET.fromstring(svg)


def with_class(root: ET.Element, cls: str) -> list[ET.Element]:
    return [e for e in root.iter() if cls in (e.get("class") or "").split()]


def metrics() -> list:
    return parse_metrics(metrics_rows())


# --- scales and ticks -------------------------------------------------------------


def test_nice_ticks_are_round_and_cover_range() -> None:
    ticks = nice_ticks(0.3, 9.7, 5)
    assert ticks == [2.0, 4.0, 6.0, 8.0]
    assert nice_ticks(0, 100, 5) == [0, 20, 40, 60, 80, 100]
    assert nice_ticks(1.0, 1.0) == [1.0]
    assert nice_ticks(math.nan, 1.0) == []


def test_log_ticks() -> None:
    assert log_ticks(0.004, 0.06) == [0.005, 0.01, 0.02, 0.05]
    assert log_ticks(0, 1) == []


def test_moving_average_is_centred_and_keeps_length() -> None:
    assert moving_average([0, 0, 3, 0, 0], 3) == [0, 1, 1, 1, 0]
    assert moving_average([1.0, 2.0], 1) == [1.0, 2.0]


# --- per-step charts ---------------------------------------------------------------


def test_loss_chart_marks_faults_at_their_steps() -> None:
    ms = metrics()
    faults = [FaultMark(KILL_STEP, "kill", "a-1"), FaultMark(22, "delay", "b-0")]
    root = parse(loss_chart(ms, faults))
    x = step_scale([p.step for p in ms])
    marks = with_class(root, "fault")
    assert [int(m.get("data-step") or -1) for m in marks] == [KILL_STEP, 22]
    for m, f in zip(marks, faults, strict=True):
        line = m.find("line")
        assert line is not None
        assert float(line.get("x1") or "nan") == round(x(f.step), 2)
        assert line.get("x1") == line.get("x2")  # vertical
        assert m.get("data-label") == f.label
        texts = [t.text for t in m.iter("text")]
        assert texts == [f.label]


def test_loss_chart_line_spans_all_steps_and_breaks_at_gaps() -> None:
    rows = [r for r in metrics_rows() if r["step"] not in (5, 6)]
    root = parse(loss_chart(parse_metrics(rows), []))
    raw = with_class(root, "raw")[0].get("d") or ""
    assert raw.count("M") == 2  # one pen lift, at the gap
    assert raw.count("L") == STEPS - 2 - 2
    assert with_class(root, "smooth")


def test_step_time_chart_marks_membership_changes_not_the_start() -> None:
    ms = metrics()
    epochs = epoch_marks(events_rows())
    assert [e.step for e in epochs] == [EPOCH1_STEP, EPOCH2_STEP]
    root = parse(step_time_chart(ms, epochs))
    x = step_scale([p.step for p in ms])
    marks = with_class(root, "membership")
    assert [int(m.get("data-step") or -1) for m in marks] == [EPOCH1_STEP, EPOCH2_STEP]
    line = marks[0].find("line")
    assert line is not None and float(line.get("x1") or "nan") == round(x(EPOCH1_STEP), 2)
    assert "epoch 1" in (marks[0].get("data-label") or "")
    tip = marks[0].find("title")
    assert tip is not None and "a-1 left" in (tip.text or "")


def test_step_time_chart_is_log_scaled() -> None:
    """The ticks are the 1-2-5 decades of the padded range of step times, each at a
    height linear in its logarithm (equal ratios, equal distances)."""
    ms = metrics()
    times = [p.step_s for p in ms if p.step_s is not None]
    ticks = log_ticks(min(times) / 1.2, max(times) * 1.2)
    root = parse(step_time_chart(ms, []))
    labels = [e for e in with_class(root, "tick-label") if e.get("text-anchor") == "end"]  # y
    assert [e.text for e in labels] == [tick_label(v) for v in ticks] and len(ticks) >= 3
    ys = [float(e.get("y") or "nan") for e in labels]
    per_decade = (ys[1] - ys[0]) / math.log10(ticks[1] / ticks[0])
    assert per_decade < 0  # up the page as the time grows
    for v, y in zip(ticks, ys, strict=True):
        assert y == pytest.approx(ys[0] + per_decade * math.log10(v / ticks[0]), abs=0.02)


def test_charts_share_one_x_scale() -> None:
    ms = metrics()
    a = parse(loss_chart(ms, [FaultMark(EPOCH1_STEP, "kill", "a-1")]))
    b = parse(slot_chart(ms, epoch_marks(events_rows())))
    xa = with_class(a, "marker")[0].find("line")
    xb = with_class(b, "marker")[0].find("line")
    assert xa is not None and xb is not None and xa.get("x1") == xb.get("x1")


def test_slot_runs_follow_counts_and_membership() -> None:
    ms = metrics()
    assert worker_order(ms) == ["a-0", "a-1", "b-0"]
    assert slot_runs(ms, "a-0") == [(0, STEPS - 1, 2)]
    assert slot_runs(ms, "a-1") == [(0, EPOCH1_STEP - 1, 1), (EPOCH2_STEP, STEPS - 1, 1)]
    assert slot_runs(ms, "b-0") == [
        (0, EPOCH1_STEP - 1, 1),
        (EPOCH1_STEP, EPOCH2_STEP - 1, 2),
        (EPOCH2_STEP, STEPS - 1, 1),
    ]


def test_slot_runs_skip_rows_with_mismatched_lengths() -> None:
    rows = metrics_rows()
    rows[3]["slots"] = [2, 1]  # three members, two counts: unreadable
    runs = slot_runs(parse_metrics(rows), "a-0")
    assert runs == [(0, 2, 2), (4, STEPS - 1, 2)]


def test_slot_chart_strips_reflect_counts() -> None:
    ms = metrics()
    root = parse(slot_chart(ms, []))
    x = step_scale([p.step for p in ms])
    rows = {r.get("data-worker") or "": r for r in with_class(root, "slot-row")}
    assert list(rows) == ["a-0", "a-1", "b-0"]
    for worker, row in rows.items():
        got = [
            (
                int(r.get("data-from") or -1),
                int(r.get("data-to") or -1),
                int(r.get("data-slots") or -1),
            )
            for r in with_class(row, "slot-run")
        ]
        assert got == slot_runs(ms, worker)
    b0 = with_class(rows["b-0"], "slot-run")
    assert b0[1].get("fill") != b0[0].get("fill")  # 2 slots look different from 1
    first = b0[1]
    assert float(first.get("x") or "nan") == round(x(EPOCH1_STEP - 0.5), 2)
    a1 = with_class(rows["a-1"], "slot-run")
    gap_start = float(a1[0].get("x") or 0) + float(a1[0].get("width") or 0)
    assert gap_start < float(a1[1].get("x") or 0)  # a-1 absent in epoch 1


def test_empty_inputs_render() -> None:
    for svg in (loss_chart([], []), step_time_chart([], []), slot_chart([]), timeline_chart([])):
        root = parse(svg)
        assert root.tag == "svg"


def test_timeline_lanes_hold_their_events() -> None:
    root = parse(timeline_chart(events_rows()))
    lanes = {g.get("data-lane"): g for g in with_class(root, "lane")}
    assert {"run", "fault", "failure", "membership", "recovery", "decision"} <= set(lanes)
    faults = [e.get("data-event") for e in with_class(lanes["fault"], "event")]
    assert faults == ["fault_injected"]


# --- escaping ----------------------------------------------------------------------

EVIL = "<script>alert('x')</script>&\""


def test_text_is_escaped_everywhere(tmp_path: Path) -> None:
    rows = metrics_rows()
    for r in rows:
        r["members"] = [EVIL if m == "b-0" else m for m in r["members"]]
    events = events_rows()
    for e in events:
        if e.get("event") == "fault_injected":
            e["target"] = EVIL
        if e.get("event") == "epoch_started":
            e["reason"] = EVIL
    summary = dict(SUMMARY, final_hash=EVIL, faults=[dict(SUMMARY["faults"][0], target=EVIL)])
    run = make_run_dir(tmp_path / "run", summary=summary, metrics=rows, events=events)
    page = render_html(load_run(run))
    assert "<script" not in page
    assert "alert(&#x27;x&#x27;)" in page
    data = load_run(run)
    for svg in (
        loss_chart(data.metrics, fault_marks(data.summary, data.events)),
        step_time_chart(data.metrics, epoch_marks(data.events)),
        slot_chart(data.metrics, epoch_marks(data.events)),
        timeline_chart(data.events),
    ):
        parse(svg)  # still well-formed with hostile names
    assert esc(EVIL) == "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&amp;&quot;"


# --- loading and tables --------------------------------------------------------------


def test_read_jsonl_tolerates_torn_and_odd_lines(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_bytes(b'{"step": 0}\n\n[1, 2]\n{"step": 1, "loss": NaN}\n\xff\xfe\n{"step": 2')
    rows, skipped = read_jsonl(p)
    assert [r["step"] for r in rows] == [0, 1]
    assert skipped == 3
    assert read_jsonl(tmp_path / "absent.jsonl") == ([], 0)
    ms = parse_metrics(rows)
    assert ms[1].loss is None  # NaN is not plotted


def test_parse_metrics_tolerates_missing_keys_and_repeats() -> None:
    ms = parse_metrics(
        [
            {"step": 1, "loss": "x"},
            {"step": 0, "loss": 2.0},
            {"loss": 1.0},
            {"step": 1, "loss": 1.5, "slots": [1, None], "members": ["a", "b"]},
        ]
    )
    assert [(p.step, p.loss) for p in ms] == [(0, 2.0), (1, 1.5)]
    assert ms[1].slots == (1, 0)


def test_fault_marks_prefer_summary_then_events() -> None:
    assert [(f.step, f.kind) for f in fault_marks(SUMMARY, events_rows())] == [(KILL_STEP, "kill")]
    assert [(f.step, f.target) for f in fault_marks({}, events_rows())] == [(KILL_STEP, "a-1")]


def test_fault_table_from_summary(tmp_path: Path) -> None:
    data = load_run(make_run_dir(tmp_path / "run"))
    rows, derived = fault_rows(data)
    assert not derived
    assert rows == [
        ["0", "kill", "hardware", "a-1", "10", "0.020 s", "0.003 s", "0.012 s", "0", "yes"]
    ]


def test_fault_table_derived_from_events_for_old_runs(tmp_path: Path) -> None:
    summary = {"steps": STEPS, "final_hash": "sha256:abc"}
    data = load_run(make_run_dir(tmp_path / "run", summary=summary))
    rows, derived = fault_rows(data)
    assert derived
    (row,) = rows
    assert row[:5] == ["0", "kill", "hardware", "a-1", str(KILL_STEP)]
    assert row[5] == "0.020 s"  # collective_failed 0.02 s after injection
    assert row[8:] == ["–", "–"]  # not derivable
    page = render_html(data)
    assert "reconstructed from events.jsonl" in page


def test_header_facts(tmp_path: Path) -> None:
    facts = dict(header_facts(load_run(make_run_dir(tmp_path / "run"))))
    assert facts["steps"] == str(STEPS)
    assert facts["vs. fault-free reference"] == "bitwise-equal (cached reference)"
    assert facts["survivor restarts"] == "0"
    assert facts["failures absorbed"] == "1 of 1"
    assert facts["faults absorbed"] == "1 of 1"
    assert facts["goodput"] == "93.0%"
    assert facts["wall time"] == "8.90 s"
    bare = dict(header_facts(load_run(make_run_dir(tmp_path / "bare", summary={}))))
    assert "vs. fault-free reference" not in bare
    assert bare["goodput"] == "–"
    assert bare["steps"] == str(STEPS)  # from metrics


def test_decision_log_rendered(tmp_path: Path) -> None:
    page = render_html(load_run(make_run_dir(tmp_path / "run")))
    table = re.search(r'<table class="decisions">.*?</table>', page)
    assert table is not None
    assert "quarantine" in table.group(0) and "non-finite loss" in table.group(0)


# --- the written file ----------------------------------------------------------------


def test_write_report_is_one_self_contained_file(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path / "run", torn=True)
    before = set(run.iterdir())
    out = write_report(run)
    assert out == (run / "report.html").resolve()
    assert set(run.iterdir()) - before == {run / "report.html"}  # no temp file left
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    for bad in ("http://", "https://", "src=", "<link", "<script", "url(", "@import", "href="):
        assert bad not in page, bad
    assert page.count("<svg") == 4
    assert "unreadable lines skipped" in page  # the torn tails are reported
    # the embedded SVGs are well-formed
    for svg in re.findall(r"<svg.*?</svg>", page, flags=re.S):
        parse(svg)


def test_write_report_with_missing_files_and_custom_out(tmp_path: Path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    out = write_report(run, tmp_path / "sub" / "r.html")
    page = out.read_text()
    assert "missing: metrics.jsonl, events.jsonl, summary.json, config.json" in page


def test_cli_prints_path(tmp_path: Path) -> None:
    from perdure.cli import main

    run = make_run_dir(tmp_path / "run")
    res = CliRunner().invoke(main, ["report", str(run)])
    assert res.exit_code == 0, res.output
    assert Path(res.output.strip()) == (run / "report.html").resolve()
    res = CliRunner().invoke(main, ["report", str(tmp_path / "nope")])
    assert res.exit_code == 2


def test_real_run_shape_lines_parse() -> None:
    """A metrics line exactly as the runtime writes it today."""
    line = (
        '{"t":1795967551.347764,"step":42,"loss":3.0587973594665527,"step_s":0.012636,'
        '"tokens_per_s":40520.3,"membership_epoch":1,"slots":[2,2],"members":["a-0","b-0"]}'
    )
    (p,) = parse_metrics([json.loads(line)])
    assert p.members == ("a-0", "b-0") and p.slots == (2, 2) and p.membership_epoch == 1


def test_slot_colours_scale_to_the_runs_maximum() -> None:
    from perdure.report.charts import slot_colour

    assert slot_colour(1, 2) != slot_colour(2, 2)
    assert slot_colour(2, 2) == slot_colour(8, 8)  # the maximum is always the darkest
    assert slot_colour(0, 4) == "#ffffff"  # a member with no slots is not a non-member
    root = parse(slot_chart(parse_metrics(metrics_rows())))
    legend = [e.get("fill") for e in with_class(root, "legend")]
    assert len(legend) == 2 and len(set(legend)) == 2


def test_config_shown_escaped(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path / "run")
    (run / "config.json").write_text(json.dumps({"task": {"entry": "<x>"}}))
    page = render_html(load_run(run))
    assert "<summary>config.json</summary>" in page and "&lt;x&gt;" in page


def test_the_report_is_readable_by_others_even_from_a_private_run(tmp_path: Path) -> None:
    """A run writes its files under umask 077; its report is for sharing: 0644."""
    import stat

    from perdure.launch.api import private_files

    run = make_run_dir(tmp_path / "run", torn=False)
    with private_files():
        out = write_report(run)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
