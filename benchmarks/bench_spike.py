"""Step time during a latency spike on one member: bench-out against waiting for it.

Real ``perdure run``s, 3 workers of a small tiny_lm (the goodput model of
bench_recovery.py), a ``delay`` fault on ``local-1`` (``--delay-ms`` on its heartbeats and
data-plane sends for ``--spike-s``). Three modes, taking turns per repeat:

- ``bench``: the default (``cluster.bench_lag_ms`` = 500): the lagging member leaves the
  collective and is planned back in once its link is back to speed;
- ``wait``: ``bench_lag_ms = 0``: it keeps its share and every step waits for its sends;
- ``bench, 1 warm spare``: as ``bench``, with a warm spare that takes the benched
  member's place (it receives the state).

Step time during the spike = the spike's wall time over the steps committed in it (so
detection, the re-plan and the redone step count), against the same measure over an
equal window before the spike; the *settled* ratio leaves out the spike's first
``SETTLE_S`` seconds (what a long spike costs per step). The issue's bar: <= 1.2x. Also
the median ``step_s`` in both windows, and whether every run ends with one final hash.

Limits: on this 2-core machine 2 workers are not slower than 3 (the cores are shared),
and whatever else runs takes its share of them, so the bench row pays up to 3/2 of the
compute per step for the member it lost, as a device per worker would (W / (W - 1) in
general); the spare row keeps three members.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ensure_dataset, machine
from bench_recovery import GP_MODEL, perdure_cfg
from bench_step import perdure_run

GOAL = 1.2
SETTLE_S = 1.5
"""The spike's first seconds (detection, the re-plan, the redone step) left out of the
settled ratio."""


def spike_schedule(at_step: int, delay_ms: int, spike_s: float) -> str:
    return (
        f'[[faults]]\nkind = "delay"\ntarget = "local-1"\nat_step = {at_step}\n'
        f"delay_ms = {delay_ms}\nduration_s = {spike_s}\n"
    )


def window_step_s(metrics: list[dict], t0: float, t1: float) -> float | None:
    """Wall seconds per committed step in ``[t0, t1]``."""
    n = sum(1 for m in metrics if t0 <= m["t"] <= t1)
    return (t1 - t0) / n if n else None


MODES = {"bench": (True, 0), "wait": (False, 0), "bench, 1 warm spare": (True, 1)}
"""Mode: (bench-out on, warm spares)."""


def one_run(dataset: str, mode: str, args: argparse.Namespace, run_dir: Path) -> dict:
    bench, spares = MODES[mode]
    cfg = perdure_cfg(GP_MODEL, 12, dataset)
    cfg["cluster"]["spares"] = spares
    if not bench:
        cfg["cluster"]["bench_lag_ms"] = 0
    chaos = spike_schedule(args.at_step, args.delay_ms, args.spike_s)
    r = perdure_run(cfg, args.steps, run_dir, chaos=chaos, timeout_s=900)
    events, metrics = r["events"], r["metrics"]
    hit = next((e["t"] for e in events if e["event"] == "fault_injected"), None)
    if r["rc"] != 0 or hit is None:
        return {"mode": mode, "rc": r["rc"], "error": r["stderr_tail"][-500:]}
    end = hit + args.spike_s
    before = window_step_s(metrics, hit - args.spike_s, hit)
    during = window_step_s(metrics, hit, end)
    settled = window_step_s(metrics, hit + SETTLE_S, end)
    bench_t = next((e["t"] for e in events if e["event"] == "member_benched"), None)
    med = lambda a, b: statistics.median(m["step_s"] for m in metrics if a <= m["t"] <= b)  # noqa: E731
    return {
        "mode": mode,
        "rc": 0,
        "before_s": before,
        "during_s": during,
        "ratio": during / before if during and before else None,
        "settled_s": settled,
        "settled_ratio": settled / before if settled and before else None,
        "bench_after_s": round(bench_t - hit, 3) if bench_t else None,
        "median_step_before_s": med(hit - args.spike_s, hit),
        "median_step_during_s": med(hit, end),
        "benched": [e["worker"] for e in events if e["event"] == "member_benched"],
        "evicted": [e["worker"] for e in events if e["event"] == "leave"],
        "final_hash": r["summary"].get("final_hash"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--at-step", type=int, default=100)
    ap.add_argument("--delay-ms", type=int, default=1000, help="the spike's added latency")
    ap.add_argument("--spike-s", type=float, default=6.0, help="how long the spike lasts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 repeat of 250 steps")
    ap.add_argument("--out", type=Path, default=RESULTS / "spike.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps = 1, 250
    dataset = str(ensure_dataset())
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="perdure-bench-spike-") as d:
        for rep in range(args.repeats):
            modes = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
            for k, mode in enumerate(modes):
                run = one_run(dataset, mode, args, Path(d) / f"m{k}r{rep}")
                print(json.dumps(run), flush=True)
                runs.append(run)
    out = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    out["runs"], out["summary"] = runs, summarize(runs)
    out["goal"] = GOAL
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out["summary"], indent=2))
    return 0


def summarize(runs: list[dict]) -> dict:
    """Per mode: min / median / max of the ratio, and whether every run kept the bits."""
    out = {}
    for mode in MODES:
        ratios = sorted(r["ratio"] for r in runs if r["mode"] == mode and r.get("ratio"))
        settled = sorted(
            r["settled_ratio"] for r in runs if r["mode"] == mode and r.get("settled_ratio")
        )
        hashes = {r.get("final_hash") for r in runs if r.get("rc") == 0}
        out[mode] = {
            "ratio": [ratios[0], statistics.median(ratios), ratios[-1]] if ratios else None,
            "settled_ratio": [settled[0], statistics.median(settled), settled[-1]]
            if settled
            else None,
            "runs": len(ratios),
            "one_final_hash": len(hashes) == 1 and None not in hashes,
        }
    return out


if __name__ == "__main__":
    raise SystemExit(main())
