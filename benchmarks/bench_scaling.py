"""How perdure's step, recovery and checkpoint times grow with workers, model size, slots.

    .venv/bin/python benchmarks/bench_scaling.py            # workers 1..8, ~1M..100M params
    .venv/bin/python benchmarks/bench_scaling.py --quick    # a few small points

Every point is a real ``perdure run`` (coordinator + worker processes, one intra-op thread
each) of the tiny_lm task on the stdlib dataset:

- step time: median ``step_s`` of ``metrics.jsonl`` (first 2 steps dropped);
- checkpoint time: the final checkpoint's ``checkpoint_saved`` event (``seconds``: the
  write; ``snapshot_seconds``: what blocks the step loop);
- recovery time: a ``kill`` of worker ``local-1`` at a step; fault to next commit.

Series: workers 1, 2, 4, 8 (small model); model size ~1M, ~10M, ~100M params (2 workers,
few steps for the largest); slots 2, 8, 32 (2 workers); recovery with 2, 4, 8 workers.
On this 2-core machine, more than 2 workers time-share the cores: the worker series shows
oversubscription, not what W machines would do.

Results: ``benchmarks/results/scaling.json``, PNG plots ``benchmarks/results/scaling_*.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, ensure_dataset, machine, write_result
from bench_recovery import kill_schedule
from bench_step import perdure_run

MODELS = {
    "1M": {"d_model": 128, "n_layers": 5, "n_heads": 4},
    "10M": {"d_model": 384, "n_layers": 6, "n_heads": 6},
    "100M": {"d_model": 1024, "n_layers": 8, "n_heads": 16},
    "small": {"d_model": 64, "n_layers": 2, "n_heads": 4},
}


def cfg(model: str, W: int, B: int, S: int, dataset: str) -> dict:
    return {
        "task": {
            "entry": "examples.tiny_lm.task:make_task",
            "options": {**MODELS[model], "dropout": 0.1},
        },
        "optim": {"name": "adamw", "lr": 1e-3, "grad_clip": 1.0},
        "train": {"steps": 10, "global_batch": B, "slots": S},
        "data": {"dataset": dataset},
        "cluster": {"regions": [{"name": "local", "workers": W}]},
        "checkpoint": {"every_steps": 0},
    }


def point(model: str, W: int, B: int, S: int, steps: int, dataset: str, kill_at=None) -> dict:
    c = cfg(model, W, B, S, dataset)
    chaos = kill_schedule([kill_at], ["local-1"]) if kill_at is not None else None
    with tempfile.TemporaryDirectory(prefix="perdure-bench-scale-") as d:
        r = perdure_run(c, steps, Path(d) / "run", chaos=chaos, timeout_s=900)
    out = {
        "model": model,
        "workers": W,
        "global_batch": B,
        "slots": S,
        "steps": steps,
        "rc": r["rc"],
        "wall_s": r["wall_s"],
    }
    if r["rc"]:
        out["error"] = r["stderr_tail"][-800:]
    ms = [
        m["step_s"]
        for m in r["metrics"]
        if m["step"] >= 2 and (kill_at is None or m["step"] < kill_at)
    ]
    out["step_s"] = statistics.median(ms) if ms else None
    saved = [e for e in r["events"] if e.get("event") == "checkpoint_saved"]
    if saved:
        out["checkpoint_s"] = saved[-1].get("seconds")
        out["checkpoint_snapshot_s"] = saved[-1].get("snapshot_seconds")
        out["checkpoint_bytes"] = saved[-1].get("bytes")
    if kill_at is not None:
        f = [e for e in r["events"] if e.get("event") == "fault_injected"]
        if f:
            after = [m for m in r["metrics"] if m["t"] > f[0]["t"]]
            out["recovery_s"] = after[0]["t"] - f[0]["t"] if after else None
    print({k: v for k, v in out.items() if k != "error"}, flush=True)
    return out


def plot(series: dict, path_prefix: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    specs = [
        ("workers", "workers", "workers (2 cores: >2 time-share)", ["step_s"]),
        ("model", "params", "parameters", ["step_s", "checkpoint_s", "checkpoint_snapshot_s"]),
        ("slots", "slots", "slots per step (W=2)", ["step_s"]),
        ("recovery", "workers", "workers", ["recovery_s", "step_s"]),
    ]
    for name, xkey, xlabel, ykeys in specs:
        pts = [p for p in series.get(name, []) if p.get(ykeys[0]) is not None]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.4), dpi=100)
        for yk in ykeys:
            xs = [p[xkey] for p in pts if p.get(yk) is not None]
            ys = [p[yk] for p in pts if p.get(yk) is not None]
            ax.plot(xs, ys, marker="o", label=yk)
        if name == "model":
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds")
        ax.set_title(f"perdure: {name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = Path(f"{path_prefix}_{name}.png")
        fig.savefig(out)
        plt.close(fig)
        written.append(out.name)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    dataset = ensure_dataset()
    t0 = time.perf_counter()
    series: dict[str, list] = {}
    if a.quick:
        series["workers"] = [point("small", w, 16, 8, 8, dataset) for w in (1, 2)]
        series["model"] = [point(m, 2, 4, 2, 5, dataset) for m in ("small", "1M")]
        series["slots"] = [point("small", 2, 16, s, 8, dataset) for s in (2, 16)]
        series["recovery"] = []
    else:
        series["workers"] = [point("small", w, 32, 16, 20, dataset) for w in (1, 2, 4, 8)]
        series["model"] = [
            point("1M", 2, 8, 2, 12, dataset),
            point("10M", 2, 4, 2, 6, dataset),
            point("100M", 2, 2, 2, 4, dataset),
        ]
        series["slots"] = [point("small", 2, 32, s, 20, dataset) for s in (2, 8, 32)]
        series["recovery"] = [point("small", w, 32, 16, 24, dataset, kill_at=12) for w in (2, 4, 8)]
    # parameter counts (no process group needed)
    import torch

    from examples.tiny_lm.task import make_task

    counts = {}
    for p in series["model"]:
        m = p["model"]
        if m not in counts:
            torch.manual_seed(0)
            counts[m] = sum(x.numel() for x in make_task(**MODELS[m]).model.parameters())
        p["params"] = counts[m]
    out_dir = Path(a.out).parent if a.out else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = plot(series, out_dir / "scaling")
    data = {
        "name": "scaling",
        "machine": machine(),
        "quick": a.quick,
        "models": MODELS,
        "series": series,
        "plots": pngs,
        "seconds": time.perf_counter() - t0,
    }
    print(f"wrote {write_result('scaling', data, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
