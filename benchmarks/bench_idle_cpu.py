"""What CPU work at the lowest priority costs a training run on this machine.

A replacement worker starts at the lowest priority (``runtime/member/priority.py``: its
session's autogroup at nice 19, every thread ``SCHED_IDLE``) so that its start-up takes
only what the members leave idle. This measures whether "idle" is free here: the goodput
setup's fault-free run (3 members and a warm spare, d_model 64, 300 steps,
``bench_kill_cost.py``'s model) alone, and beside ``burners`` processes that spin in
Python for the whole run at that same priority (``priority.yield_cpu`` in a session of
their own, as a forked worker does), and, where this kernel has cgroup v1's or v2's
``cpu.idle`` and this process may write it, beside burners in a cgroup marked idle (the
kernel's own way to run a group only on idle CPUs). Arms alternate (alone, then each
burner arm, repeated), so a drift of the shared machine spreads over all of them.

Reports each arm's median step time and its ratio to the run alone. Limits: a burner
spins in the interpreter (little memory traffic); a replacement's start-up also faults
pages and allocates, which the ``--mode mem`` burner approximates (64 MB touched per
round). The run's own processes are at normal priority throughout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, ensure_dataset, machine, stats, unwind_on_sigterm, write_result
from bench_kill_cost import MODELS
from bench_recovery import gaps, perdure_cfg
from bench_step import perdure_run

BURN = """
import os, sys
from perdure.lifecycle import die_with_parent
die_with_parent(os.getppid())  # a benchmark killed outright leaves no burner spinning
os.setsid()
from perdure.runtime.member.priority import yield_cpu
if sys.argv[2] == "priority":
    yield_cpu()
mode = sys.argv[1]
print("ready", flush=True)
x = 0
while True:
    if mode == "cpu":
        for i in range(100_000):
            x += i
    else:
        b = bytearray(64 << 20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        del b
"""
CGROUPS = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup"))
"""Where an idle cgroup is made: cgroup v1's cpu hierarchy, else the v2 root."""


def idle_cgroup() -> Path | None:
    """A fresh cgroup with ``cpu.idle`` = 1, or None where none can be made."""
    for root in CGROUPS:
        if not (root / "cpu.idle").exists() and not (root / "cgroup.subtree_control").exists():
            continue
        path = root / f"perdure-bench-idle-{os.getpid()}"
        try:
            path.mkdir(exist_ok=True)
            (path / "cpu.idle").write_text("1\n")
            return path
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
    return None


@contextlib.contextmanager
def burners(n: int, mode: str, cgroup: Path | None) -> Iterator[None]:
    """``n`` spinning processes at the lowest priority (or in ``cgroup``) while inside."""
    how = "cgroup" if cgroup else "priority"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BURN, mode, how], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(n)
    ]
    try:
        for p in procs:
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text(f"{p.pid}\n")
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a burner failed to start (exit {p.poll()})")
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def step_time(cfg: dict, steps: int, run_dir: Path) -> float:
    """The run's median seconds between commits, its first 20 steps left out."""
    r = perdure_run(cfg, steps, run_dir, timeout_s=900)
    if r["rc"]:
        raise RuntimeError(f"the run failed: {r['stderr_tail']}")
    return statistics.median(g for s, g in gaps(r["metrics"]).items() if s > 20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="rounds of every arm")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--mode", choices=("cpu", "mem"), default="cpu", help="what a burner does")
    ap.add_argument("--out", help="the result file (default: results/idle_cpu.json)")
    a = ap.parse_args(argv)
    unwind_on_sigterm()
    cfg = perdure_cfg(MODELS["gp"], 12, ensure_dataset())
    cfg["cluster"]["spares"] = 1
    cgroup = idle_cgroup()
    arms = {"alone": (0, None), "1 burner": (1, None), "2 burners": (2, None)}
    if cgroup is not None:
        arms["1 burner, idle cgroup"] = (1, cgroup)
    load0, t0 = os.getloadavg(), time.perf_counter()
    times: dict[str, list[float]] = {name: [] for name in arms}
    try:
        with tempfile.TemporaryDirectory(prefix="perdure-bench-idle-") as d:
            for i in range(a.repeats):
                for name, (n, group) in arms.items():
                    with burners(n, a.mode, group):
                        s = step_time(cfg, a.steps, Path(d) / f"{i}-{n}-{bool(group)}")
                    times[name].append(s)
                    print(f"{i} {name}: median step {s * 1000:.1f} ms", flush=True)
    finally:
        if cgroup is not None:
            with contextlib.suppress(OSError):
                cgroup.rmdir()
    alone = statistics.median(times["alone"])
    data = {
        "name": "idle_cpu",
        "machine": machine(),
        "load_start": load0,
        "load_end": os.getloadavg(),
        "workload": {"model": MODELS["gp"], "steps": a.steps, "spares": 1, "mode": a.mode},
        "idle_cgroup": str(cgroup) if cgroup else None,
        "arms": {
            name: {"step_s": stats(ts), "ratio_to_alone": statistics.median(ts) / alone}
            for name, ts in times.items()
        },
        "seconds": time.perf_counter() - t0,
    }
    print(json.dumps(data["arms"], indent=1))
    print(f"wrote {write_result('idle_cpu', data, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
