"""A replacement's time to be planned in, with and without the zygote's task preload.

    .venv/bin/python benchmarks/bench_preload.py            # 3 repeats of each
    .venv/bin/python benchmarks/bench_preload.py --quick    # 1 repeat of each

Workload: ``configs/hf_lm.toml``'s task (a ``transformers`` GPT-2, whose import costs
seconds on top of torch's; d_model 32, 2 layers), 2 workers in 2 regions, one intra-op
thread each (on a 2-core machine the survivor keeps one core busy; the replacement starts
at idle priority beside it); worker
``r1-0`` SIGKILLed at step ``--kill-at`` (a ``kill`` fault). The launcher starts a
replacement ``replace_after_ms`` (300) later, forked from the zygote, at idle CPU
priority until its trainer is built; it is planned in at a step boundary once ready.

- ``preload``: ``cluster.preload_task = true`` (the default): the zygote imported
  ``examples.hf_lm.task`` (and so ``transformers``) before forking;
- ``no_preload``: ``cluster.preload_task = false``: the zygote imported torch and perdure
  only; the replacement imports ``transformers`` itself.

Measured from the run's own event log: *planned in* = the ``epoch_started`` that first
lists ``r1-0`` again, minus the ``replacement_started`` event (the replacement's start-up:
fork, admission, task import and build, warm-up slot, state copy's epoch), and minus the
``fault_injected`` event (what the fault cost in all); a replacement the run ended without
is reported as ``not_in_after_s`` (a lower bound: its start to the run's last event). On
a machine whose cores are busy with other work a replacement at idle priority can starve
(SCHED_IDLE runs only when nothing else is runnable): the less CPU its start-up needs,
the sooner it is in. The two variants alternate within
each repeat; the ratio is paired per repeat (preload / no_preload).

Also, without a run: the seconds a fork spends importing the task module, forked from a
process that imported torch and perdure's worker as the zygote does, with and without the
module preloaded in the parent (``--fork-repeats`` forks each; the part of the start-up
that preloading removes, free of the run's scheduling). Results:
``benchmarks/results/preload.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ensure_dataset, machine, ratios, stats, write_result
from bench_step import perdure_run

VICTIM = "r1-0"


def config(dataset: str, preload: bool) -> dict:
    return {
        "task": {
            "entry": "examples.hf_lm.task:make_task",
            "options": {"d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.1},
        },
        "optim": {"lr": 1e-3, "warmup_steps": 20},
        "train": {"steps": 0, "global_batch": 16, "slots": 8, "threads_per_worker": 1},
        "data": {"dataset": dataset},
        "cluster": {
            "regions": [{"name": "r0", "workers": 1}, {"name": "r1", "workers": 1}],
            "replace_after_ms": 300,
            "preload_task": preload,
        },
        "checkpoint": {"every_steps": 0},
        "metrics": {"tensorboard": False, "prometheus": False},
    }


def planned_in(events: list[dict]) -> dict[str, float | None]:
    """Seconds from the kill and from the replacement's start to the epoch that plans it in."""
    kill = next((e["t"] for e in events if e["event"] == "fault_injected"), None)
    start = next(
        (e["t"] for e in events if e["event"] == "replacement_started" and e["worker"] == VICTIM),
        None,
    )
    epoch = None
    if start is not None:
        epoch = next(
            (
                e["t"]
                for e in events
                if e["event"] == "epoch_started"
                and e["t"] > start
                and VICTIM in e["plan"]["members"]
            ),
            None,
        )
    last = max((e["t"] for e in events), default=None)
    return {
        "from_kill_s": round(epoch - kill, 3) if epoch and kill else None,
        "from_start_s": round(epoch - start, 3) if epoch and start else None,
        # not planned in before the run ended: it took longer than this (a lower bound)
        "not_in_after_s": round(last - start, 3) if not epoch and start and last else None,
    }


