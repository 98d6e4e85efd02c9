"""Recovery from a worker kill: perdure vs torchrun --max-restarts vs torchft 0.2.0; goodput.

    .venv/bin/python benchmarks/bench_recovery.py            # 2 repeats, goodput 300 steps
    .venv/bin/python benchmarks/bench_recovery.py --quick    # 1 repeat each, goodput 60 steps

Same workload for the three: 3 replicas (one process each, one intra-op thread), the
tiny_lm task with ~2M parameters (d_model 128, 10 layers), global batch 6, AdamW; one
replica SIGKILLed right after step ``--kill-at`` committed.

- perdure: ``perdure run`` with a ``kill`` fault (``[[faults]] kind = "kill"``). Recovery =
  first ``metrics.jsonl`` line after the ``fault_injected`` event. Also: time to the new
  membership epoch (``epoch_started``), and the recovery minus the step time before the
  fault (what the fault added beyond redoing the in-flight step).
- torchrun: ``torchrun --max-restarts 3`` (c10d rendezvous, ``--monitor-interval 0.1``,
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) of ``peers/ddp_torchrun.py``: plain DDP, a
  ``torch.save`` + fsync checkpoint every ``--ckpt-every`` steps; the killed worker kills
  itself after its commit. All workers restart and resume from the checkpoint. Recovery =
  first commit of a step beyond the fault step (steps since the checkpoint are redone).
- torchft: ``torchft_lighthouse`` (min_replicas 1, default heartbeat timeout 5000 ms) and 3
  ``peers/torchft_replica.py`` processes (Manager, DDP, optimizer wrapper); the killed
  replica is restarted by this script at once (as a cluster manager would). Recovery = the
  survivors' first commit after the fault.

Goodput: the same 3-replica workload, smaller model (d_model 64, 2 layers, global batch 12),
``--goodput-steps`` steps, a kill every 50 steps (steps 50, 100, ...; alternating targets),
against the same run without faults: goodput = fault-free span / faulty span, where a span
is the time from the first to the last committed step (process start-up excluded). Each
system runs ``--goodput-repeats`` such pairs (3; the systems take turns within a repeat and
every other pair runs its faulty run first), reported as min / median / max of the
per-pair ratios; the goals read the median.

Results: ``benchmarks/results/recovery.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, ensure_dataset, free_port, machine, stats, write_result
from bench_step import perdure_run

PEERS = Path(__file__).resolve().parent / "peers"
VENV_BIN = REPO / ".venv" / "bin"
T = TypeVar("T")
REC_MODEL = {"d_model": 128, "n_layers": 10, "n_heads": 4}
GP_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4}


def perdure_cfg(model: dict, B: int, dataset: str, workers: int = 3) -> dict:
    return {
        "task": {"entry": "examples.tiny_lm.task:make_task", "options": {**model, "dropout": 0.1}},
        "optim": {"name": "adamw", "lr": 1e-3, "grad_clip": 1.0},
        "train": {"steps": 30, "global_batch": B, "slots": B},
        "data": {"dataset": dataset},
        "cluster": {"regions": [{"name": "local", "workers": workers}]},
        "checkpoint": {"every_steps": 0},
    }


def model_args(model: dict) -> list[str]:
    """The peer scripts' model flags (``peers/*.py``)."""
    return [f"--{k.replace('_', '-')}={model[k]}" for k in ("d_model", "n_layers", "n_heads")]


def kill_schedule(steps_at: list[int], targets: list[str]) -> str:
    out = []
    for i, s in enumerate(steps_at):
        out.append(
            f'[[faults]]\nkind = "kill"\ntarget = "{targets[i % len(targets)]}"\nat_step = {s}\n'
        )
    return "\n".join(out)


def read_jsonl(p: Path) -> list[dict]:
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def span(commits: list[dict]) -> float | None:
    if len(commits) < 2:
        return None
    return commits[-1]["t"] - commits[0]["t"]


# -- perdure --------------------------------------------------------------------------------


