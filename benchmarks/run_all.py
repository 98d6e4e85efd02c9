"""Run the whole benchmark suite and write the result files and a markdown table.

    .venv/bin/python benchmarks/run_all.py            # full suite (< 30 min on 2 cores)
    .venv/bin/python benchmarks/run_all.py --quick    # smoke run (~3-5 min), results/quick/
    .venv/bin/python benchmarks/run_all.py --only reduce step

Each benchmark runs in its own process (a failure is recorded, the suite goes on) and
writes ``<results>/<name>.json``; this script then adds the machine description where a
benchmark lacks it and writes ``<results>/README.md``: one table per benchmark, ratios as
min / median / max over repeats. ``make bench`` calls it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, REPO, RESULTS, ensure_dataset, fmt, machine

HERE = Path(__file__).resolve().parent

# name, script, full args, quick args
SUITE = [
    ("reduce", "bench_reduce.py", [], ["--quick"]),
    ("step", "bench_step.py", [], ["--quick"]),
    ("recovery", "bench_recovery.py", [], ["--quick", "--skip", "torchft"]),
    ("scaling", "bench_scaling.py", [], ["--quick"]),
    ("data", "bench_data.py", [], ["--quick"]),
    ("store", "bench_store.py", [], ["--quick"]),
    ("exact", "bench_exact.py", [], ["--quick"]),
    ("checkpoint", "bench_checkpoint.py", ["--params", "50e6", "--repeats", "5"], ["--quick"]),
    ("preload", "bench_preload.py", [], ["--quick"]),
    ("rtt", "bench_rtt.py", [], ["--quick"]),
    ("spike", "bench_spike.py", [], ["--quick"]),
    ("launch", "bench_launch.py", [], ["--quick"]),
    ("scatter", "bench_scatter.py", [], ["--quick"]),
]


def run_one(name: str, script: str, args: list[str], out: Path, timeout: float) -> dict:
    path = HERE / script
    if not path.exists():
        return {"name": name, "status": "absent"}
    cmd = [PY, str(path), *args, "--out", str(out / f"{name}.json")]
    t0 = time.perf_counter()
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    try:
        p = subprocess.run(cmd, cwd=REPO, timeout=timeout, capture_output=True, text=True)
        status = "ok" if p.returncode == 0 else f"failed (rc {p.returncode})"
        tail = (p.stdout + p.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        status, tail = f"timeout after {timeout:.0f} s", str(e.stdout or "")[-3000:]
    secs = time.perf_counter() - t0
    print(tail if status != "ok" else (tail[-1500:]), flush=True)
    print(f"== {name}: {status} in {secs:.1f} s", flush=True)
    return {
        "name": name,
        "status": status,
        "seconds": round(secs, 1),
        "command": " ".join([".venv/bin/python", f"benchmarks/{script}", *args]),
    }


# -- markdown -------------------------------------------------------------------------------


def ms(s: dict | None) -> str:
    return f"{s['median'] * 1e3:.1f}" if s else "-"


def table(head: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def md_reduce(d: dict) -> str:
    rows = [
        [
            r["workers"],
            r["mb"],
            ms(r["all_reduce_s"]),
            ms(r["chain_s"]),
            fmt(r["ratio_chain_over_all_reduce"], 2),
            r["best_chunk_elems"],
            fmt(r["ratio_best_chunk_over_all_reduce"], 2),
        ]
        for r in d["rows"]
    ]
    t = table(
        [
            "W",
            "MB",
            "all_reduce ms",
            "chain ms",
            "chain/all_reduce",
            "best chunk (elems)",
            "best chunk / all_reduce",
        ],
        rows,
    )
    g = ", ".join(f"{k}: {v:.2f}" for k, v in d["chunk_geomean_ratio"].items())
    return (
        f"{t}\n\nDefault chunk {d['default_chunk_elems']} elems. Geometric mean of median "
        f"ratios per chunk size: {g}; best overall: {d['best_chunk_elems_overall']}. "
        f"Goal <= 1.2x met in {d['summary']['rows_meeting_goal']}/{d['summary']['rows']} rows."
    )


def md_step(d: dict) -> str:
    rows = []
    for r in d["rows"]:
        rt = r.get("runtime", {})
        rows.append(
            [
                r["model"],
                f"{r['params'] / 1e6:.2f}M",
                r["workers"],
                r["global_batch"],
                r["slots"],
                ms(r["ddp_step_s"]),
                ms(r["perdure_step_s"]),
                fmt(r["ratio_perdure_over_ddp"]),
                fmt(r["ratio_prealloc_over_ddp"]),
                ms(rt.get("step_s"))
                if rt.get("step_s")
                else rt.get("error", "-")[:40]
                if rt
                else "-",
                f"{r['ratio_runtime_over_ddp_median']:.3f}"
                if "ratio_runtime_over_ddp_median" in r
                else "-",
            ]
        )
    return table(
        [
            "model",
            "params",
            "W",
            "B",
            "slots",
            "DDP ms",
            "perdure ms",
            "sequential/DDP",
            "overlapped/DDP",
            "`perdure run` step_s ms",
            "run/DDP",
        ],
        rows,
    )


def md_recovery(d: dict) -> str:
    rows = []
    for name, r in d["recovery"].items():
        rows.append(
            [
                name,
                fmt(r["recovery_s"]),
                fmt(r.get("step_s_before")),
                "; ".join(str(x.get("error"))[:60] for x in r["runs"] if x.get("error")) or "-",
            ]
        )
    t = table(["system", "kill -> next new step, s", "step s before", "errors"], rows)
    gp = [
        [
            n,
            fmt(g.get("goodput")),
            g.get("faults"),
            fmt(g.get("clean_span_s"), 1),
            fmt(g.get("faulty_span_s"), 1),
            fmt(g.get("goodput_in_run")) if g.get("goodput_in_run") else "-",
            fmt(g.get("kill_to_next_s")) if g.get("kill_to_next_s") else "-",
            fmt(g.get("stall_s")) if g.get("stall_s") else "-",
            g.get("bitwise_equal", "-"),
        ]
        for n, g in d.get("goodput", {}).items()
    ]
    head = ["system", "goodput", "kills", "clean span s", "faulty span s", "goodput in the run"]
    head += ["kill -> next new step s", "stall s", "bitwise equal"]
    t2 = table(head, gp)
    rat = ", ".join(f"{k}: {v:.1f}x" for k, v in d.get("ratios", {}).items())
    goals = ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in d["goals"].items())
    return f"{t}\n\nRatios (peer / perdure, medians): {rat or '-'}\n\n{t2}\n\nGoals: {goals}"


def md_scaling(d: dict) -> str:
    parts = []
    for name, pts in d["series"].items():
        if not pts:
            continue
        rows = [
            [
                p["model"],
                p.get("params", "-"),
                p["workers"],
                p["global_batch"],
                p["slots"],
                f"{p['step_s'] * 1e3:.1f}" if p.get("step_s") else "-",
                f"{p['checkpoint_s']:.3f}" if p.get("checkpoint_s") else "-",
                f"{p['checkpoint_snapshot_s']:.3f}" if p.get("checkpoint_snapshot_s") else "-",
                f"{p['recovery_s']:.3f}" if p.get("recovery_s") else "-",
                "ok" if not p.get("rc") else "rc " + str(p["rc"]),
            ]
            for p in pts
        ]
        parts.append(
            f"**{name}**\n\n"
            + table(
                [
                    "model",
                    "params",
                    "W",
                    "B",
                    "slots",
                    "step ms",
                    "ckpt write s",
                    "ckpt snapshot s",
                    "recovery s",
                    "run",
                ],
                rows,
            )
        )
    parts.append("Plots: " + ", ".join(f"![{p}]({p})" for p in d.get("plots", [])))
    return "\n\n".join(parts)


def md_generic(d: dict) -> str:
    """Every ``ratio*`` min/median/max found in a result file (other teams' benchmarks)."""
    rows = []

    def walk(x, path):
        if isinstance(x, dict):
            if {"min", "median", "max"} <= set(x) and "ratio" in path.split(".")[-1]:
                rows.append([f"`{path}`", fmt(x)])
                return
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")

    walk(d, "")
    return table(["ratio", "min / median / max"], rows) if rows else "(no ratios found)"


def md_exact(d: dict) -> str:
    rows = []
    for r in d["rows"]:
        e = r["relative_error"]
        rows.append(
            [
                r["workers"],
                r["mb"],
                ms(r["all_reduce_s"]),
                fmt(r["ratio_exact32_over_all_reduce"], 2),
                fmt(r["ratio_exact64_over_all_reduce"], 2),
                fmt(r["ratio_chain_over_all_reduce"], 2),
                " / ".join(f"{e[m]['median']:.1e}" for m in ("all_reduce", "exact32", "exact64")),
                " / ".join(f"{e[m]['max']:.1e}" for m in ("all_reduce", "exact32", "exact64")),
            ]
        )
    head = [
        "W",
        "MB",
        "all_reduce ms",
        "exact int32 / all_reduce",
        "exact int64 / all_reduce",
        "chain / all_reduce",
        "median rel. error (fp32 all_reduce / int32 / int64)",
        "max rel. error (same)",
    ]
    return table(head, rows) + f"\n\nGoal: {d['goal']}."


def md_store(d: dict) -> str:
    head = ["W", "groups x repeats", "TCPStore ms", "AuthStore ms", "AuthStore / TCPStore"]
    row = [
        d["workers"],
        f"{d['groups_per_repeat']} x {d['authstore_group_s']['n']}",
        ms(d["tcpstore_group_s"]),
        ms(d["authstore_group_s"]),
        fmt(d["ratio_authstore_over_tcpstore"], 2),
    ]
    return table(head, [row])


def md_launch(d: dict) -> str:
    if "skipped" in d:
        return f"(skipped: {d['skipped']})"
    keys = ("coordinator_up_s", "all_joined_s", "first_step_s", "wall_s")
    rows = [[side, *(fmt(d[side][k], 2) for k in keys)] for side in ("local", "ray")]
    head = ["launcher", "coordinator up s", "all joined s", "first step s", "wall s"]
    first = fmt(d["ratio_ray_over_local_first_step"], 2)
    wall = fmt(d["ratio_ray_over_local_wall"], 2)
    load = [round(x, 1) for x in d["machine"]["loadavg_at_start"]]
    note = (
        f"Ray / local, paired per repeat: first step {first}, wall {wall}. "
        f"{d['workers']} workers over {d['regions']} regions, {d['steps']} steps, "
        f"{d['repeats']} repeats; same final hash: {d['same_final_hash']}; load average at "
        f"the start {load}. The cluster ({d['ray_cluster_nodes']} nodes on this machine) "
        f"took {d['ray_cluster_start_s']} s to start, before any run."
    )
    return table(head, rows) + "\n\n" + note


def md_preload(d: dict) -> str:
    def med(x: dict | None) -> str:
        return f"{x['median']:.3f}" if x else "-"

    rows = [
        [
            name,
            med(d["fork_import_s"][name]),
            med(d["planned_in_from_start_s"][name]),
            med(d["planned_in_from_kill_s"][name]),
        ]
        for name in ("preload", "no_preload")
    ]
    head = ["zygote", "task import in a fork (s)", "planned in, from start (s)",
            "planned in, from kill (s)"]  # fmt: skip
    ratio = d.get("ratio_preload_over_no_preload")
    bound = d.get("ratio_at_most")
    load = d["machine"].get("loadavg_at_start")
    late = [r["not_in_after_s"] for r in d["runs"]["no_preload"] if r.get("not_in_after_s")]
    if late:
        rows[1][2] = f"> {min(late):.1f} (not planned in before the run ended)"
    return "\n".join(
        [
            table(head, rows),
            "",
            f"Medians of {d['repeats']} run(s) per variant; planned-in ratio preload / "
            f"no_preload (paired): {fmt(ratio)}"
            + (f", at most {fmt(bound)} where no_preload never got in" if bound else "")
            + "; final hashes agree: "
            f"{d['final_hashes_agree']}; load average at start {load}.",
        ]
    )


def md_rtt(d: dict) -> str:
    def sec(x: float | None) -> str:
        return f"{x:.3f}" if x is not None else "-"

    rows = []
    for r in d["rows"]:
        bar = "-" if "meets_bar" not in r else ("yes" if r["meets_bar"] else "no")
        if r["mode"] == "chain" and bar != "-":
            bar += " (not under the bar)"
        extra = r.get("extra_rtts")
        rows.append([r["mode"], r["workers"], f"{r['rtt_ms']:g}", sec(r["step_s_median"]),
                     sec(r["undisturbed_step_s"]), "-" if extra is None else f"{extra:.1f}",
                     bar, "ok" if r["ok"] else f"failed {r['exit_codes']}"])  # fmt: skip
    head = ["mode", "W", "RTT ms", "step s (median)", "step at RTT 0", "(step - RTT 0 step) / RTT",
            "<= 4 RTT", "run"]  # fmt: skip
    echo = "; ".join(
        f"{e['rtt_ms']:g} ms asked: {e['across_ms_median']:.2f} ms across regions, "
        f"{e['within_ms_median']:.2f} ms within one"
        for e in d["echo"]
    )
    return (
        table(head, rows)
        + f"\n\nGoal: {d['goal']}. TCP echo (64 B, median of 10) through the delay router: "
        + f"{echo}. Exact-reduction final hashes agree across modes and RTTs: "
        + f"{d['exact_hashes_agree']}; load average at start {d['machine']['loadavg_at_start']}."
    )


def md_spike(d: dict) -> str:
    def sec(x: float | None) -> str:
        return f"{x:.3f}" if x is not None else "-"

    rows = []
    for r in d["runs"]:
        if r.get("rc") != 0:
            rows.append([r["mode"], *["-"] * 6, f"failed (rc {r.get('rc')})"])
            continue
        rows.append([r["mode"], sec(r["before_s"]), sec(r["during_s"]), sec(r["ratio"]),
                     sec(r.get("settled_ratio")), sec(r.get("bench_after_s")),
                     f"{sec(r['median_step_before_s'])} / {sec(r['median_step_during_s'])}",
                     ", ".join(r["benched"]) or "-"])  # fmt: skip
    head = ["mode", "s per step before", "s per step in the spike", "ratio",
            "ratio after the first 1.5 s", "benched after s", "median step_s before / in",
            "benched"]  # fmt: skip
    a, sm = d["args"], d["summary"]

    def span(xs: list[float] | None) -> str:
        return " / ".join(f"{x:.2f}" for x in xs or []) or "-"

    ratios = "; ".join(
        f"{m}: {span(sm[m]['ratio'])} (after the first 1.5 s: {span(sm[m].get('settled_ratio'))})"
        for m in sm
    )
    one_hash = all(sm[m]["one_final_hash"] for m in sm)
    return (
        table(head, rows)
        + f"\n\nSpike: {a['delay_ms']} ms on local-1 for {a['spike_s']} s at step "
        + f"{a['at_step']}. Ratios (min / median / max): {ratios}; goal <= {d['goal']}x. "
        + f"One final hash for every run: {one_hash}; load average at start "
        + f"{d['machine']['loadavg_at_start']}."
    )


def md_scatter(d: dict) -> str:
    head = ["W", "k", "MB", "scatter / whole", "scatter / all_reduce", "whole / all_reduce"]
    head += ["words sent per value: scatter, flat", "bitwise equal"]
    keys = ["scatter_over_whole", "scatter_over_all_reduce", "whole_over_all_reduce"]
    rows = []
    for r in d["rows"]:
        w = r["words_per_value_sent"]
        words = f"{w['scatter']:.2f}, {w['flat_all_reduce']:.2f}"
        cells = [fmt(r[key], 2) for key in keys]
        rows.append([r["W"], r["k"], f"{r['mb']:.0f}", *cells, words, r["bitwise_equal"]])
    return (
        table(head, rows)
        + f"\n\nint{d['bits']}, {d['slots']} slot buffers per rank, times of the slowest rank; "
        + f"load average at start {d['machine']['loadavg_at_start']}."
    )


RENDER = {
    "reduce": md_reduce,
    "step": md_step,
    "recovery": md_recovery,
    "scaling": md_scaling,
    "exact": md_exact,
    "store": md_store,
    "preload": md_preload,
    "rtt": md_rtt,
    "spike": md_spike,
    "launch": md_launch,
    "scatter": md_scatter,
}


def write_readme(out: Path, runs: list[dict], quick: bool, wall: float) -> None:
    m = machine()
    lines = [
        "# Benchmark results" + (" (quick smoke run)" if quick else ""),
        "",
        "Written by `benchmarks/run_all.py`" + (" --quick" if quick else "") + "; see "
        "`docs/performance.md` for what limits each number. Ratios are min / median / max "
        "over repeats (each repeat runs both sides back to back).",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, torch {m['torch']}, "
        f"Python {m['python']}; load average at the end {m['loadavg_at_start']} "
        "(the machine is shared: other test suites ran during these measurements).",
        f"Suite wall time: {wall / 60:.1f} min"
        + (
            " (only the benchmarks run this time)."
            if any("earlier" in r["status"] for r in runs)
            else "."
        ),
        "",
        table(
            ["benchmark", "status", "seconds", "command"],
            [
                [r["name"], r["status"], r.get("seconds", "-"), f"`{r.get('command', '-')}`"]
                for r in runs
            ],
        ),
        "",
    ]
    for r in runs:
        p = out / f"{r['name']}.json"
        if not p.exists() or r["status"] == "absent":  # "ok (earlier run)" is rendered
            continue
        d = json.loads(p.read_text())
        try:
            body = RENDER.get(r["name"], md_generic)(d)
        except Exception as e:  # a schema change must not lose the other tables
            body = f"(could not render: {e!r})"
        lines += [f"## {r['name']}", "", body, ""]
    (out / "README.md").write_text("\n".join(lines))


def sync_doc(out: Path, doc: Path = REPO / "docs" / "performance.md") -> bool:
    """Replace the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in the
    performance document with the table rendered from ``<out>/NAME.json``, so that the
    document's tables are the result files' numbers."""
    import re

    if not doc.exists():
        return False
    text = doc.read_text()

    def repl(m: re.Match) -> str:
        name = m.group(1)
        p = out / f"{name}.json"
        note = ""
        if not p.exists() and (out / "quick" / f"{name}.json").exists():
            p = out / "quick" / f"{name}.json"  # only a quick (smoke) result exists
            note = (
                f"*From the quick smoke run (`benchmarks/results/quick/{name}.json`), not "
                "the full suite.*\n\n"
            )
        if not p.exists():
            return m.group(0)
        d = json.loads(p.read_text())
        body = note + RENDER.get(name, md_generic)(d)
        if name == "scaling":  # plots live in benchmarks/results/, the doc in docs/
            body = body.replace("](scaling_", "](../benchmarks/results/scaling_")
        return f"<!-- bench:{name} -->\n{body}\n<!-- /bench:{name} -->"

    new = re.sub(r"<!-- bench:(\w+) -->.*?<!-- /bench:\1 -->", repl, text, flags=re.S)
    doc.write_text(new)
    return new != text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--results", type=Path)
    ap.add_argument("--timeout", type=float, default=900, help="per benchmark, seconds")
    ap.add_argument(
        "--sync-doc",
        action="store_true",
        help="only re-render docs/performance.md's tables from the result files",
    )
    a = ap.parse_args(argv)
    out = a.results or (RESULTS / "quick" if a.quick else RESULTS)
    if a.sync_doc:
        print("updated" if sync_doc(out) else "unchanged", "docs/performance.md")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    ensure_dataset()
    t0 = time.perf_counter()
    runs = []
    for name, script, full, quick in SUITE:
        if a.only and name not in a.only:
            if (out / f"{name}.json").exists():  # keep its table from the earlier run
                args = " ".join(quick if a.quick else full)
                cmd = f".venv/bin/python benchmarks/{script} {args}".strip()
                runs.append({"name": name, "status": "ok (earlier run)", "command": cmd})
            continue
        r = run_one(name, script, quick if a.quick else full, out, a.timeout)
        runs.append(r)
        p = out / f"{name}.json"
        if p.exists() and r["status"] == "ok":
            d = json.loads(p.read_text())
            if "cpu" not in d.get("machine", {}):
                d["machine_suite"] = machine()
                p.write_text(json.dumps(d, indent=2, default=str) + "\n")
    wall = time.perf_counter() - t0
    write_readme(out, runs, a.quick, wall)
    if out == RESULTS:
        sync_doc(out)
    print(f"suite done in {wall / 60:.1f} min; wrote {out / 'README.md'}")
    return 0 if all(r["status"] in ("ok", "absent") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