def one(dataset: str, preload: bool, steps: int, kill_at: int) -> dict:
    chaos = f'[[faults]]\nkind = "kill"\ntarget = "{VICTIM}"\nat_step = {kill_at}\n'
    with tempfile.TemporaryDirectory(prefix="bench-preload-") as d:
        r = perdure_run(config(dataset, preload), steps, Path(d) / "run", chaos=chaos)
    s = r["summary"]
    out = {
        "rc": r["rc"],
        "wall_s": round(r["wall_s"], 2),
        **planned_in(r["events"]),
        "final_hash": s.get("final_hash"),
        "survivor_restarts": s.get("survivor_restarts"),
    }
    if r["rc"] != 0:
        out["stderr_tail"] = r["stderr_tail"]
    return out


_FORK = """
import os, sys, time, importlib
sys.path.insert(0, sys.argv[1])
import torch._inductor.config, perdure.runtime.entry, perdure.runtime.worker
if sys.argv[2] == "1":
    importlib.import_module("examples.hf_lm.task")
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    t0 = time.perf_counter()
    importlib.import_module("examples.hf_lm.task")
    os.write(w, repr(time.perf_counter() - t0).encode())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
print(os.read(r, 100).decode())
"""


def fork_import_s(preloaded: bool) -> float:
    """Seconds a zygote-like parent's fork spends importing the task module."""
    import subprocess

    from _common import PY, REPO

    out = subprocess.run(
        [PY, "-c", _FORK, str(REPO), "1" if preloaded else "0"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--kill-at", type=int, default=20)
    ap.add_argument("--fork-repeats", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    repeats = a.repeats or (1 if a.quick else 3)
    steps = a.steps or (250 if a.quick else 400)
    dataset = ensure_dataset()
    forks: dict[str, list[float]] = {"preload": [], "no_preload": []}
    for i in range(a.fork_repeats or (3 if a.quick else 5)):
        for preload in [True, False] if i % 2 == 0 else [False, True]:
            forks["preload" if preload else "no_preload"].append(fork_import_s(preload))
    print(f"task import in a fork: {forks}", flush=True)
    runs: dict[str, list[dict]] = {"preload": [], "no_preload": []}
    for i in range(repeats):
        order = [True, False] if i % 2 == 0 else [False, True]
        for preload in order:
            r = one(dataset, preload, steps, a.kill_at)
            runs["preload" if preload else "no_preload"].append(r)
            print(("preload   " if preload else "no_preload"), r, flush=True)

    def col(name: str, key: str) -> list[float]:
        return [r[key] for r in runs[name] if r[key] is not None]

    pairs = [
        (p["from_start_s"], n["from_start_s"])
        for p, n in zip(runs["preload"], runs["no_preload"], strict=True)
        if p["from_start_s"] and n["from_start_s"]
    ]
    bounds = [
        (p["from_start_s"], n["not_in_after_s"])
        for p, n in zip(runs["preload"], runs["no_preload"], strict=True)
        if p["from_start_s"] and n["not_in_after_s"]
    ]
    hashes = {r["final_hash"] for rs in runs.values() for r in rs}
    result = {
        "benchmark": "preload",
        "machine": machine(),
        "workload": {
            "task": "examples.hf_lm (transformers GPT-2)",
            "workers": 3,
            "steps": steps,
            "kill_at": a.kill_at,
        },
        "repeats": repeats,
        "fork_import_s": {k: stats(v) for k, v in forks.items()},
        "fork_import_raw_s": forks,
        "runs": runs,
        "planned_in_from_start_s": {k: stats(col(k, "from_start_s")) for k in runs},
        "planned_in_from_kill_s": {k: stats(col(k, "from_kill_s")) for k in runs},
        "ratio_preload_over_no_preload": ratios([p for p, _ in pairs], [n for _, n in pairs]),
        "ratio_at_most": ratios([p for p, _ in bounds], [n for _, n in bounds]),
        "final_hashes_agree": len(hashes) == 1 and None not in hashes,
    }
    path = write_result("preload", result, a.out)
    print(f"planned in from the replacement's start: {result['planned_in_from_start_s']}")
    print(f"ratio preload / no_preload: {result['ratio_preload_over_no_preload']}")
    print(f"final hashes agree: {result['final_hashes_agree']}; written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