def perdure_recovery(dataset: str, steps: int, kill_at: int) -> dict:
    cfg = perdure_cfg(REC_MODEL, 6, dataset)
    with tempfile.TemporaryDirectory(prefix="perdure-bench-rec-") as d:
        r = perdure_run(cfg, steps, Path(d) / "run", chaos=kill_schedule([kill_at], ["local-1"]))
    restarts = r["summary"].get("survivor_restarts")
    out = {"rc": r["rc"], "wall_s": r["wall_s"], "summary_restarts": restarts}
    faults = [e for e in r["events"] if e.get("event") == "fault_injected"]
    if r["rc"] != 0 or not faults:
        out["error"] = r["stderr_tail"]
        return out
    tf = faults[0]["t"]
    after = [m for m in r["metrics"] if m["t"] > tf]
    before = [m["step_s"] for m in r["metrics"] if m["t"] <= tf][3:]
    ep = [e for e in r["events"] if e.get("event") == "epoch_started" and e["t"] > tf]
    joins = [e for e in r["events"] if e.get("event") == "join" and e["t"] > tf]
    out.update(
        fault_step=faults[0].get("step"),
        recovery_s=after[0]["t"] - tf if after else None,
        next_step=after[0]["step"] if after else None,
        step_s_before=statistics.median(before) if before else None,
        new_epoch_s=ep[0]["t"] - tf if ep else None,
        replacement_join_s=joins[0]["t"] - tf if joins else None,
        lost_steps=0,
    )
    if after and before:
        out["recovery_minus_step_s"] = out["recovery_s"] - out["step_s_before"]
    # the stall when the replacement joins: the gap between commits around its epoch
    if len(ep) >= 2:
        tj = ep[1]["t"]
        pre = [m for m in r["metrics"] if m["t"] <= tj]
        post = [m for m in r["metrics"] if m["t"] > tj]
        if pre and post:
            out["join_commit_gap_s"] = post[0]["t"] - pre[-1]["t"]
            out["join_epoch_announce_to_start_s"] = tj - next(
                (
                    e["t"]
                    for e in r["events"]
                    if e.get("event") == "epoch_announced"
                    and e["t"] > tf
                    and e.get("reason") == "join"
                ),
                tj,
            )
    return out


def perdure_goodput(dataset: str, steps: int, spares: int = 0, faulty_first: bool = False) -> dict:
    """``spares``: warm standby workers; a kill then promotes one at once, and the killed
    worker's replacement refills the spare pool instead of entering the membership."""
    cfg = perdure_cfg(GP_MODEL, 12, dataset)
    cfg["cluster"]["spares"] = spares
    kills = list(range(50, steps, 50))
    res = {}
    with tempfile.TemporaryDirectory(prefix="perdure-bench-gp-") as d:
        runs = [("clean", None), ("faulty", kill_schedule(kills, ["local-1", "local-2"]))]
        for name, chaos in in_order(runs, faulty_first):
            r = perdure_run(cfg, steps, Path(d) / name, chaos=chaos, timeout_s=900)
            res[name] = {
                "rc": r["rc"],
                "span_s": span(r["metrics"]),
                "committed": len(r["metrics"]),
                "final_hash": r["summary"].get("final_hash"),
                "restarts": r["summary"].get("survivor_restarts"),
                "runtime_goodput": r["summary"].get("goodput"),
            }
            if r["rc"]:
                res[name]["error"] = r["stderr_tail"]
            elif chaos:
                res[name]["kills"] = kill_costs(r["metrics"], r["events"])
                res[name]["goodput_in_run"] = in_run_goodput(r["metrics"], kills)
    out = {"faults": len(kills), "kill_steps": kills, **res}
    if res["clean"]["span_s"] and res["faulty"]["span_s"]:
        out["goodput"] = res["clean"]["span_s"] / res["faulty"]["span_s"]
    out["bitwise_equal"] = res["clean"]["final_hash"] == res["faulty"]["final_hash"]
    return out


def gaps(metrics: list[dict]) -> dict[int, float]:
    """Step -> seconds from the previous step's commit to its own."""
    t = {m["step"]: m["t"] for m in metrics}
    return {s: t[s] - t[s - 1] for s in t if s - 1 in t}


COST_WINDOW = 20
"""Steps after a kill over which ``kill_costs`` sums its cost."""


