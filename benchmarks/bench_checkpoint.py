"""Checkpoint benchmark: perdure side by side with the plain baselines, ratios over repeats.

    .venv/bin/python benchmarks/bench_checkpoint.py              # ~200M params + Adam, 2.4 GB
    .venv/bin/python benchmarks/bench_checkpoint.py --quick      # small state, seconds
    .venv/bin/python benchmarks/bench_checkpoint.py --params 50e6 --repeats 5

Measured, each ``--repeats`` times (min / median / max, and ratios per repeat):

- snapshot floor: a plain copy of every tensor into preallocated, already-touched buffers;
- async blocking time: ``save()`` with ``snapshot_overlap`` off (the copy inside save), and
  with it on, where ``save()`` + ``wait_snapshot()`` is what the step loop waits for when a
  forward+backward of ``--step-seconds`` runs in between. The simulated step sleeps (an
  accelerator computes; the host CPU is free); ``cpu_step`` repeats it with a CPU-bound
  matmul loop of the same length, where the copy competes with the step for the cores;
- write: perdure's synchronous write (safetensors streamed from tensor memory, CRC-32 on
  threads, fsync, manifest, rename) against a raw sequential write + fsync of the same
  bytes, and against ``torch.save`` + fsync;
- load: ``load_checkpoint(verify=True)`` (every byte read and checked) against
  ``torch.load(weights_only=True)`` of the ``torch.save`` file; both from the page cache;
- checksum: ``zlib.crc32`` on one thread and perdure's threaded CRC, GB/s.

Results go to ``benchmarks/results/checkpoint.json``. Files are written under ``--dir``
(default: a temporary directory in /tmp), which is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoint import AsyncCheckpointer, CheckpointState, load_checkpoint, save_checkpoint
from perdure.checkpoint.config import CheckpointConfig
from perdure.checkpoint.crc import checksum_pool, crc_segments
from perdure.checkpoint.fsio import write_all
from perdure.checkpoint.tensors import byte_view, flatten

ROOT = Path(__file__).resolve().parent


def make_state(params: int) -> CheckpointState:
    """``params`` fp32 parameters in matrices of 1024 columns plus Adam's two moments."""
    cols, per = 1024, max(1, params // 24)
    sizes, left = [], params
    while left > 0:
        n = min(per, left)
        sizes.append(n)
        left -= n
    g = torch.Generator().manual_seed(0)
    model, state = {}, {}
    for i, n in enumerate(sizes):
        shape = (n // cols, cols) if n >= cols else (n,)
        model[f"layer{i}.weight"] = torch.rand(shape, generator=g)
        state[i] = {
            "step": torch.tensor(100.0),
            "exp_avg": torch.rand(shape, generator=g),
            "exp_avg_sq": torch.rand(shape, generator=g),
        }
    optimizer = {
        "state": state,
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(state)}],
    }
    return CheckpointState(
        step=1000,
        model=model,
        optimizer=optimizer,
        rng={"seed": 0},
        data={"dataset": "bench", "cursor": 0},
        config_hash="sha256:bench",
        canonical_config={},
        topology={"workers": 1},
        provenance={"sha": "bench"},
    )


