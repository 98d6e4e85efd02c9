"""perdure's slot-based step against DistributedDataParallel on gloo, side by side.

    .venv/bin/python benchmarks/bench_step.py            # small and ~10M-param tiny_lm, W = 2
    .venv/bin/python benchmarks/bench_step.py --quick    # small model only, few steps

In-loop comparison (no coordinator): W spawned processes, one intra-op thread each
(``train.threads_per_worker``), each holding both

- a perdure replica: ``perdure.runtime.replica.trainer.Trainer`` (model, AdamW, SlotLoader), the
  step exactly as ``perdure/runtime/worker.py`` runs it: ``compute_slots`` over this rank's
  contiguous slot range (per-slot seeding, forward, backward, flatten, finiteness flags),
  two fresh ``torch.empty(n)`` buffers, ``chain_reduce`` on the comm thread
  (``perdure.runtime.comm.group.Comm``), ``bad_slots``, ``Trainer.apply`` (scale, clip, AdamW);
- ``perdure_prealloc``: the step as ``worker.py`` runs it now: buffers allocated once per
  epoch, and the chain reduction streaming behind the last slot's backward (``Readiness``);
  the plain ``perdure`` arm is the sequential variant (compute all, then reduce);
- a DDP replica: the same task (same init), the same optimizer (AdamW, foreach=False) and
  clipping, ``DistributedDataParallel`` over the default gloo group, one forward/backward
  per step over this rank's B/W samples (read from the same SlotLoader slots), the loss
  divided by B/W (DDP averages over W).

Each repeat times every arm for ``--steps`` steps, in a rotating order, from a barrier to a
barrier (the slowest rank). Ratios are per repeat: perdure / DDP.

Whole runtime: ``perdure run`` of the same config and W (coordinator, heartbeats,
fingerprints; checkpoints off), median ``step_s`` of ``metrics.jsonl`` (first steps
dropped), against the DDP median of the in-loop repeats.

Results: ``benchmarks/results/step.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    REPO,
    ensure_dataset,
    fmt,
    free_port,
    machine,
    ratios,
    stats,
    write_result,
)

MODELS = {
    "small": {"d_model": 64, "n_layers": 2, "n_heads": 4, "dropout": 0.1},
    "10M": {"d_model": 384, "n_layers": 6, "n_heads": 6, "dropout": 0.1},
}


def make_config(model: str, global_batch: int, slots: int, workers: int, dataset: str) -> dict:
    return {
        "task": {"entry": "examples.tiny_lm.task:make_task", "options": MODELS[model]},
        "optim": {"name": "adamw", "lr": 1e-3, "grad_clip": 1.0},
        "train": {"steps": 100000, "global_batch": global_batch, "slots": slots},
        "data": {"dataset": dataset},
        "cluster": {"regions": [{"name": "local", "workers": workers}]},
        "checkpoint": {"every_steps": 0},
    }


def _worker(rank, W, port, cfg, steps, repeats, q):  # pragma: no cover - subprocess
    import os
    from datetime import timedelta

    os.chdir(REPO)
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from perdure.run_config import config_from_dict
    from perdure.runtime.comm.chain import chain_reduce
    from perdure.runtime.comm.group import Comm
    from perdure.runtime.replica.slots import Readiness
    from perdure.runtime.replica.task import build_optimizer, build_task
    from perdure.runtime.replica.trainer import Trainer

    timeout = timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, W, rank == 0, timeout, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=W, timeout=timeout)
    config = config_from_dict(cfg)
    tr = Trainer(config)  # sets threads_per_worker and deterministic algorithms
    comm = Comm(store, "perdure-bench", rank, W, timeout, lambda: False)
    S = config.train.slots
    per = S // W
    my = range(rank * per, (rank + 1) * per)
    bufs = [tr.engine.new_buffer() for _ in my]
    n = tr.engine.size
    pre_partial, pre_out = torch.zeros(n), torch.zeros(n)

    task = build_task(config.task, config.train.seed)
    ddp = DDP(task.model, process_group=dist.group.WORLD)
    opt = build_optimizer(task, config.optim)
    loss_fn = task.loss_fn
    step_no = {"perdure": 0, "ddp": 0}
    acc = {
        k: {"compute": 0.0, "reduce": 0.0, "apply": 0.0, "fwd_bwd": 0.0, "opt": 0.0}
        for k in ("perdure", "perdure_prealloc", "ddp")
    }

    def perdure_step(prealloc: bool) -> None:
        a = acc["perdure_prealloc" if prealloc else "perdure"]
        t = step_no["perdure"]
        t0 = time.perf_counter()
        if prealloc:  # as worker.py runs it: the chain streams behind the last backward
            partial, out = pre_partial, pre_out
            tr.compute_slots(t, my[:-1], bufs[:-1])
            ready = Readiness()
            fut = comm.submit(
                lambda: chain_reduce(
                    comm.pg,
                    rank,
                    W,
                    bufs,
                    partial,
                    out,
                    timeout=timeout,
                    wait_last=lambda hi: ready.wait(hi, lambda: False, 60.0),
                )
            )
            tr.compute_slots(t, my[-1:], bufs[-1:], ready=ready)
            t1 = time.perf_counter()
            comm.result(fut)
        else:  # sequential: compute every slot, then reduce, with fresh buffers
            tr.compute_slots(t, my, bufs)
            t1 = time.perf_counter()
            partial, out = torch.empty(n), torch.empty(n)
            comm.call(lambda: chain_reduce(comm.pg, rank, W, bufs, partial, out, timeout=timeout))
        t2 = time.perf_counter()
        assert not tr.engine.bad_slots(out)
        tr.apply(t, out)
        t3 = time.perf_counter()
        a["compute"] += t1 - t0
        a["reduce"] += t2 - t1
        a["apply"] += t3 - t2
        step_no["perdure"] += 1

    def ddp_step() -> None:
        a = acc["ddp"]
        t = step_no["ddp"]
        t0 = time.perf_counter()
        toks = np.concatenate([tr.loader.batch(t, s).tokens for s in my])
        batch = {
            "tokens": torch.from_numpy(np.ascontiguousarray(toks, dtype=np.int64)),
            "weight": torch.ones(len(toks)),
        }
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp, batch) / len(toks)
        loss.backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0, foreach=False)
        opt.step()
        t2 = time.perf_counter()
        a["fwd_bwd"] += t1 - t0
        a["opt"] += t2 - t1
        step_no["ddp"] += 1

    arms = {
        "perdure": lambda: perdure_step(False),
        "perdure_prealloc": lambda: perdure_step(True),
        "ddp": ddp_step,
    }
    names = list(arms)
    for nm in names:  # warm-up
        arms[nm]()
        arms[nm]()
    for a in acc.values():
        for k in a:
            a[k] = 0.0
    times = {nm: [] for nm in names}
    for r in range(repeats):
        k = r % len(names)
        for nm in names[k:] + names[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                arms[nm]()
            dist.barrier()
            times[nm].append((time.perf_counter() - t0) / steps)
    total = steps * repeats
    breakdown = {nm: {k: v / total for k, v in a.items() if v} for nm, a in acc.items()}
    gathered = [None] * W
    dist.all_gather_object(gathered, breakdown)
    if rank == 0:
        q.put(
            {
                "times": times,
                "breakdown_per_rank": gathered,
                "params": tr.engine.numel,
            }
        )
    dist.barrier()
    comm.close()
    tr.close()
    dist.destroy_process_group()


def in_loop(cfg: dict, W: int, steps: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, W, port, cfg, steps, repeats, q)) for r in range(W)
    ]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return res


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: dict) -> str:
    lines = []
    for sec, body in cfg.items():
        lines.append(f"[{sec}]")
        for k, v in body.items():
            lines.append(f"{k} = {toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def perdure_run(
    cfg: dict,
    steps: int,
    run_dir: Path,
    chaos: str | None = None,
    timeout_s: float = 600,
    cwd: Path = REPO,
) -> dict:
    """``perdure run`` as a user starts it; returns metrics, events, summary and wall time.
    ``cwd``: where it runs; its ``perdure`` package is the one every process imports
    (``python -m perdure`` puts the working directory first on ``sys.path``, before
    ``PYTHONPATH``), so a worktree of another commit runs that commit's code."""
    cfg = json.loads(json.dumps(cfg))
    cfg["train"]["steps"] = steps
    # the config is written outside the repository: tasks resolve from the repository
    cfg.setdefault("run", {}).setdefault("base_dir", str(REPO))
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "bench.toml"
    path.write_text(to_toml(cfg))
    cmd = [
        str(REPO / ".venv/bin/perdure"),
        "run",
        str(path),
        "--run-dir",
        str(run_dir),
        "--no-live",
        "--timeout-s",
        str(timeout_s),
    ]
    if chaos:
        cp = run_dir / "chaos.toml"
        cp.write_text(chaos)
        cmd += ["--chaos", str(cp)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s + 60)
    wall = time.perf_counter() - t0

    def jl(name):
        p = run_dir / name
        if not p.exists():
            return []
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]

    summary = {}
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "rc": proc.returncode,
        "wall_s": wall,
        "stderr_tail": proc.stderr[-2000:],
        "metrics": jl("metrics.jsonl"),
        "events": jl("events.jsonl"),
        "summary": summary,
    }