def kill_costs(metrics: list[dict], events: list[dict]) -> list[dict]:
    """Per injected kill, from the faulty run's own logs (no second run, so no drift of
    the shared machine between runs): seconds from the kill to the commit of the next new
    step, and the *stall*: that commit's gap to the previous one less the run's median
    gap (what the kill added to the step it hit), also in median step times
    (``stall_steps``), and where the time went, each from the kill: the coordinator's
    ``leave`` (detection), its ``epoch_started`` (the survivors abandoned the step and
    reported ready) and the receiver's ``state_received`` (the copy done). ``cost_steps``:
    what the kill added over the ``COST_WINDOW`` steps from it (each gap less the median,
    summed, in median step times), which a copy paced over steps spreads its cost on."""
    step_gaps = gaps(metrics)
    median = statistics.median(step_gaps.values())
    out = []
    for f in (e for e in events if e.get("event") == "fault_injected"):
        after = [m for m in metrics if m["t"] > f["t"]]
        if not after:
            continue
        nxt = after[0]
        stall = step_gaps.get(nxt["step"], median) - median

        def since(name: str, f: dict = f, nxt: dict = nxt) -> float | None:
            hit = [e["t"] for e in events if e.get("event") == name and f["t"] <= e["t"]]
            return round(hit[0] - f["t"], 4) if hit and hit[0] <= nxt["t"] else None

        out.append(
            {
                "at_step": f.get("step"),
                "kill_to_next_s": nxt["t"] - f["t"],
                "stall_s": stall,
                "stall_steps": stall / median,
                "cost_steps": sum(
                    step_gaps.get(m["step"], median) - median for m in after[:COST_WINDOW]
                )
                / median,
                "median_step_s": median,
                "detected_s": since("leave"),
                "epoch_started_s": since("epoch_started"),
                "state_received_s": since("state_received"),
            }
        )
    return out