def all_tensors(state: CheckpointState) -> dict[str, torch.Tensor]:
    return flatten(state.model, state.optimizer)[0]


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def stats(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def raw_write(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb", buffering=0) as f:
        for t in tensors.values():
            write_all(f, byte_view(t))
        os.fsync(f.fileno())


def busy_cpu(seconds: float) -> None:
    a = torch.rand(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = (a @ a).clamp_(-1, 1)


def bench_snapshot(
    state: CheckpointState, work: Path, repeats: int, step_s: float | None
) -> dict[str, Any]:
    tensors = all_tensors(state)
    bufs = {k: torch.empty_like(t) for k, t in tensors.items()}
    for k, t in tensors.items():
        bufs[k].copy_(t)  # touch the pages once, as reused snapshot buffers are

    def copy_all() -> None:
        for k, t in tensors.items():
            bufs[k].copy_(t)

    first = [timed(copy_all) for _ in range(repeats)]
    if step_s is None:  # a step somewhat longer than the copy, so overlap can hide it
        step_s = max(0.05, 1.5 * statistics.median(first))
    out: dict[str, Any] = {"plain_copy_s": stats(first)}
    for mode in ("sync_copy", "overlap_sleep_step", "overlap_cpu_step"):
        overlap = mode != "sync_copy"
        ck = AsyncCheckpointer(work / mode, CheckpointConfig(snapshot_overlap=overlap, keep_last=1))
        ck.save(state)  # warm-up: allocates and touches the buffers
        ck.wait()
        plain, blocking, background = [], [], []
        for r in range(repeats):
            # Both sides in the same conditions: the previous checkpoint's writeback is
            # flushed, and the first copy after that pause, whichever it is, runs slow
            # (0.065-0.085 s against 0.052 s back to back), so an untimed copy goes first;
            # then the peer, then the save.
            os.sync()
            copy_all()
            plain.append(timed(copy_all))
            state.step += 1
            t0 = time.perf_counter()
            ck.save(state)
            t_save = time.perf_counter() - t0
            if mode == "overlap_sleep_step":
                time.sleep(step_s)
            elif mode == "overlap_cpu_step":
                busy_cpu(step_s)
            t1 = time.perf_counter()
            ck.wait_snapshot()
            blocking.append(t_save + time.perf_counter() - t1)
            ck.wait()
            background.append(time.perf_counter() - t0)
            del r
        ck.close()
        out[mode] = {
            "plain_copy_s": stats(plain),
            "blocking_s": stats(blocking),
            "ratio_to_plain_copy": stats([b / p for b, p in zip(blocking, plain, strict=True)]),
            "save_to_commit_s": stats(background),
        }
        shutil.rmtree(work / mode, ignore_errors=True)
    bufs.clear()
    out["step_seconds"] = step_s
    return out


def bench_write_load(state: CheckpointState, work: Path, repeats: int) -> dict[str, Any]:
    tensors = all_tensors(state)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    ours, raw, tsave, load, tload = [], [], [], [], []
    for r in range(repeats):
        for name in ("raw", "ours", "torch") if r % 2 == 0 else ("torch", "ours", "raw"):
            d = work / f"{name}-{r}"
            d.mkdir(parents=True)
            if name == "raw":
                raw.append(timed(lambda d=d: raw_write(tensors, d / "raw.bin")))
            elif name == "ours":
                ours.append(timed(lambda d=d: save_checkpoint(d, state)))
            else:
                sd = {"model": state.model, "optimizer": state.optimizer}
                tsave.append(
                    timed(lambda d=d, sd=sd: (torch.save(sd, d / "t.pt"), fsync_file(d / "t.pt")))
                )
        # Loads, both from the page cache (just written); one untimed warm-up of each.
        ckpt = next((work / f"ours-{r}").iterdir())
        if r == 0:
            load_checkpoint(ckpt, verify=True)
            torch.load(work / f"torch-{r}" / "t.pt", weights_only=True)
        load.append(timed(lambda ckpt=ckpt: load_checkpoint(ckpt, verify=True)))
        tload.append(timed(lambda r=r: torch.load(work / f"torch-{r}" / "t.pt", weights_only=True)))
        for name in ("raw", "ours", "torch"):
            shutil.rmtree(work / f"{name}-{r}")
    return {
        "bytes": total,
        "perdure_write_s": stats(ours),
        "raw_write_fsync_s": stats(raw),
        "torch_save_fsync_s": stats(tsave),
        "write_throughput_vs_raw": stats([a / b for a, b in zip(raw, ours, strict=True)]),
        "write_time_vs_torch_save": stats([a / b for a, b in zip(ours, tsave, strict=True)]),
        "perdure_write_GBps": stats([total / s / 1e9 for s in ours]),
        "perdure_load_verified_s": stats(load),
        "torch_load_weights_only_s": stats(tload),
        "load_time_vs_torch_load": stats([a / b for a, b in zip(load, tload, strict=True)]),
    }


def bench_checksum(state: CheckpointState, repeats: int) -> dict[str, Any]:
    views = [byte_view(t) for t in all_tensors(state).values()]
    total = sum(len(v) for v in views)

    def single() -> None:
        c = 0
        for v in views:
            c = zlib.crc32(v, c)

    one = [timed(single) for _ in range(repeats)]
    pool = checksum_pool()
    threaded = [timed(lambda: crc_segments(views, pool)) for _ in range(repeats)]
    return {
        "algorithm": "crc32 (zlib)",
        "single_thread_GBps": stats([total / s / 1e9 for s in one]),
        "perdure_threaded_GBps": stats([total / s / 1e9 for s in threaded]),
        "threads": pool._max_workers,
        "seconds_per_GB_single_thread": statistics.median(one) / (total / 1e9),
    }


def bench_stock_safetensors(state: CheckpointState, work: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    tensors = {k: t for k, t in all_tensors(state).items() if t.dim() > 0}
    path = work / "stock.safetensors"
    s = timed(lambda: (save_file(tensors, str(path)), fsync_file(path)))
    path.unlink()
    return {"save_file_fsync_s": s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--params", type=float, default=200e6, help="model parameters (Adam triples them)"
    )
    ap.add_argument("--quick", action="store_true", help="small state (2M params), 3 repeats")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-seconds", type=float, default=None, help="simulated forward+backward")
    ap.add_argument("--stock-safetensors", action="store_true", help="also time save_file")
    ap.add_argument("--dir", type=Path, default=None, help="where files are written")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "checkpoint.json")
    args = ap.parse_args(argv)
    params = int(2e6 if args.quick else args.params)
    work = Path(tempfile.mkdtemp(prefix="perdure-bench-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        state = make_state(params)
        build_s = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for t in all_tensors(state).values())
        gb = nbytes / 1e9
        print(f"state: {params / 1e6:.0f}M params + Adam = {gb:.2f} GB (built in {build_s:.1f} s)")
        result: dict[str, Any] = {
            "params": params,
            "state_bytes": nbytes,
            "repeats": args.repeats,
            "machine": {
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "platform": platform.platform(),
            },
        }
        result["checksum"] = bench_checksum(state, args.repeats)
        print(json.dumps(result["checksum"], indent=1))
        result["write_load"] = bench_write_load(state, work, args.repeats)
        print(json.dumps(result["write_load"], indent=1))
        result["snapshot"] = bench_snapshot(state, work, args.repeats, args.step_seconds)
        print(json.dumps(result["snapshot"], indent=1))
        if args.stock_safetensors:
            result["stock_safetensors"] = bench_stock_safetensors(state, work)
            print(json.dumps(result["stock_safetensors"], indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
