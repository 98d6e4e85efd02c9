"""Step time against an injected cross-region round trip: ``perdure coordinator`` and
``perdure worker`` on network-namespace hosts in 4 regions, for the chain and for the exact
reduction with and without the hierarchical path.

    .venv/bin/python benchmarks/bench_rtt.py            # W = 4, 8; RTT 0, 20, 50 ms
    .venv/bin/python benchmarks/bench_rtt.py --quick    # W = 4; RTT 0, 50 ms

Needs root (namespaces, a TUN device). The hosts and the delay router are the tests'
(``tests/netns_regions.py``): one bridge per region, a router namespace that sends every
packet between regions through a user-space delay line holding it half the RTT, nothing
added inside a region. Each run is a real cluster: the coordinator on a host of its own
in region r0, W workers spread evenly over r0..r3, each on its own host, started with the
documented commands from a TOML config (``cluster.regions`` lists the 4 regions). The
model is the tests' tiny_lm (a ~300 KB gradient): the point is the latency, not the bytes.
A run's step time is the median ``step_s`` of ``metrics.jsonl`` past the first
``--warmup`` steps; "extra" is (step - the same mode's step at RTT 0) / RTT, the number of
round trips a step pays (the bar: <= 4 for the exact reduction at 50 ms, whatever W).
The RTT 0 runs go through the same router (its own cost is in every number). The
machine: 2 shared cores for W + 1 processes and the delay line; the absolute times are
this machine's, the extra round trips are what carries over.

Results: ``benchmarks/results/rtt.json``.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, REPO, machine, write_result

REGIONS = 4
TOKEN = "bench-rtt-token"
MODES = {  # name: (train.reduction, train.reduction_exponents, cluster.hierarchical_reduce,
    # train.reduction_bits)
    "exact_hierarchical": ("exact", "step", True, 64),
    "exact_flat": ("exact", "step", False, 64),
    "carried_hierarchical": ("exact", "carried", True, 64),
    "streamed_hierarchical": ("exact", "streamed", True, 32),
    "chain": ("chain", "step", False, 64),
}
GOAL_RTTS = 4.0
GOAL = "exact step at 50 ms RTT, 4 regions: <= 4 RTT + the RTT-0 step, whatever W"


def _config(dataset: Path, mode: str, workers: int, steps: int, coordinator: str, ports: int):
    from tests.runtime_support import small_config

    reduction, exponents, hier, bits = MODES[mode]
    return small_config(
        dataset,
        workers=workers,
        regions=REGIONS,
        steps=steps,
        slots=8,
        batch=16,
        train={"reduction": reduction, "reduction_exponents": exponents, "reduction_bits": bits},
        cluster={
            "hierarchical_reduce": hier,
            "host": coordinator,
            "channel_port": ports,
            "port": ports + 1,
            "replace_after_ms": -1,
            "min_collective_timeout_ms": 10000,
        },
        checkpoint={"every_steps": steps, "keep_last": 1},
    )


def _start(rs: Any, i: int, argv: list[str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PERDURE_RUN_TOKEN": TOKEN}
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    env.pop("PERDURE_PARENT_PID", None)
    return rs.start(i, [PY, "-m", "perdure", *argv], env=env, cwd=cwd, log=log)


def one_run(rs: Any, dataset: Path, mode: str, rtt: float, steps: int, warmup: int,
            ports: int, tmp: Path, timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """One cluster run at one RTT; its median step time and final hash."""
    from perdure.events import read_jsonl
    from tests.runtime_support import write_toml

    workers = len(rs.hosts) - 1
    rs.set_rtt(rtt)
    coord = rs.hosts[0].address
    cfg = write_toml(_config(dataset, mode, workers, steps, coord, ports), tmp / "run.toml")
    run_dir, logs = tmp / "run", tmp / "logs"
    t0 = time.perf_counter()
    procs = [_start(rs, 0, ["coordinator", "--config", str(cfg), "--run-dir", str(run_dir)],
                    logs / "coordinator.log", tmp)]  # fmt: skip
    for i in range(1, len(rs.hosts)):
        r = rs.region_of[i]
        name = f"r{r}-{rs.in_region(r).index(i) - (1 if r == 0 else 0)}"
        argv = ["worker", "--coordinator", f"{coord}:{ports}", "--name", name, "--region", f"r{r}"]
        procs.append(_start(rs, i, argv, logs / f"{name}.log", tmp))
    end = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    codes = [p.poll() for p in procs]
    lines = read_jsonl(run_dir / "metrics.jsonl")
    step_s = [m["step_s"] for m in lines if m["step"] >= warmup]
    summary = run_dir / "summary.json"
    final = json.loads(summary.read_text()).get("final_hash") if summary.exists() else None
    ok = codes == [0] * len(procs) and sorted(m["step"] for m in lines) == list(range(steps))
    for p in procs:
        if p.poll() is None:
            p.kill()
    return {
        "mode": mode,
        "workers": workers,
        "rtt_ms": rtt,
        "ok": ok,
        "exit_codes": codes,
        "step_s_median": statistics.median(step_s) if step_s else None,
        "step_s_min": min(step_s) if step_s else None,
        "steps_measured": len(step_s),
        "final_hash": final,
        "wall_s": round(wall, 1),
    }


def echo_check(rs: Any, rtt: float) -> dict[str, Any]:
    """What the delay line really adds: TCP echo round trips across and within regions."""
    rs.set_rtt(rtt)
    across = rs.echo_rtts(1, len(rs.hosts) - 1, count=10)
    within = rs.echo_rtts(0, 1, count=10)
    return {
        "rtt_ms": rtt,
        "across_ms_median": statistics.median(across),
        "across_ms_min": min(across),
        "within_ms_median": statistics.median(within),
    }


def derive(rows: list[dict[str, Any]]) -> None:
    """Add (step - RTT-0 step of the same mode and W) / RTT and whether the bar holds."""
    base = {(r["mode"], r["workers"]): r["step_s_median"] for r in rows if r["rtt_ms"] == 0}
    for r in rows:
        b = base.get((r["mode"], r["workers"]))
        if r["rtt_ms"] and b is not None and r["step_s_median"] is not None:
            r["extra_rtts"] = round((r["step_s_median"] - b) / (r["rtt_ms"] / 1000), 2)
            r["meets_bar"] = r["extra_rtts"] <= GOAL_RTTS
        r["undisturbed_step_s"] = b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, nargs="*")
    ap.add_argument("--rtts", type=float, nargs="*")
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=240, help="per run, seconds")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    workers = a.workers or ([4] if a.quick else [4, 8])
    rtts = a.rtts if a.rtts is not None else ([0.0, 50.0] if a.quick else [0.0, 20.0, 50.0])

    from tests.netns_regions import regions
    from tests.runtime_support import build_small_dataset

    rows: list[dict[str, Any]] = []
    echo: list[dict[str, Any]] = []
    ports = 29500
    with tempfile.TemporaryDirectory(prefix="bench-rtt-") as d:
        dataset = build_small_dataset(Path(d) / "data")
        for w in workers:
            per = [w // REGIONS] * REGIONS
            per[0] += 1  # the coordinator's host
            with regions(per) as rs:
                if w == workers[0]:
                    echo = [echo_check(rs, rtt) for rtt in rtts]
                for mode in a.modes:
                    for rtt in rtts:
                        ports += 2
                        tmp = Path(d) / f"{mode}-{w}-{rtt:g}"
                        tmp.mkdir()
                        row = one_run(rs, dataset, mode, rtt, a.steps, a.warmup, ports, tmp,
                                      a.timeout)  # fmt: skip
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    derive(rows)
    hashes = {r["final_hash"] for r in rows if r["mode"].startswith("exact")}
    carried = {r["final_hash"] for r in rows if r["mode"].startswith("carried")}
    out = {
        "machine": machine(),
        "regions": REGIONS,
        "steps": a.steps,
        "warmup": a.warmup,
        "goal": GOAL,
        "echo": echo,
        "exact_hashes_agree": len(hashes) == 1,
        "carried_hashes_agree": len(carried) <= 1,
        "rows": rows,
    }
    print(write_result("rtt", out, a.out))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