def in_run_goodput(metrics: list[dict], kills: list[int], every: int = 50) -> float | None:
    """Goodput measured inside the faulty run: its committed steps at the mean pace of
    its own undisturbed stretches (the second half of each interval between kills, far
    from a kill's stall, the replacement's start-up and its join), over its span. Steadier
    than the ratio of two runs, which moves with the machine's load between them; it
    misses a slowdown that lasts the whole run, which the two-run ratio catches."""
    step_gaps = gaps(metrics)
    calm = [g for s, g in step_gaps.items() if s > kills[0] - every and s % every >= every // 2]
    total = span(metrics)
    if not calm or not total:
        return None
    return statistics.fmean(calm) * len(step_gaps) / total


# -- torchrun -------------------------------------------------------------------------------


def torchrun_run(
    work: Path, steps: int, kill_at: int | list[int], model: dict, B: int, ckpt_every: int
) -> dict:
    log = work / "log.jsonl"
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        str(VENV_BIN / "torchrun"),
        "--nnodes",
        "1",
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "10",
        "--monitor-interval",
        "0.1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        str(PEERS / "ddp_torchrun.py"),
        "--step-log",
        str(log),
        "--ckpt-dir",
        str(work),
        "--steps",
        str(steps),
        "--global-batch",
        str(B),
        "--ckpt-every",
        str(ckpt_every),
        "--kill-at",
        str(kill_at),
        *model_args(model),
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return {
        "rc": p.returncode,
        "wall_s": time.perf_counter() - t0,
        "log": read_jsonl(log),
        "stderr_tail": p.stderr[-1500:],
    }


def peer_recovery(log: list[dict], survivor_filter=lambda e: True) -> dict:
    faults = [e for e in log if e.get("event") == "fault"]
    if not faults:
        return {"error": "no fault logged"}
    tf, fstep = faults[0]["t"], faults[0]["step"]
    commits = [e for e in log if e.get("event") == "commit" and survivor_filter(e)]
    after = [e for e in commits if e["t"] > tf]
    beyond = [e for e in after if e["step"] > fstep]
    before = [b["t"] - a["t"] for a, b in itertools.pairwise(commits) if b["t"] <= tf][3:]
    out = {
        "fault_step": fstep,
        # the run's first new step (a step beyond the one committed before the kill)
        "recovery_s": beyond[0]["t"] - tf if beyond else None,
        # restart-based: the first commit after the fault may redo a step (from a checkpoint)
        "first_commit_after_fault_s": after[0]["t"] - tf if after else None,
        "first_step_after_fault": after[0]["step"] if after else None,
        "recomputed_steps": (fstep + 1 - after[0]["step"]) if after else None,
        "step_s_before": statistics.median(before) if before else None,
    }
    return out


def torchrun_recovery(steps: int, kill_at: int, ckpt_every: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="perdure-bench-tr-") as d:
        r = torchrun_run(Path(d), steps, kill_at, REC_MODEL, 6, ckpt_every)
    out = {"rc": r["rc"], "wall_s": r["wall_s"], "ckpt_every": ckpt_every}
    if r["rc"] != 0:
        out["error"] = r["stderr_tail"]
    out.update(peer_recovery(r["log"]))
    return out


# -- torchft --------------------------------------------------------------------------------


def torchft_run(
    work: Path,
    steps: int,
    kills: list[int],
    model: dict,
    B: int,
    hb_ms: int = 5000,
    timeout_s: float = 600,
) -> dict:
    """3 replicas under a lighthouse; replica 1 is killed after each step of ``kills`` and
    restarted at once by this function."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.jsonl"
    lport = free_port()
    lh = subprocess.Popen(
        [
            str(VENV_BIN / "torchft_lighthouse"),
            "--min_replicas",
            "1",
            "--quorum_tick_ms",
            "100",
            "--join_timeout_ms",
            "1000",
            "--heartbeat_timeout_ms",
            str(hb_ms),
            "--bind",
            f"127.0.0.1:{lport}",
        ],
        stdout=open(work / "lighthouse.log", "w"),  # noqa: SIM115 - lives with the process
        stderr=subprocess.STDOUT,
    )
    procs: dict[int, subprocess.Popen] = {}
    kills = sorted(kills)

    def start(i: int, kill_at: int) -> subprocess.Popen:
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lport}",
            "OMP_NUM_THREADS": "1",
        }
        marker = work / f"killed-{kill_at}"
        return subprocess.Popen(
            [
                str(VENV_BIN / "python"),
                str(PEERS / "torchft_replica.py"),
                "--step-log",
                str(log),
                "--marker",
                str(marker),
                "--replica",
                str(i),
                "--replicas",
                "3",
                "--steps",
                str(steps),
                "--global-batch",
                str(B),
                "--kill-at",
                str(kill_at),
                "--kill-replica",
                "1",
                *model_args(model),
            ],
            cwd=REPO,
            env=env,
            stdout=open(work / f"replica{i}.log", "a"),
            stderr=subprocess.STDOUT,
        )

    t0 = time.perf_counter()
    err = None
    try:
        time.sleep(0.3)
        k = 0
        for i in range(3):
            procs[i] = start(i, kills[0] if (i == 1 and kills) else -1)
        while True:
            if time.perf_counter() - t0 > timeout_s:
                err = "timeout"
                break
            if procs[1].poll() is not None and procs[1].returncode != 0:
                k += 1  # killed: restart at once with the next kill step (if any)
                procs[1] = start(1, kills[k] if k < len(kills) else -1)
            if all(p.poll() == 0 for p in procs.values()):
                break
            if any(p.poll() not in (None, 0, -9) for p in procs.values()):
                err = f"replica exit codes {[p.poll() for p in procs.values()]}"
                break
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        lh.send_signal(signal.SIGTERM)
        try:
            lh.wait(5)
        except subprocess.TimeoutExpired:
            lh.kill()
    out = {"wall_s": time.perf_counter() - t0, "log": read_jsonl(log)}
    if err:
        tails = {}
        for f in sorted(work.glob("*.log")):
            tails[f.name] = f.read_text()[-800:]
        out["error"] = err
        out["log_tails"] = tails
    return out


def torchft_recovery(steps: int, kill_at: int, hb_ms: int = 5000) -> dict:
    with tempfile.TemporaryDirectory(prefix="perdure-bench-ft-") as d:
        r = torchft_run(Path(d), steps, [kill_at], REC_MODEL, 6, hb_ms)
    out = {"wall_s": r["wall_s"], "heartbeat_timeout_ms": hb_ms}
    if "error" in r:
        out["error"] = r["error"]
        out["log_tails"] = r.get("log_tails")
    # the survivors: replica 0 (never killed)
    out.update(peer_recovery(r["log"], lambda e: e.get("replica") == 0))
    return out


# -- goodput for the peers ------------------------------------------------------------------


def torchrun_goodput(steps: int, ckpt_every: int, faulty_first: bool = False) -> dict:
    res: dict = {}
    kills = list(range(50, steps, 50))
    with tempfile.TemporaryDirectory(prefix="perdure-bench-trgp-") as d:
        for name in in_order(["clean", "faulty"], faulty_first):
            if name == "clean":
                r = torchrun_run(Path(d) / name, steps, -1, GP_MODEL, 12, ckpt_every)
                res[name] = {"rc": r["rc"], "span_s": span(_commits(r["log"]))}
            else:  # the worker kills itself once at each kill step (see _torchrun_multi_kill)
                res[name] = _torchrun_multi_kill(Path(d) / name, steps, kills, ckpt_every)
    out = {"faults": len(kills), "kill_steps": kills, "ckpt_every": ckpt_every, **res}
    if res["clean"]["span_s"] and res["faulty"].get("span_s"):
        out["goodput"] = res["clean"]["span_s"] / res["faulty"]["span_s"]
    return out


def _commits(log: list[dict]) -> list[dict]:
    return [e for e in log if e.get("event") == "commit"]


def _torchrun_multi_kill(work: Path, steps: int, kills: list[int], ckpt_every: int) -> dict:
    """Kills at several steps: the peer script takes one --kill-at, so the env var
    BENCH_KILL_STEPS lists them all (see peers/ddp_torchrun.py)."""
    os.environ["BENCH_KILL_STEPS"] = ",".join(map(str, kills))
    try:
        r = torchrun_run(work, steps, -1, GP_MODEL, 12, ckpt_every)
    finally:
        os.environ.pop("BENCH_KILL_STEPS", None)
    commits = _commits(r["log"])
    return {
        "rc": r["rc"],
        "span_s": span(commits),
        "commits": len(commits),
        "faults_logged": sum(e.get("event") == "fault" for e in r["log"]),
    }


def torchft_goodput(steps: int, hb_ms: int = 5000, faulty_first: bool = False) -> dict:
    kills = list(range(50, steps, 50))
    res = {}
    with tempfile.TemporaryDirectory(prefix="perdure-bench-ftgp-") as d:
        for name, ks in in_order([("clean", []), ("faulty", kills)], faulty_first):
            r = torchft_run(Path(d) / name, steps, ks, GP_MODEL, 12, hb_ms, timeout_s=600)
            commits = [e for e in r["log"] if e.get("event") == "commit" and e.get("replica") == 0]
            res[name] = {"span_s": span(commits), "commits": len(commits)}
            if "error" in r:
                res[name]["error"] = r["error"]
    out = {"faults": len(kills), "kill_steps": kills, "heartbeat_timeout_ms": hb_ms, **res}
    if res["clean"]["span_s"] and res["faulty"]["span_s"]:
        out["goodput"] = res["clean"]["span_s"] / res["faulty"]["span_s"]
    return out


def in_order(runs: list[T], faulty_first: bool) -> list[T]:
    """A goodput pair's (clean, faulty) runs in the order to run them."""
    return runs[::-1] if faulty_first else runs


def goodput_rows(dataset: str, steps: int, repeats: int, ckpt_every: int, skip: list[str]) -> dict:
    """Each system's goodput over ``repeats`` clean+faulty pairs. The systems take turns
    within a repeat, and every other repeat runs the faulty run first, so that a drift of
    the shared machine reaches all systems and both sides of a pair alike."""
    pairs: dict[str, Callable[[bool], dict]] = {
        "perdure": lambda ff: perdure_goodput(dataset, steps, faulty_first=ff),
        "perdure, 1 warm spare": lambda ff: perdure_goodput(dataset, steps, 1, ff),
        "torchrun": lambda ff: torchrun_goodput(steps, ckpt_every, faulty_first=ff),
        "torchft": lambda ff: torchft_goodput(steps, faulty_first=ff),
    }
    runs: dict[str, list[dict]] = {}
    for r in range(repeats):
        for name, pair in pairs.items():
            if name.split(",")[0] in skip:
                continue
            runs.setdefault(name, []).append(pair(r % 2 == 1))
            print(f"{name} goodput {runs[name][-1].get('goodput')}", flush=True)
    return {name: goodput_row(rs) for name, rs in runs.items()}


def goodput_row(runs: list[dict]) -> dict:
    """min/median/max of the per-pair ratios, and of the spans they came from."""
    row = {
        "faults": runs[0]["faults"],
        "kill_steps": runs[0]["kill_steps"],
        "goodput": stats([r.get("goodput") for r in runs]),
        "clean_span_s": stats([r["clean"].get("span_s") for r in runs]),
        "faulty_span_s": stats([r["faulty"].get("span_s") for r in runs]),
        "runs": runs,
    }
    if all("bitwise_equal" in r for r in runs):
        row["bitwise_equal"] = all(r["bitwise_equal"] for r in runs)
    kills = [k for r in runs for k in r["faulty"].get("kills", [])]
    if kills:
        row["goodput_in_run"] = stats([r["faulty"].get("goodput_in_run") for r in runs])
        row["kill_to_next_s"] = stats([k["kill_to_next_s"] for k in kills])
        row["stall_s"] = stats([k["stall_s"] for k in kills])
    return row


# -- main -----------------------------------------------------------------------------------


def summarize(runs: list[dict], key: str) -> dict | None:
    return stats([r[key] for r in runs if r.get(key) is not None])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--steps", type=int, help="steps of a recovery run")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--goodput-steps", type=int)
    ap.add_argument("--goodput-repeats", type=int, help="clean+faulty pairs per system")
    ap.add_argument("--skip", nargs="*", default=[], help="perdure torchrun torchft goodput")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    dataset = ensure_dataset()
    repeats = a.repeats or (1 if a.quick else 2)
    steps = a.steps or (16 if a.quick else 30)
    kill_at = a.kill_at or (8 if a.quick else 15)
    gp_steps = a.goodput_steps or (60 if a.quick else 300)
    gp_repeats = a.goodput_repeats or (1 if a.quick else 3)
    t_start = time.perf_counter()
    systems = {}
    for r in range(repeats):
        order = ["perdure", "torchrun", "torchft"]
        order = order[r % 3 :] + order[: r % 3]
        for name in order:
            if name in a.skip:
                continue
            if name == "perdure":
                res = perdure_recovery(dataset, steps, kill_at)
            elif name == "torchrun":
                res = torchrun_recovery(steps, kill_at, a.ckpt_every)
            else:
                res = torchft_recovery(steps, kill_at)
            systems.setdefault(name, []).append(res)
            print(
                f"{name}: recovery {res.get('recovery_s')} s, step before "
                f"{res.get('step_s_before')} s"
                + (f"  ERROR {str(res['error'])[-300:]}" if res.get("error") else ""),
                flush=True,
            )
    recovery = {}
    for name, runs in systems.items():
        recovery[name] = {
            "runs": runs,
            "recovery_s": summarize(runs, "recovery_s"),
            "step_s_before": summarize(runs, "step_s_before"),
        }
    ratios = {}
    p = recovery.get("perdure", {}).get("recovery_s")
    for peer in ("torchrun", "torchft"):
        q = recovery.get(peer, {}).get("recovery_s")
        if p and q:
            ratios[f"{peer}_over_perdure_median"] = q["median"] / p["median"]
    goodput = {}
    if "goodput" not in a.skip:
        goodput = goodput_rows(dataset, gp_steps, gp_repeats, a.ckpt_every, a.skip)
    pr = (recovery.get("perdure") or {}).get("recovery_s") or {}
    pg = ((goodput.get("perdure") or {}).get("goodput") or {}).get("median")
    pgs = ((goodput.get("perdure, 1 warm spare") or {}).get("goodput") or {}).get("median")
    worst_kill = max(
        (
            ((g.get("kill_to_next_s") or {}).get("max") or 0)
            for n, g in goodput.items()
            if "perdure" in n
        ),
        default=None,
    )
    data = {
        "name": "recovery",
        "machine": machine(),
        "quick": a.quick,
        "workload": {
            "replicas": 3,
            "model": REC_MODEL,
            "params_approx": 2.06e6,
            "global_batch": 6,
            "steps": steps,
            "kill_at": kill_at,
            "threads_per_process": 1,
            "goodput_model": GP_MODEL,
            "goodput_global_batch": 12,
            "goodput_steps": gp_steps,
            "goodput_repeats": gp_repeats,
        },
        "goals": {
            "recovery_s <= 0.5": pr.get("median") is not None and pr["median"] <= 0.5,
            "torchrun/perdure >= 10": ratios.get("torchrun_over_perdure_median", 0) >= 10,
            "faster than torchft": ratios.get("torchft_over_perdure_median", 0) > 1,
            "goodput >= 0.95 (1 warm spare)": pgs is not None and pgs >= 0.95,
            "goodput >= 0.95 (no spare)": pg is not None and pg >= 0.95,
            "goodput >= 0.98 (1 warm spare)": pgs is not None and pgs >= 0.98,
            "goodput >= 0.98 (no spare)": pg is not None and pg >= 0.98,
            "kill -> next new step <= 0.2 s (every goodput kill)": bool(worst_kill)
            and worst_kill <= 0.2,
        },
        "recovery": recovery,
        "ratios": ratios,
        "goodput": goodput,
        "seconds": time.perf_counter() - t_start,
    }
    print(json.dumps({"ratios": ratios, "goals": data["goals"]}, indent=1))
    print(f"wrote {write_result('recovery', data, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