def whole_runtime(cfg: dict, steps: int, skip: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="perdure-bench-step-") as d:
        r = perdure_run(cfg, steps, Path(d) / "run")
    steps_s = [m["step_s"] for m in r["metrics"] if m["step"] >= skip]
    out = {"rc": r["rc"], "steps": len(r["metrics"]), "wall_s": r["wall_s"]}
    if r["rc"] != 0 or not steps_s:
        out["error"] = r["stderr_tail"]
        return out
    out["step_s"] = stats(steps_s)
    out["summary_wall_s"] = r["summary"].get("wall_s")
    return out


CASES_FULL = [
    # model, global batch, slots multiplier (slots = mult * W), steps/repeat, repeats, runtime steps
    ("small", 32, 1, 10, 5, 40),
    ("small", 32, 4, 10, 5, 40),
    ("10M", 8, 1, 4, 5, 20),
    ("10M", 8, 4, 3, 5, 16),
]
CASES_QUICK = [("small", 32, 1, 5, 3, 15), ("small", 32, 4, 5, 3, 15)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-runtime", action="store_true", help="skip the whole-runtime runs")
    ap.add_argument("--models", nargs="*")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    dataset = ensure_dataset()
    W = a.workers
    cases = CASES_QUICK if a.quick else CASES_FULL
    if a.models:
        cases = [c for c in cases if c[0] in a.models]
    rows = []
    t_start = time.perf_counter()
    for model, B, mult, steps, repeats, rt_steps in cases:
        S = mult * W
        cfg = make_config(model, B, S, W, dataset)
        res = in_loop(cfg, W, steps, repeats)
        t = res["times"]
        row = {
            "model": model,
            "params": res["params"],
            "workers": W,
            "global_batch": B,
            "slots": S,
            "steps_per_repeat": steps,
            "repeats": repeats,
            "ddp_step_s": stats(t["ddp"]),
            "perdure_step_s": stats(t["perdure"]),
            "perdure_prealloc_step_s": stats(t["perdure_prealloc"]),
            "ratio_perdure_over_ddp": ratios(t["perdure"], t["ddp"]),
            "ratio_prealloc_over_ddp": ratios(t["perdure_prealloc"], t["ddp"]),
            "breakdown_s_per_step": res["breakdown_per_rank"],
        }
        if not a.no_runtime:
            rt = whole_runtime(cfg, rt_steps, skip=3)
            row["runtime"] = rt
            if "step_s" in rt:
                row["ratio_runtime_over_ddp_median"] = (
                    rt["step_s"]["median"] / row["ddp_step_s"]["median"]
                )
        rows.append(row)
        print(
            f"{model:>5} ({res['params'] / 1e6:.2f}M) W={W} B={B} S={S}: "
            f"ddp {row['ddp_step_s']['median'] * 1e3:.1f} ms, perdure "
            f"{row['perdure_step_s']['median'] * 1e3:.1f} ms, ratio "
            f"{fmt(row['ratio_perdure_over_ddp'])}, prealloc {fmt(row['ratio_prealloc_over_ddp'])}"
            + (
                f", runtime step_s {row['runtime']['step_s']['median'] * 1e3:.1f} ms"
                f" ({row['ratio_runtime_over_ddp_median']:.3f}x)"
                if "ratio_runtime_over_ddp_median" in row
                else ""
            ),
            flush=True,
        )
    meds = [r["ratio_perdure_over_ddp"]["median"] for r in rows]
    data = {
        "name": "step",
        "machine": machine(),
        "quick": a.quick,
        "threads_per_process": 1,
        "goal": "perdure step <= 1.10x DDP",
        "rows": rows,
        "summary": {
            "ratio_perdure_over_ddp_medians": stats(meds),
            "goal_met_rows": sum(m <= 1.10 for m in meds),
            "rows": len(meds),
            "goal_met": all(m <= 1.10 for m in meds),
        },
        "seconds": time.perf_counter() - t_start,
    }
    print(f"wrote {write_result('step', data, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
