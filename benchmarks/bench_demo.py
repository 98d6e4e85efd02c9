"""The demo's fault schedule, measured: the input the simulator's validation reads.

    .venv/bin/python benchmarks/bench_demo.py              # configs/demo.toml, 300 steps
    .venv/bin/python benchmarks/bench_demo.py --steps 160 --config configs/demo_quick.toml

Runs ``perdure run CONFIG`` twice on the demo dataset: once as configured (every fault of
its ``[[chaos.faults]]``) and once with no fault at all, back to back, and records for
each the committed steps, the span from the first to the last commit, the median
``step_s``, the runtime's own goodput (``summary.json``) and, for the faulty run, the
fault table (detect, re-plan, copy state, recover per fault) plus the gap between
commits around each fault. Goodput here is fault-free span / faulty span, as in
``bench_recovery.py``. No bitwise proof is taken (``make demo`` does that).

Results: ``benchmarks/results/demo.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from _common import REPO, machine, write_result


def build_dataset(path: Path) -> None:
    """The demo corpus, built exactly as ``perdure demo`` builds it."""
    if (path / "manifest.json").exists():
        return
    import sysconfig

    from perdure.data import build_dataset as build

    src = sysconfig.get_paths()["stdlib"]
    build([src], str(path), seq_len=128, part_mb=0.5, include="*.py", max_mb=8.0)


def jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run(config: Path, run_dir: Path, steps: int, clean: bool, timeout_s: float) -> dict:
    text = config.read_text()
    if clean:  # the same config without its fault schedule
        text = text.split("[[chaos.faults]]")[0]
    cfg = run_dir.parent / f"{run_dir.name}.toml"
    cfg.write_text(text)
    cmd = [sys.executable, "-m", "perdure", "run", str(cfg), "--run-dir", str(run_dir)]
    cmd += ["--no-live", "--steps", str(steps), "--timeout-s", str(timeout_s)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s + 60)
    metrics = sorted(jsonl(run_dir / "metrics.jsonl"), key=lambda m: m["t"])
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    out: dict[str, Any] = {
        "rc": p.returncode,
        "wall_s": time.perf_counter() - t0,
        "committed": len(metrics),
        "span_s": metrics[-1]["t"] - metrics[0]["t"] if len(metrics) > 1 else None,
        "step_s_median": statistics.median(m["step_s"] for m in metrics) if metrics else None,
        "runtime_goodput": summary.get("goodput"),
        "restarts": summary.get("restarts"),
    }
    if p.returncode:
        out["error"] = p.stderr[-2000:]
    if not clean:
        out["faults"] = summary.get("faults", [])
        out["gaps"] = fault_gaps(out["faults"], metrics)
    return out


def fault_gaps(faults: list[dict], metrics: list[dict]) -> list[dict]:
    """Per fault: the longest gap between two commits in the 30 s after it, and the
    time the steps of that window took beyond the run's median step (what it cost)."""
    med = statistics.median(m["step_s"] for m in metrics) if metrics else 0.0
    out = []
    for f in faults:
        t0 = f.get("injected_t")
        if t0 is None:
            continue
        window = [m for m in metrics if t0 - 1 <= m["t"] <= t0 + 30]
        gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(window)]
        out.append({"kind": f["kind"], "max_gap_s": max(gaps, default=None), "median_s": med})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.toml"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    build_dataset(REPO / "runs" / "datasets" / "demo-stdlib")
    t0 = time.perf_counter()
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="perdure-bench-demo-") as d:
        for name in ("faulty", "clean"):
            res[name] = run(Path(a.config), Path(d) / name, a.steps, name == "clean", a.timeout_s)
            print(name, {k: v for k, v in res[name].items() if k not in ("faults", "gaps")})
    data: dict[str, Any] = {
        "name": "demo",
        "machine": machine(),
        "config": str(Path(a.config).relative_to(REPO)),
        "steps": a.steps,
        **res,
        "seconds": time.perf_counter() - t0,
    }
    if res["clean"].get("span_s") and res["faulty"].get("span_s"):
        data["goodput"] = res["clean"]["span_s"] / res["faulty"]["span_s"]
    print(f"goodput {data.get('goodput')}; wrote {write_result('demo', data, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
