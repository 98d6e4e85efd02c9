"""Held-out loss of DiLoCo at H = 50 over 16 outer steps (``bench_diloco.py``'s model,
data, batch and held-out set) for ``outer.delay`` and the outer (lr, momentum), on one
worker over loopback: the loss is a pure function of the config (one worker or four give
the same bits), so no shaped links are needed.

    .venv/bin/python benchmarks/sweep_diloco_outer.py DELAY,LR,MOMENTUM ...
    .venv/bin/python benchmarks/sweep_diloco_outer.py 1,0.7,0.0 1,0.5,0.0

One JSON line per setting: its final held-out loss and final hash.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO

sys.path.insert(0, str(REPO))


def main(argv: list[str]) -> int:
    from bench_diloco import MODEL

    from perdure.events import read_jsonl
    from tests.runtime_support import build_dataset, build_small_dataset, run_to_end, small_config

    with tempfile.TemporaryDirectory(prefix="sweep-diloco-") as d:
        base = Path(d)
        dataset = build_small_dataset(base / "data")
        held = base / "held_out"
        build_dataset([str(Path(os.__file__).parent / "unittest")], str(held), seq_len=64,
                      part_mb=0.05, include="*.py")  # fmt: skip
        for spec in argv:
            delay, lr, momentum = spec.split(",")
            outer = {"replicas": 4, "inner_steps": 50, "precision": "fp32", "lr": float(lr),
                     "momentum": float(momentum), "delay": int(delay)}  # fmt: skip
            cfg = small_config(
                dataset, workers=1, regions=1, steps=16, slots=4, batch=16,
                task={"options": MODEL}, outer=outer, train={"reduction_exponents": "step"},
                checkpoint={"every_steps": 10**6, "keep_last": 1},
                eval={"dataset": str(held), "every_steps": 16, "samples": 64, "batch_size": 32},
            )  # fmt: skip
            run_dir = base / f"run-{spec}"
            shutil.rmtree(run_dir, ignore_errors=True)
            s = run_to_end(cfg, run_dir, timeout_s=900)
            ev = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "eval/loss" in m]
            print(json.dumps({"delay": int(delay), "lr": float(lr), "momentum": float(momentum),
                              "eval_loss": ev[-1]["eval/loss"] if ev else None,
                              "final_hash": s.get("final_hash")}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
