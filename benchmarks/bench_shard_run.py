"""Real runs with replica groups: the parameters sharded at rest against the optimizer
state alone, and against the unsharded run, side by side.

    .venv/bin/python benchmarks/bench_shard_run.py            # W = 4, ~1M params, 12 steps
    .venv/bin/python benchmarks/bench_shard_run.py --steps 6  # quicker

Every point is a real ``perdure run`` (coordinator + 4 worker processes on this machine,
one intra-op thread each, the exact reduction) of the tiny_lm task on the stdlib dataset:

- ``k1``: unsharded (every rank a whole replica);
- ``k2_optimizer``: ``train.shard_degree = 2``, the optimizer state sharded, the
  parameters whole;
- ``k2_at_rest`` / ``k4_at_rest``: ``train.shard_params = true`` too (the gathers
  prefetched, the default); ``*_no_prefetch``: each unit gathered at its use;
- ``*_per_module``: the same with ``task.init = "per_module"`` (each rank makes only its
  shard; another initialisation, so compared with ``k1_per_module``).

Reported: the final hash (equal to ``k1``'s or not), the median step time (steps >= 2)
as a ratio of ``k1``'s, the parameter bytes a rank keeps between slots (the largest
``params_at_rest`` event) and the most it held at once (``params_peak``: resident
parameters plus a gather's temporary) as shares of the whole replica's, the most a rank
held before its first slot (``params_at_rest``'s ``init_peak_bytes``: building the model
and taking its shard), and a rank's broadcasts per step. The 4 workers share 2 cores,
so the step-time ratios show the gathers' cost under oversubscription, not on 4 hosts.

Results: ``benchmarks/results/shard_run.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ensure_dataset, machine, write_result
from bench_step import perdure_run

VARIANTS = {
    "k1": {"shard_degree": 1},
    "k2_optimizer": {"shard_degree": 2},
    "k2_at_rest": {"shard_degree": 2, "shard_params": True},
    "k4_at_rest": {"shard_degree": 4, "shard_params": True},
    "k2_at_rest_no_prefetch": {"shard_degree": 2, "shard_params": True, "shard_prefetch": False},
    "k4_at_rest_no_prefetch": {"shard_degree": 4, "shard_params": True, "shard_prefetch": False},
    "k1_per_module": {"shard_degree": 1, "init": "per_module"},
    "k2_at_rest_per_module": {"shard_degree": 2, "shard_params": True, "init": "per_module"},
    "k4_at_rest_per_module": {"shard_degree": 4, "shard_params": True, "init": "per_module"},
}
"""``init`` goes to ``task.init``; the rest to ``train``. A variant's final hash is
compared with ``k1``'s, or ``k1_per_module``'s for ``per_module`` (another math)."""


def cfg(variant: dict, dataset: str) -> dict:
    train = {k: v for k, v in variant.items() if k != "init"}
    return {
        "task": {
            "entry": "examples.tiny_lm.task:make_task",
            "options": {"d_model": 128, "n_layers": 5, "n_heads": 4, "dropout": 0.1},
            "init": variant.get("init", "eager"),
        },
        "optim": {"name": "adamw", "lr": 1e-3, "grad_clip": 1.0},
        "train": {"global_batch": 32, "slots": 8, "reduction": "exact", **train},
        "data": {"dataset": dataset},
        "cluster": {"regions": [{"name": "local", "workers": 4}]},
        "checkpoint": {"every_steps": 0},
    }


def point(name: str, steps: int, dataset: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="perdure-bench-shard-") as d:
        r = perdure_run(cfg(VARIANTS[name], dataset), steps, Path(d) / "run", timeout_s=900)
    ms = [m["step_s"] for m in r["metrics"] if m["step"] >= 2]
    rest = [e for e in r["events"] if e.get("event") == "params_at_rest"]
    peak = [e for e in r["events"] if e.get("event") == "params_peak"]
    steps_run = max(1, len({m["step"] for m in r["metrics"]}))
    out = {
        "variant": name,
        "rc": r["rc"],
        "final_hash": r["summary"].get("final_hash"),
        "step_s": statistics.median(ms) if ms else None,
        "params_at_rest": max(e["bytes"] / e["of"] for e in rest) if rest else 1.0,
        "params_peak": max(e["peak_bytes"] / e["of"] for e in peak) if peak else 1.0,
        "params_before_first_slot": (
            max(e["init_peak_bytes"] / e["of"] for e in rest) if rest else 1.0
        ),
        "broadcasts_per_step": max(e["gathers"] for e in peak) / steps_run if peak else 0,
        "prefetched_per_step": max(e["prefetched"] for e in peak) / steps_run if peak else 0,
    }
    if r["rc"]:
        out["error"] = r["stderr_tail"][-800:]
    print({k: v for k, v in out.items() if k != "error"}, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    dataset = ensure_dataset()
    points = [point(name, a.steps, dataset) for name in a.variants]
    by_name = {p["variant"]: p for p in points}
    for p in points:
        ref = by_name.get("k1_per_module" if "per_module" in p["variant"] else "k1")
        p["hash_equal"] = None if ref is None else p["final_hash"] == ref["final_hash"] is not None
        base = by_name.get("k1")
        if base and p["step_s"] and base["step_s"]:
            p["step_ratio"] = round(p["step_s"] / base["step_s"], 3)
    path = write_result(
        "shard_run", {"machine": machine(), "steps": a.steps, "points": points}, a.out
    )
    print(f"wrote {path}")
    return 0 if all(p["rc"] == 0 and p["hash_equal"] is not False for p in points) else 1


if __name__ == "__main__":
    raise SystemExit(main())
