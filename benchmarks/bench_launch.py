"""Start-up overhead of the Ray launcher against the local launcher, side by side.

The same small run (``tests/runtime_support.small_config``: 3 workers over 2 regions) is
started by the local launcher and by the Ray launcher on a local multi-node Ray cluster
(``tests/ray_support``: a head in r0, two raylets in r1, all on this machine), alternating
per repeat. For each: the seconds from ``perdure.run`` to the coordinator's ``coordinator_up``,
to the last worker's ``join``, to the first committed step (the start-up), and the wall
time of the whole run; the ratios Ray / local, paired per repeat. The cluster's own
start-up is reported apart: it exists before any run. Both launchers end with the same
final hash (checked: a run that did not is reported, not timed).

    .venv/bin/python benchmarks/bench_launch.py [--repeats 3] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import REPO, machine, ratios, stats, write_result


def _one(launcher: str, config: Any, root: Path, address: str) -> dict[str, Any]:
    from perdure.launch.api import run

    rd = root / f"{launcher}-{time.time_ns()}"
    t0 = time.time()
    kwargs = {"launcher": "ray", "ray_address": address} if launcher == "ray" else {}
    summary = run(config, run_dir=rd, timeout_s=600, **kwargs)
    events = [json.loads(x) for x in (rd / "events.jsonl").read_text().splitlines() if x]
    metrics = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines() if x]
    up = min(e["t"] for e in events if e["event"] == "coordinator_up")
    joined = max(e["t"] for e in events if e["event"] == "join")
    return {
        "coordinator_up_s": up - t0,
        "all_joined_s": joined - t0,
        "first_step_s": min(m["t"] for m in metrics) - t0,
        "wall_s": time.time() - t0,
        "final_hash": summary["final_hash"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="1 repeat, 10 steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    repeats, steps = (1, 10) if args.quick else (args.repeats, args.steps)
    try:
        import ray  # noqa: F401
    except ImportError:
        write_result("launch", {"benchmark": "launch", "skipped": "ray is not installed: "
                                "pip install 'perdure[ray]'"}, args.out)  # fmt: skip
        print("skipped: ray is not installed")
        return

    from tests.ray_support import local_ray_cluster
    from tests.runtime_support import build_small_dataset, small_config

    m = machine()
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        root = Path(tmp)
        dataset = build_small_dataset(REPO / "runs" / "datasets" / "stdlib-small")
        config = small_config(dataset, workers=3, regions=2, steps=steps)
        t0 = time.perf_counter()
        with local_ray_cluster() as cluster:
            cluster_s = time.perf_counter() - t0
            rows: dict[str, list[dict[str, Any]]] = {"local": [], "ray": []}
            for i in range(repeats):
                order = ("local", "ray") if i % 2 == 0 else ("ray", "local")
                for name in order:
                    rows[name].append(_one(name, config, root, cluster.address))
                    print(name, {k: round(v, 2) for k, v in rows[name][-1].items()
                                 if k != "final_hash"}, flush=True)  # fmt: skip
    hashes = {r["final_hash"] for rs in rows.values() for r in rs}
    keys = ("coordinator_up_s", "all_joined_s", "first_step_s", "wall_s")
    result = {
        "benchmark": "launch",
        "machine": m,
        "workers": 3,
        "regions": 2,
        "steps": steps,
        "repeats": repeats,
        "ray_cluster_nodes": 3,
        "ray_cluster_start_s": round(cluster_s, 2),
        "same_final_hash": len(hashes) == 1,
        "local": {k: stats([r[k] for r in rows["local"]]) for k in keys},
        "ray": {k: stats([r[k] for r in rows["ray"]]) for k in keys},
        "ratio_ray_over_local_first_step": ratios(
            [r["first_step_s"] for r in rows["ray"]], [r["first_step_s"] for r in rows["local"]]
        ),
        "ratio_ray_over_local_wall": ratios(
            [r["wall_s"] for r in rows["ray"]], [r["wall_s"] for r in rows["local"]]
        ),
        "limits": "one machine (2 cores, shared): the Ray nodes, their fork servers and the "
        "training compete for the same cores; on separate nodes the actors' imports run in "
        "parallel. The cluster exists before the run and its start-up is not counted.",
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    write_result("launch", result, args.out)


if __name__ == "__main__":
    main()
