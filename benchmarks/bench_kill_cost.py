"""What one kill costs, before and after a change, in one script run (issue 34's bar).

    flock /tmp/perdure-bench.lock .venv/bin/python benchmarks/bench_kill_cost.py \\
        --before /path/to/worktree-of-the-old-commit --repeats 3

The exact reduction issue's goodput setup (``bench_recovery.perdure_goodput``): 3 members
and a warm spare, d_model 64, 300 steps, a kill every 50 steps. Each repeat runs a
clean+faulty pair per arm, the arms taking turns and every other pair running its faulty
run first. An arm is the code its processes import: ``--before``, a worktree of the old
commit, runs in that directory with ``PYTHONPATH`` set to it (``python -m perdure`` puts
the working directory first on ``sys.path``); "after" is this checkout. Each pair records
the ``perdure`` package it imported. Per arm: the paired goodput (clean span / faulty
span), the in-run goodput, every kill's stall in median step times and its breakdown
(``bench_recovery.kill_costs``), and whether the faulty run's weights equal the clean
run's. The load average is recorded at the start and the end.

Results: ``benchmarks/results/kill_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, ensure_dataset, machine, stats, write_result
from bench_recovery import (
    COST_WINDOW,
    GP_MODEL,
    REC_MODEL,
    gaps,
    in_order,
    in_run_goodput,
    kill_costs,
    kill_schedule,
    perdure_cfg,
    span,
)
from bench_step import perdure_run

MODELS = {"gp": GP_MODEL, "rec": REC_MODEL, "frozen": GP_MODEL}
"""``gp``: the goodput setup's model (its gradient is one reduction bucket); ``rec``: the
recovery benchmark's, ~2 M parameters (three buckets: a step whose buckets stream);
``frozen``: ``gp`` beside a frozen base of ``--frozen-mb`` (``benchmarks/frozen_lm.py``: a
state much larger than its step, for the paced copy)."""

FROZEN_ENTRY = "benchmarks.frozen_lm:make_task"


def pair(
    dataset: str,
    steps: int,
    code: Path,
    faulty_first: bool,
    keep: Path | None,
    model: str = "gp",
    workers: int = 3,
    shard_degree: int = 1,
    cluster: dict | None = None,
    frozen_mb: float = 0.0,
) -> dict:
    cfg = perdure_cfg(MODELS[model], 12, dataset, workers)
    if model == "frozen":
        cfg["task"]["entry"] = FROZEN_ENTRY
        cfg["task"]["options"].update(frozen_mb=frozen_mb, frozen_tensors=32)
    cfg["cluster"].update(cluster or {})
    cfg["cluster"]["spares"] = 1
    cfg["train"]["shard_degree"] = shard_degree
    kills = list(range(50, steps, 50))
    os.environ["PYTHONPATH"] = str(code)  # the launcher (a console script) imports it too
    probe = [str(REPO / ".venv/bin/python"), "-c", "import perdure; print(perdure.__file__)"]
    imported = subprocess.run(probe, cwd=code, capture_output=True, text=True).stdout.strip()
    res: dict = {"imports": imported}
    runs_metrics: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="perdure-bench-kill-") as d:
        root = keep or Path(d)
        runs = [("clean", None), ("faulty", kill_schedule(kills, ["local-1", "local-2"]))]
        for name, chaos in in_order(runs, faulty_first):
            r = perdure_run(cfg, steps, root / name, chaos=chaos, timeout_s=900, cwd=code)
            runs_metrics[name] = r["metrics"]
            res[name] = {"rc": r["rc"], "span_s": span(r["metrics"])}
            res[name]["final_hash"] = r["summary"].get("final_hash")
            if r["rc"]:
                res[name]["error"] = r["stderr_tail"]
            elif chaos:
                res[name]["kills"] = kill_costs(r["metrics"], r["events"])
                res[name]["goodput_in_run"] = in_run_goodput(r["metrics"], kills)
    out = {**res, "bitwise_equal": res["clean"]["final_hash"] == res["faulty"]["final_hash"]}
    if len(runs_metrics) == 2 and not res["faulty"]["rc"] and not res["clean"]["rc"]:
        out["window_cost_steps"] = against_clean(
            runs_metrics["faulty"], runs_metrics["clean"], kills
        )
    if res["clean"]["span_s"] and res["faulty"]["span_s"]:
        out["goodput"] = res["clean"]["span_s"] / res["faulty"]["span_s"]
    return out


def against_clean(faulty: list[dict], clean: list[dict], kills: list[int]) -> list[float]:
    """Per kill at step ``k``: the faulty run's time from step ``k - 1``'s commit to step
    ``k + COST_WINDOW - 1``'s, less the clean run's over the same steps, in the clean
    run's median step times. What the kill cost over the window, whatever else those
    steps hold (a fingerprint every 10 steps is in both runs); a copy paced over steps
    spreads its cost there."""
    tf = {m["step"]: m["t"] for m in faulty}
    tc = {m["step"]: m["t"] for m in clean}
    median = statistics.median(gaps(clean).values())
    out = []
    for k in kills:
        a, b = k - 1, k + COST_WINDOW - 1
        if all(s in tf and s in tc for s in (a, b)):
            out.append(((tf[b] - tf[a]) - (tc[b] - tc[a])) / median)
    return out


def row(runs: list[dict]) -> dict:
    kills = [k for r in runs for k in r["faulty"].get("kills", [])]
    out = {
        "goodput": stats([r.get("goodput") for r in runs]),
        "goodput_in_run": stats([r["faulty"].get("goodput_in_run") for r in runs]),
        "bitwise_equal": all(r["bitwise_equal"] for r in runs),
        "kills": len(kills),
    }
    keys = ("stall_steps", "cost_steps", "stall_s", "kill_to_next_s", "detected_s")
    for key in (*keys, "epoch_started_s"):
        out[key] = stats([k.get(key) for k in kills if k.get(key) is not None])
    out["kills_over_one_step"] = sum(1 for k in kills if k["stall_steps"] > 1)
    out["window_cost_steps"] = stats([c for r in runs for c in r.get("window_cost_steps", [])])
    out["runs"] = runs
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="a worktree of the code to compare against")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--keep", type=Path, help="keep the run directories under this folder")
    ap.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="gp",
        help="gp: the goodput setup's model (d_model 64, one reduction bucket); rec: the "
        "recovery benchmark's (~2 M parameters, three buckets)",
    )
    ap.add_argument("--workers", type=int, default=3, help="members (a multiple of --shard-degree)")
    ap.add_argument(
        "--shard-degree",
        type=int,
        default=1,
        help="ranks per replica group (train.shard_degree; the optimizer state sharded, the "
        "parameters whole): 2 with --workers 4 is two groups of two",
    )
    ap.add_argument(
        "--paces",
        default="",
        help="instead of --before: arms of this checkout, one per cluster.copy_pace listed "
        "(comma-separated: whole, fixed, auto), each with --paced-mb",
    )
    ap.add_argument(
        "--paced-mb",
        type=float,
        default=64.0,
        help="with --paces: cluster.copy_step_mb (a fixed part's MB, an automatic first part's)",
    )
    ap.add_argument(
        "--frozen-mb",
        type=float,
        default=64.0,
        help="with --model frozen: the frozen base's MB (32 tensors)",
    )
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.workers < 2 or a.workers % a.shard_degree:
        ap.error(f"--workers must be >= 2 and a multiple of --shard-degree (got {a.workers})")
    paces = [p for p in a.paces.split(",") if p]
    if a.paced_mb <= 0 or (paces and a.before) or set(paces) - {"whole", "fixed", "auto"}:
        ap.error("--paces lists whole, fixed or auto, not with --before; --paced-mb > 0")
    dataset = ensure_dataset()
    arms: dict[str, tuple[Path, dict]] = {"after": (REPO, {})}
    if a.before:
        arms["before"] = (a.before.resolve(), {})
    if paces:
        arms = {p: (REPO, {"copy_pace": p, "copy_step_mb": a.paced_mb}) for p in paces}
    load0, t0 = os.getloadavg(), time.perf_counter()
    runs: dict[str, list[dict]] = {}
    for i in range(a.repeats):
        for name, (code, cluster) in list(arms.items()) if i % 2 else list(arms.items())[::-1]:
            keep = a.keep / f"{name}-{i}" if a.keep else None
            r = pair(
                dataset,
                a.steps,
                code,
                i % 2 == 1,
                keep,
                a.model,
                a.workers,
                a.shard_degree,
                cluster,
                a.frozen_mb,
            )
            runs.setdefault(name, []).append(r)
            ks = [round(k["stall_steps"], 2) for k in r["faulty"].get("kills", [])]
            print(
                f"{name} {i}: goodput {r.get('goodput')} in-run "
                f"{r['faulty'].get('goodput_in_run')} stalls (steps) {ks} "
                f"equal {r['bitwise_equal']}",
                flush=True,
            )
    data = {
        "name": "kill_cost",
        "machine": machine(),
        "load_start": load0,
        "load_end": os.getloadavg(),
        "workload": {
            "model": MODELS[a.model],
            "global_batch": 12,
            "steps": a.steps,
            "workers": a.workers,
            "shard_degree": a.shard_degree,
            "frozen_mb": a.frozen_mb if a.model == "frozen" else None,
            "arms": {name: cluster for name, (_, cluster) in arms.items()},
            "spares": 1,
            "kill_every": 50,
            "repeats": a.repeats,
        },
        "arms": {name: row(rs) for name, rs in runs.items()},
        "seconds": time.perf_counter() - t0,
    }
    for name, r in data["arms"].items():
        print(name, json.dumps({k: v for k, v in r.items() if k != "runs"}))
    print(f"load {load0} -> {data['load_end']}")
    print(f"wrote {write_result('kill_cost', data, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
