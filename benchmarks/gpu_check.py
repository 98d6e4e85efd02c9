"""The GPU check (issue 17, item 5): what the CUDA paths must show on a GPU, in one short
run (budget: 8 minutes on one H200). Writes ``results/gpu_check.json`` with the date.

1. CUDA slot gradients bitwise equal across processes: two fresh processes compute the
   same four slots of step 0 on the GPU; their CRCs must match.
2. Final hashes of short ``perdure run``s on the GPU: W = 1 with NCCL; W = 1, 2, 3 sharing
   the one GPU with ``cluster.data_plane = "gloo"`` (NCCL refuses two ranks on one
   device); all must be equal. fp32 and bf16 (two hashes, each equal across W). W = 2 in
   one replica group with the parameters sharded at rest (``train.shard_params``: CUDA
   parameters gathered through the gloo group's host buffers; the gradient sum
   reduce-scattered and clipped from per-parameter norms taken on the GPU) and W = 2 with
   the optimizer state sharded and the sum reduced whole (``train.shard_reduce``) must
   give the fp32 hash. ``task.init = "per_module"`` at W = 1 (NCCL) and W = 2 sharded at
   rest (each rank initialising only its shard, on the CPU, copied to the GPU): one hash.
3. Step time against a plain loop on the same GPU (same model, batch and optimizer, no
   slots, no reduction), and the checkpoint snapshot's blocking time from the events.
4. The snapshot's side-stream device-to-host copy of 256 MB into a pinned buffer: equal
   bytes, and its time.

5. Issue 15's speed goals for the exact reduction on this host's CPUs, which give a core
   per rank (the 2-core development machine cannot: ``docs/performance.md`` section 6):
   ``bench_exact.py --floors`` at W = 2, 3, 4, 16 and 64 MB, its medians over gloo's
   float32 all_reduce, into ``results/exact_core_per_rank.json``. Skipped on fewer than
   8 cores.

Usage (a CUDA build of torch, from the repository root): ``python benchmarks/gpu_check.py``.
On a host without CUDA it says so and exits 2: nothing here ran on a GPU until then.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from perdure.events import read_jsonl  # noqa: E402
from perdure.run_config import RunConfig, with_overrides  # noqa: E402

STEPS = 30
MODEL = {"d_model": 128, "n_layers": 2, "n_heads": 4, "max_len": 128}


def config(
    dataset: str, workers: int, precision: str, plane: str, init: str = "eager", **train: Any
) -> RunConfig:
    return with_overrides(
        RunConfig(),
        task={"options": MODEL, "init": init},
        train={
            "steps": STEPS,
            "global_batch": 32,
            "slots": 8,
            "device": "cuda",
            "precision": precision,
            "reduction": "exact",
            **train,
        },
        data={"dataset": dataset},
        cluster={"regions": [{"name": "g", "workers": workers}], "data_plane": plane},
        checkpoint={"every_steps": 10},
        run={"base_dir": str(REPO)},
    )


def slot_crcs(dataset: str) -> list[int]:
    """CRCs of four slot gradients of step 0, in this process."""
    from perdure.runtime.replica.trainer import Trainer

    tr = Trainer(config(dataset, 1, "fp32", "auto"))
    bufs = [tr.engine.new_buffer() for _ in range(4)]
    tr.compute_slots(0, range(4), bufs)
    torch.cuda.synchronize()
    return [zlib.crc32(b.cpu().numpy().tobytes()) for b in bufs]


def run_hash(
    dataset: str, workers: int, precision: str, plane: str, init: str = "eager", **train: Any
) -> dict[str, Any]:
    from perdure.launch.api import run

    with tempfile.TemporaryDirectory() as tmp:
        rd = Path(tmp) / "run"
        t0 = time.perf_counter()
        cfg = config(dataset, workers, precision, plane, init, **train)
        s = run(cfg, run_dir=rd, timeout_s=240)
        wall = time.perf_counter() - t0
        steps = [m["step_s"] for m in read_jsonl(rd / "metrics.jsonl")]
        snaps = [
            e["snapshot_seconds"]
            for e in read_jsonl(rd / "events.jsonl")
            if e["event"] == "checkpoint_saved"
        ]
    return {
        "workers": workers,
        "precision": precision,
        "data_plane": plane,
        "init": init,
        "train": train,
        "final_hash": s["final_hash"],
        "wall_s": round(wall, 2),
        "median_step_s": round(statistics.median(steps[5:]), 5),
        "snapshot_s": snaps,
    }


def plain_step_s(dataset: str) -> float:
    """Median step time of a plain loop on the GPU: the tiny_lm, AdamW, batch 32."""
    from perdure.runtime.replica.task import build_task

    cfg = config(dataset, 1, "fp32", "auto")
    task = build_task(cfg.task, 0, str(REPO))
    model = task.model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (32, 128), device="cuda")  # byte tokens, the stdlib's
    batch = {"tokens": tokens, "weight": torch.ones(32, device="cuda")}
    times = []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        task.loss_fn(model, batch).backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:])


def snapshot_check(mb: int = 256) -> dict[str, Any]:
    """The snapshot's side-stream copy of ``mb`` MB into a pinned buffer: the bytes, and
    the time ``copy_into`` blocks (the second copy: the first allocates the stream)."""
    from perdure.checkpoint.snapshot import SnapshotBuffers, copy_into

    src = torch.randn(mb * 2**18, device="cuda")
    dst = SnapshotBuffers().buffer_for("x", src)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copy_into([(src, dst)])
        times.append(time.perf_counter() - t0)
    return {
        "mb": mb,
        "pinned": dst.is_pinned(),
        "bytes_equal": bool(torch.equal(dst, src.cpu())),
        "copy_s": round(min(times[1:]), 5),
        "gb_per_s": round(mb / 1024 / min(times[1:]), 2),
    }


def exact_core_per_rank() -> dict[str, Any]:
    """Item 5: the exact reduction against gloo's all_reduce with a core per rank."""
    cores = os.cpu_count() or 1
    if cores < 8:
        return {"skipped": f"{cores} cores: fewer than 8 cannot give a core per rank"}
    path = REPO / "benchmarks" / "results" / "exact_core_per_rank.json"
    args = ["--floors", "--sizes-mb", "16", "64", "--worlds", "2", "3", "4"]
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_exact.py"), *args]
    subprocess.run([*cmd, "--repeats", "5", "--out", str(path)], check=True, timeout=300)
    rows = json.loads(path.read_text())["rows"]
    keys = ("exact32", "exact64", "int32_all_reduce", "int64_all_reduce")
    return {
        "cores": cores,
        "rows": [
            {"workers": r["workers"], "mb": r["mb"]}
            | {k: round(r[f"ratio_{k}_over_all_reduce"]["median"], 3) for k in keys}
            for r in rows
        ],
        "int32_goal_met": all(r["ratio_exact32_over_all_reduce"]["median"] <= 1.10 for r in rows),
        "int64_goal_met": all(r["ratio_exact64_over_all_reduce"]["median"] <= 2.1 for r in rows),
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--slots":
        print(json.dumps(slot_crcs(sys.argv[2])))
        return 0
    if not torch.cuda.is_available():
        print(f"no CUDA here (torch {torch.__version__}, CUDA build {torch.version.cuda})")
        return 2
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _common import ensure_dataset

    dataset = ensure_dataset()
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    crcs = [
        json.loads(
            subprocess.run(
                [sys.executable, __file__, "--slots", dataset],
                capture_output=True, text=True, check=True, timeout=180,
            ).stdout.splitlines()[-1]
        )
        for _ in range(2)
    ]  # fmt: skip
    out["slot_crcs_equal_across_processes"] = crcs[0] == crcs[1]
    runs = [run_hash(dataset, 1, "fp32", "nccl")]
    runs += [run_hash(dataset, w, p, "gloo") for p in ("fp32", "bf16") for w in (1, 2, 3)]
    runs.append(run_hash(dataset, 2, "fp32", "gloo", shard_degree=2, shard_params=True))
    runs.append(run_hash(dataset, 2, "fp32", "gloo", shard_degree=2, shard_reduce="whole"))
    runs.append(run_hash(dataset, 1, "fp32", "nccl", "per_module"))
    runs.append(
        run_hash(dataset, 2, "fp32", "gloo", "per_module", shard_degree=2, shard_params=True)
    )
    out["runs"] = runs
    for p in ("fp32", "bf16"):
        hashes = {r["final_hash"] for r in runs if r["precision"] == p and r["init"] == "eager"}
        out[f"{p}_hashes_equal"] = len(hashes) == 1
    per_module = {r["final_hash"] for r in runs if r["init"] == "per_module"}
    out["per_module_hashes_equal"] = len(per_module) == 1
    out["snapshot"] = snapshot_check()
    plain = plain_step_s(dataset)
    w1 = next(r for r in runs if r["workers"] == 1 and r["data_plane"] == "nccl")
    out["plain_loop_step_s"] = round(plain, 5)
    out["step_ratio_w1_vs_plain"] = round(w1["median_step_s"] / plain, 3)
    out["exact_core_per_rank"] = exact_core_per_rank()
    path = REPO / "benchmarks" / "results" / "gpu_check.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    ok = out["slot_crcs_equal_across_processes"] and out["fp32_hashes_equal"]
    ok = ok and out["per_module_hashes_equal"]
    ok = ok and out["snapshot"]["bytes_equal"]
    return 0 if ok and out["bf16_hashes_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
